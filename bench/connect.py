"""Time to a usable ``RemoteLM``: connect, then the first ``byte_vocab`` and ``str_vocab``.

Starts a private Redis and one worker with the default model (``LMPOOL_BACKEND=hf`` on the
CPU; LMPOOL_MODEL unset = the bundled SmolLM2-135M-Instruct, vocabulary 49,152), waits until
it serves, then runs ``--runs`` fresh producer processes per scenario. Each one times, in order:

1. imports: ``from producer import RemoteLM`` (scenario ``producer``), plus
   ``import genlm.backend`` (scenario ``genlm``: a genlm-control program has imported it);
2. ``await RemoteLM.connect(...)``: metadata from Redis, the tokenizer rebuilt from its JSON;
3. the first ``lm.byte_vocab`` and then the first ``lm.str_vocab``;
4. total after imports: 2 + 3, the figure to keep under 1 s.

Each child also checks that the vocabularies have the model's size and says which ``Token``
class it got. Lines are ``scenario phase median min max`` over the runs, in seconds.

    python bench/connect.py --runs 5 --out bench/results/connect-cpu.txt --append --label after
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

PHASES = ("imports", "connect", "byte_vocab", "str_vocab", "after_imports")
SCENARIOS = ("producer", "genlm")


# -- the measured child -----------------------------------------------------------------------
def child(redis_url: str, model: str, scenario: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    from producer import RemoteLM

    if scenario == "genlm":
        import genlm.backend  # noqa: F401
    from shared.settings import Settings

    t1 = time.perf_counter()

    async def run() -> dict[str, Any]:
        settings = Settings(redis_url=redis_url, connect_timeout_s=30.0)
        t2 = time.perf_counter()
        lm = await RemoteLM.connect(model=model, settings=settings)
        t3 = time.perf_counter()
        byte_vocab = lm.byte_vocab
        t4 = time.perf_counter()
        str_vocab = lm.str_vocab
        t5 = time.perf_counter()
        await lm.close()
        assert len(byte_vocab) == len(str_vocab) == lm.vocab_size, "vocabulary size"
        token = type(byte_vocab[0])
        return {
            "imports": t1 - t0,
            "connect": t3 - t2,
            "byte_vocab": t4 - t3,
            "str_vocab": t5 - t4,
            "after_imports": t5 - t2,
            "token_class": f"{token.__module__}.{token.__qualname__}",
            "vocab_size": lm.vocab_size,
        }

    return asyncio.run(run())


def run_child(redis_url: str, model: str, scenario: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPOOL_")}
    cmd = [sys.executable, __file__, "--child", scenario, "--redis-url", redis_url]
    out = subprocess.run(
        [*cmd, "--model", model], env=env, capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# -- the harness --------------------------------------------------------------------------------
async def main(args: argparse.Namespace, report: Any) -> None:
    import benchkit
    import poolbench

    from localpool.redis_server import RedisServer
    from shared.settings import Settings

    here = Settings.from_env()
    model = here.served_model_name
    settings: dict[str, Any] = {
        "backend": "hf",
        "device": "cpu",
        "kv_cache_mb": 0,
        "log_level": "WARNING",
        "cache_dir": here.cache_dir,
    }
    if here.model:
        settings["model"] = here.model
    report.line(poolbench.SHARED_NOTE)
    report.line(poolbench.code_version())
    report.line(f"# label: {args.label}; model {model}; {args.runs} fresh processes per scenario")
    with RedisServer() as server:
        worker = benchkit.Worker(server.url, **settings).start()
        try:
            t0 = time.perf_counter()
            lm = await benchkit.connect_remote_lm(worker, server.url, model, 300.0, 30.0)
            await lm.close()
            report.line(f"# worker ready after {time.perf_counter() - t0:.1f} s")
            rows: dict[str, list[dict[str, Any]]] = {s: [] for s in SCENARIOS}
            for _ in range(args.runs):  # interleaved, so drift of a shared machine hits both
                for scenario in SCENARIOS:
                    rows[scenario].append(run_child(server.url, model, scenario))
        finally:
            worker.stop()
    report.line(f"{'scenario':<10} {'phase':<14} {'median s':>9} {'min s':>8} {'max s':>8}")
    for scenario in SCENARIOS:
        for phase in PHASES:
            values = [r[phase] for r in rows[scenario]]
            report.line(
                f"{scenario:<10} {phase:<14} {statistics.median(values):>9.3f} "
                f"{min(values):>8.3f} {max(values):>8.3f}"
            )
        first = rows[scenario][0]
        report.line(
            f"# {scenario}: token class {first['token_class']}, vocabulary {first['vocab_size']}"
        )
    report.line(f"# load at the end: {benchkit.load_average()}")


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per scenario")
    parser.add_argument("--label", default="", help="a name for this run (e.g. before/after)")
    parser.add_argument("--child", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also write the output to this file")
    parser.add_argument("--append", action="store_true", help="append to --out, not replace")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.redis_url, args.model, args.child)))
        return 0
    import benchkit

    return benchkit.run_reported(main, args)


if __name__ == "__main__":
    sys.exit(cli())
