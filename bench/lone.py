"""A lone request's latency through one hf worker, for two checkouts of the pool, alternating.

One researcher, one request at a time (``RemoteLM.next_token_logprobs``, no local cache): the
latency that a single genlm-control particle, or anyone poking at the pool by hand, sees. Two
workloads, each ``--samples`` requests after ``--warmup`` untimed ones:

- cold: distinct random prompts of ``--tokens`` tokens (nothing in any cache helps);
- extend: one prompt of ``--tokens`` tokens growing by a token a request (the worker's KV cache
  holds the previous prefix, as for a lone SMC particle).

Each checkout (``--roots``) runs its own pool: its worker (``python -m arq
worker.WorkerSettings`` in that folder) and its producer (a child process of this script with
that folder first on ``PYTHONPATH``), on one Redis server that this process starts and flushes
between runs. The models: ``tiny`` (``bench/random_model.py``'s, whose forward pass costs next
to nothing: the pool's own path shows), ``default`` (the bundled SmolLM2-135M) and ``mock``
(the mock backend: the pool's path alone, nothing computed). One torch thread in the worker.
The pairs alternate their order, since this machine's speed drifts.

    git worktree add /tmp/filing 93a2166
    python bench/lone.py --roots /tmp/filing,. --pairs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

WORKLOADS = ("cold", "extend")
MOCK = "mock"
"""``--models mock``: the mock backend (no model; rows of ``MOCK_VOCAB`` float32 values, as
SmolLM2's): the pool's own path, with nothing computed."""
MOCK_VOCAB = 49152


# -- the child: one pool (one checkout), one model ----------------------------------------------
async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    from producer import RemoteLM  # the checkout's own: PYTHONPATH puts it first

    rng = random.Random(args.seed)
    vocab = args.vocab

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    lm = await RemoteLM.connect(
        args.url, model="lone", cache_size=0, connect_timeout_s=args.start_timeout_s
    )

    async def timed(prompts: Iterator[list[int]]) -> list[float]:
        """ms of each request after the first ``--warmup``."""
        times: list[float] = []
        for i in range(args.warmup + args.samples):
            prompt = next(prompts)
            t0 = time.perf_counter()
            await lm.next_token_logprobs(prompt)
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1000)
        return times

    def cold() -> Iterator[list[int]]:
        while True:
            yield tokens(args.tokens)

    def extend() -> Iterator[list[int]]:
        prompt = tokens(args.tokens)
        while True:
            prompt = [*prompt, rng.randrange(3, vocab)]
            yield prompt

    try:
        out = {"cold": await timed(cold()), "extend": await timed(extend())}
    finally:
        await lm.close()
    return out


def child(args: argparse.Namespace) -> int:
    root = Path.cwd()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPOOL_")}
    env.update(
        LMPOOL_REDIS_URL=args.url,
        LMPOOL_MODEL_NAME="lone",
        LMPOOL_TORCH_THREADS="1",
        LMPOOL_LOG_LEVEL="WARNING",
        OMP_NUM_THREADS="1",
    )
    if args.model_path == MOCK:
        env.update(LMPOOL_BACKEND="mock", LMPOOL_MOCK_VOCAB_SIZE=str(args.vocab))
    else:
        env.update(LMPOOL_BACKEND="hf", LMPOOL_MODEL=args.model_path)
    with tempfile.NamedTemporaryFile("w+b", prefix="lmpool-lone-", suffix=".log") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "arq", "worker.WorkerSettings"],
            cwd=root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            result = asyncio.run(measure(args))
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read()[-4000:].decode(errors="replace"))
            raise
        finally:
            worker.terminate()
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
    import producer

    print(json.dumps({"times": result, "producer": producer.__file__}))
    return 0


# -- the driver: models, Redis, the alternating pairs -------------------------------------------
def models(names: list[str], tmp: Path) -> dict[str, tuple[Path, int]]:
    """Each model's folder (``MOCK`` for the mock backend) and vocabulary size."""
    import benchkit
    import random_model
    import torch

    out: dict[str, tuple[Path, int]] = {}
    for name in names:
        if name == MOCK:
            out[name] = (Path(MOCK), MOCK_VOCAB)
            continue
        if name == "tiny":
            path = random_model.build(
                tmp / "tiny", "tiny", random_model.default_tokenizer_dir(), torch.float32, 0
            )
        else:
            path = benchkit.model_dir()
        config = json.loads((path / "config.json").read_text())
        out[name] = (path, int(config["vocab_size"]))
    return out


def run_one(
    args: argparse.Namespace, root: Path, url: str, model: Path, vocab: int
) -> dict[str, list[float]]:
    """The child's latencies (ms) per workload, checked to come from ``root``'s producer."""
    import redis

    redis.Redis.from_url(url).flushall()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMPOOL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--url",
        url,
        "--model-path",
        str(model),
        "--vocab",
        str(vocab),
        "--tokens",
        str(args.tokens),
        "--samples",
        str(args.samples),
        "--warmup",
        str(args.warmup),
        "--seed",
        str(args.seed),
    ]
    done = subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=args.run_timeout_s
    )
    if done.returncode != 0:
        raise RuntimeError(f"{root}: exit {done.returncode}\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not str(result["producer"]).startswith(str(root)):
        raise RuntimeError(f"the producer for {root} came from {result['producer']}")
    times: dict[str, list[float]] = result["times"]
    return times


def driver(args: argparse.Namespace) -> int:
    import benchkit

    from localpool.redis_server import RedisServer

    roots = [Path(r).resolve() for r in args.roots.split(",")]
    names = args.models.split(",")
    report = benchkit.Report(args.out, getattr(args, "append", False))
    try:
        for i, root in enumerate(roots):
            rev = subprocess.run(
                ["git", "-C", str(root), "log", "-1", "--format=%h %cs"],
                capture_output=True,
                text=True,
            ).stdout.strip()
            report.line(f"# pool {i + 1}: {root} ({rev or 'not a git checkout'})")
        report.line(
            f"# one worker (hf; mock for the mock), 1 torch thread, KV cache at its default; "
            f"{args.samples} requests of {args.tokens} tokens per workload after {args.warmup} "
            f"untimed; {args.pairs} pairs, the order alternating"
        )
        p50: dict[tuple[str, str, int], list[float]] = {}
        with tempfile.TemporaryDirectory(prefix="lmpool-lone-") as tmp, RedisServer() as server:
            for name, (path, vocab) in models(names, Path(tmp)).items():
                for pair in range(args.pairs):
                    order = list(range(len(roots)))
                    if pair % 2:
                        order.reverse()
                    for i in order:
                        result = run_one(args, roots[i], server.url, path, vocab)
                        cells = []
                        for w in WORKLOADS:
                            value = statistics.median(result[w])
                            p50.setdefault((name, w, i), []).append(value)
                            cells.append(f"{w} p50 {value:.2f} ms")
                        report.line(f"{name:8} pair {pair + 1} pool {i + 1}: " + ", ".join(cells))
        report.line("")
        report.line(
            f"{'model':8} {'workload':8} "
            + " ".join(f"pool {i + 1} p50 ms" for i in range(len(roots)))
            + "  last / first, each pair"
        )
        for name in names:
            for w in WORKLOADS:
                series = [p50[(name, w, i)] for i in range(len(roots))]
                ratios = [b / a for a, b in zip(series[0], series[-1], strict=True)]
                report.line(
                    f"{name:8} {w:8} "
                    + " ".join(" ".join(f"{v:6.2f}" for v in s) + " |" for s in series)
                    + "  "
                    + ", ".join(f"{r:.2f}x" for r in ratios)
                )
    finally:
        report.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roots", default=".", help="checkouts, comma-separated (anchor first)")
    parser.add_argument(
        "--models", default="tiny,default", help="tiny, default, mock, comma-separated"
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-timeout-s", type=float, default=600)
    if not any(a == "--child" for a in (argv if argv is not None else sys.argv[1:])):
        import benchkit

        benchkit.output_args(parser)
    # the child's own arguments
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--start-timeout-s", type=float, default=300, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return child(args) if args.child else driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
