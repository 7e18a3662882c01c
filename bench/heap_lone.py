"""A lone request's latency with the producer's C heap kept (``RemoteLM``'s default,
``shared/heap.py``) and at glibc's defaults (``LMPOOL_KEEP_FREED_MEMORY=0``), alternating.

The policy is process-wide and cannot be undone, so each side runs in a process of its own:
a private Redis, a mock worker at SmolLM2's vocabulary (49,152, one torch thread), one
``RemoteLM`` sending ``--requests`` sequential ``next_token_logprobs`` calls of distinct prompts
(neither cache can answer). Prints each side's p50 and p90 and, per pair, kept / default.

    python bench/heap_lone.py --pairs 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import benchkit

from localpool.redis_server import RedisServer

VOCAB = 49_152


async def side(url: str, keep: bool, requests: int) -> list[float]:
    worker, lm = await benchkit.mock_pool(
        url, VOCAB, f"mock-{VOCAB}", producer={"keep_freed_memory": keep}
    )
    try:
        async with lm:
            for i in range(300):  # warm-up
                await lm.next_token_logprobs([7, i, 1])
            seconds = []
            for i in range(requests):
                started = time.perf_counter()
                await lm.next_token_logprobs([9, i // 250, i % 250, 3])
                seconds.append(time.perf_counter() - started)
        return seconds
    finally:
        worker.stop()


def one_side(keep: bool, requests: int) -> dict[str, float]:
    with RedisServer(maxmemory_mb=512, maxmemory_policy="volatile-lru") as server:
        seconds = sorted(asyncio.run(side(server.url, keep, requests)))
    return {"p50": 1000 * statistics.median(seconds), "p90": 1000 * seconds[len(seconds) * 9 // 10]}


def run(args: argparse.Namespace, report: benchkit.Report) -> None:
    report.line(
        f"# {args.requests} sequential requests a side, mock worker at vocabulary {VOCAB}, "
        "each side a process of its own, alternating"
    )
    for pair in range(args.pairs):
        got: dict[str, Any] = {}
        for name in ("kept", "default") if pair % 2 == 0 else ("default", "kept"):
            got[name] = benchkit.child_json(
                [sys.executable, __file__, "--side", name, "--requests", str(args.requests)],
                cwd=Path(__file__).resolve().parent.parent,
            )
        kept, default = got["kept"], got["default"]
        report.line(
            f"pair {pair + 1}: kept p50 {kept['p50']:.3f} ms (p90 {kept['p90']:.3f}), "
            f"default p50 {default['p50']:.3f} ms (p90 {default['p90']:.3f}); "
            f"kept / default p50 {kept['p50'] / default['p50']:.3f}x (target: no worse)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--side", choices=("kept", "default"), help=argparse.SUPPRESS)
    benchkit.output_args(parser)
    args = parser.parse_args(argv)
    if args.side:
        print(json.dumps(one_side(args.side == "kept", args.requests)))
        return 0
    return benchkit.run_reported_sync(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
