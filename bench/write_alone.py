"""A step's rows written alone: 64 SETs of 49,152 float32 log-probs (12.5 MB) in one pipeline,
through the worker's own connection (``shared.resp.RespConnection``, asyncio) and through the
raw blocking socket of ``bench/rowtrip.py`` (its SETs' half), to a private Redis with no other
client. Says whether the worker's write path costs more than the socket itself; in the pool
the write also shares Redis and the cores with the producer's reads (``bench/smc_timeline.py``).

    python bench/write_alone.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import benchkit
import torch
from rowtrip import RowTrip

from localpool.redis_server import RedisServer
from shared.resp import RespConnection

VOCAB = 49_152
ROWS = 64


def commands(values: list[bytes], tag: int) -> list[tuple[object, ...]]:
    return [
        ("SET", f"bench:write:{tag}:{i}", memoryview(v), "PX", "60000")
        for i, v in enumerate(values)
    ]


async def through_resp(url: str, values: list[bytes], n: int) -> list[float]:
    conn = RespConnection(url)
    out = []
    try:
        for t in range(n):
            started = time.perf_counter()
            await conn.execute(commands(values, t), 10)
            out.append((time.perf_counter() - started) * 1e3)
    finally:
        await conn.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--writes", type=int, default=30, help="a round's writes (5 untimed)")
    benchkit.output_args(parser)
    args = parser.parse_args()
    report = benchkit.Report(args.out, args.append)
    rows = torch.randn(ROWS, VOCAB).log_softmax(-1)
    values = [rows[i].numpy().tobytes() for i in range(ROWS)]
    with RedisServer() as server:
        report.line(f"# redis: {benchkit.describe_binary(server.binary)}")
        for _ in range(args.rounds):
            resp = asyncio.run(through_resp(server.url, values, args.writes))[5:]
            trip = RowTrip(server.url, server.port)
            try:
                raw_s, _, _ = trip.measure(rows, len(resp))
            finally:
                trip.close()
            report.line(
                f"{ROWS} SETs of {VOCAB} float32 ({ROWS * VOCAB * 4 / 1e6:.1f} MB), medians of "
                f"{len(resp)}: shared.resp (asyncio) {statistics.median(resp):.2f} ms, raw "
                f"blocking socket (bench/rowtrip.py) {raw_s * 1e3:.2f} ms"
            )
    report.close()


if __name__ == "__main__":
    main()
