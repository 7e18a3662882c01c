"""What this machine's floor is for the request path: round trips and 196 KB transfers through
Redis, and how much slower short work runs after a pause.

On one private Redis, one client at a time, sequential, each measured hot (back to back) and
after a 1 ms pause (the situation of every step of a request at one in flight):
- a loopback round trip of a raw socket (``PING``), and through redis-py's asyncio client as
  lmpool configures it;
- ``SET`` and ``GET`` of a 196 KB value (a float32 row of SmolLM2's vocabulary);
- the mock backend's row (one copy of 196 KB) and its encoding, in this process, one torch
  thread.
Used by docs/performance.md ("What is left").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import benchkit
import torch
from benchkit import Report
from reply_paths import VOCAB

from localpool.redis_server import RedisServer
from shared.protocol import encode_result
from shared.redis_conn import connect_redis
from worker.backends.mock import MockBackend

PAUSE_S = 0.001


async def timed(fn: Callable[[], Awaitable[object]], n: int, pause: bool) -> float:
    """Median microseconds of ``fn`` over ``n`` calls (after a pause each, if ``pause``)."""
    laps = []
    for _ in range(n):
        if pause:
            await asyncio.sleep(PAUSE_S)
        started = time.perf_counter()
        await fn()
        laps.append(time.perf_counter() - started)
    return 1e6 * statistics.median(laps)


async def run(args: argparse.Namespace, report: Report) -> None:
    value = os.urandom(VOCAB * 4)
    rows: list[tuple[str, float, float]] = []
    with RedisServer() as server:
        assert server.port is not None
        raw = socket.create_connection(("127.0.0.1", server.port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        async def raw_ping() -> None:
            raw.sendall(b"PING\r\n")
            raw.recv(64)

        redis = connect_redis(server.url)
        await redis.set("row", value)
        probes: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("raw socket PING", raw_ping),
            ("redis-py asyncio PING", redis.ping),
            ("redis-py asyncio SET 196 KB", lambda: redis.set("row", value)),
            ("redis-py asyncio GET 196 KB", lambda: redis.get("row")),
        ]
        for name, fn in probes:
            hot = await timed(fn, args.n, pause=False)
            cold = await timed(fn, args.n // 2, pause=True)
            rows.append((name, hot, cold))
        raw.close()
        await redis.aclose()

    torch.set_num_threads(1)  # as the benchmarks' workers run (LMPOOL_TORCH_THREADS=1)
    mock = MockBackend(VOCAB)
    prompt = [[1, 2, 3, 4]]

    async def mock_row() -> None:
        mock.logprobs(prompt, None)

    async def mock_row_encoded() -> None:
        encode_result(mock.logprobs(prompt, None)[0])

    for name, fn in [("mock row", mock_row), ("mock row + encoding", mock_row_encoded)]:
        hot = await timed(fn, args.n, pause=False)
        cold = await timed(fn, args.n // 2, pause=True)
        rows.append((name, hot, cold))

    report.line(f"# medians of {args.n} calls back to back, {args.n // 2} after a 1 ms pause each")
    report.line()
    head = f"{'operation':<30} {'back to back us':>16} {'after 1 ms pause us':>20}"
    report.line(head)
    report.line("-" * len(head))
    for name, hot, cold in rows:
        report.line(f"{name:<30} {hot:>16.0f} {cold:>20.0f}")
    report.line(f"# load at the end: {benchkit.load_average()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="calls per measurement")
    benchkit.output_args(parser)
    return benchkit.run_reported(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
