"""A worker serving SMC run after run: does its resident memory stay flat?

One hf worker (tiny model, KV cache on, 1 torch thread) serves ``--runs`` SMC runs of
``bench/efficiency.py``'s shape one after another (64 particles, a new 256-token prompt each
run, 32 steps, resampled every 4th), as a shared pool serves many researchers' runs. After
each run: the worker's VmRSS and what its KV cache holds (``bytes_used`` of its heartbeat; at
most ``LMPOOL_KV_CACHE_MB``, 512 by default). The anchor is the worker's RSS after the first
run: what it grows beyond that, against what its KV cache grew. A busy worker gives its free
memory back once it has grown 256 MiB since the last time (``shared.heap.Trimmer``), so its RSS
rises and falls within that band rather than staying flat.

    python bench/worker_memory.py                 # 20 runs (640 steps)

For a before / after, the pool (worker, producer, ``localpool``) from another checkout, this
script and its bench helpers from this one: ``git worktree add /tmp/old REV``, then
``cd /tmp/old && PYTHONPATH=/tmp/old python /path/to/bench/worker_memory.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import benchkit
import efficiency
import poolbench
import random_model
import torch

MIB = 1 << 20


async def run(args: argparse.Namespace, report: benchkit.Report) -> None:
    from localpool.redis_server import RedisServer

    torch.set_num_threads(1)
    from localpool import launch

    report.line(
        f"# hf worker from {launch.SOURCE_ROOT}, tiny model, KV "
        f"cache on, 1 torch thread; {args.runs} SMC runs ({args.particles} particles, "
        f"{args.prompt_tokens}-token prompt, {args.steps} steps each, a new prompt each run)"
    )
    env = {"OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="lmpool-memory-") as tmp:
        path = random_model.build(
            Path(tmp), "tiny", random_model.default_tokenizer_dir(), torch.float32, 0
        )
        with RedisServer() as server:
            worker = benchkit.Worker(
                server.url,
                extra_env=env,
                backend="hf",
                model=str(path),
                model_name="memory",
                torch_threads=1,
                max_batch=64,
                log_level="WARNING",
                heartbeat_s=0.5,
            ).start()
            rss: list[float] = []
            kv: list[float] = []
            rows, seconds = 0, 0.0
            try:
                lm = await benchkit.connect_remote_lm(worker, server.url, "memory", 600, 3600)
                try:
                    for i in range(args.runs):
                        n, s = await efficiency.pool_smc(lm, args, args.seed + i)
                        rows, seconds = rows + n, seconds + s
                        await asyncio.sleep(0.6)  # the heartbeat after the run: KV counters
                        rss.append(poolbench.rss_mib(worker.pid))
                        kv.append(benchkit.kv_totals(server.url).get("bytes_used", 0) / MIB)
                finally:
                    await lm.close()
            finally:
                worker.stop()
    every = max(1, len(rss) // 10)
    report.line(
        f"{rows / seconds:.1f} rows/s; worker RSS MiB after runs 1,{1 + every}..: "
        + " ".join(f"{v:.0f}" for v in rss[::every])
        + f" (last {rss[-1]:.0f}, highest {max(rss):.0f}); KV cache MiB: "
        + " ".join(f"{v:.0f}" for v in kv[::every])
        + f" (last {kv[-1]:.0f})"
    )
    grown, kv_grown = rss[-1] - rss[0], kv[-1] - kv[0]
    runs = max(1, len(rss) - 1)
    report.line(
        f"after run 1: RSS grew {grown:.0f} MiB over {runs} runs ({grown / runs:.1f} a run), the "
        f"KV cache {kv_grown:.0f} MiB; beyond the KV cache {(grown - kv_grown) / runs:.1f} MiB "
        "a run (target: ~0 over many runs; within the trim's 256 MiB band)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="SMC runs, one after another")
    efficiency.workload_args(parser)
    benchkit.output_args(parser)
    return benchkit.run_reported(run, parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
