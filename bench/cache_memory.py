"""What the shared cache's memory costs Redis: CPU and page faults per request, while the cache
grows and once it is full.

One private Redis per case, one synchronous client, batches of 16 requests of a 196 KB row
(float32, SmolLM2's vocabulary). The pool's whole Redis side of a request: SUBMIT (queues it),
SET of the result, FINISH (takes the waiter set, pushes a small reply), a pop of the replies,
GET of the result; the stream entries are left unread (XREADGROUP, XACK and XDEL cost Redis a
few microseconds per request either way). Against the bare path's Redis side: RPUSH of the row
and a pop of it.

Cases: ``growing`` (no memory cap, results kept ``--result-ttl-s``: every result lands on pages
Redis has not touched yet) and ``full`` (``maxmemory`` with ``volatile-lru``, filled first: each
new result takes an evicted one's memory). Redis' CPU and minor faults come from ``/proc``.
Used by docs/performance.md ("The cache's memory").
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

import benchkit
import redis
from benchkit import Report
from benchkit import process_cpu_s as cpu_seconds
from reply_paths import VOCAB

from localpool.redis_server import RedisServer
from shared.keys import Keys
from shared.scripts import FINISH_SCRIPT, SUBMIT_SCRIPT, finish_call, submit_call

BATCH = 16
MODEL = "bench"


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


class Paths:
    """The two Redis sides, one batch per call."""

    def __init__(self, r: redis.Redis, ttl_ms: int) -> None:
        self.r = r
        self.ttl_ms = ttl_ms
        self.keys = Keys("bench")
        self.row = os.urandom(4 * VOCAB)
        self.message = os.urandom(120)
        self.res, _ = self.keys.digest_prefixes(MODEL, 0)
        self.stream = self.keys.stream(MODEL, "high", 0)
        self.due = self.keys.due(MODEL, 0)
        self.reply = self.keys.reply("bench-producer")
        r.script_load(SUBMIT_SCRIPT.source)
        r.script_load(FINISH_SCRIPT.source)

    def pool(self) -> None:
        digests = [uuid.uuid4().hex for _ in range(BATCH)]
        keys, args = submit_call(
            self.keys,
            MODEL,
            0,
            self.stream,
            [(d, "0", self.message) for d in digests],
            reply=self.reply,
            wait_ms=self.ttl_ms,
            max_queue=10**9,
            stale_ms=15_000,
        )
        self.r.evalsha(SUBMIT_SCRIPT.sha, len(keys), *keys, *args)
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(self.due, {f"r:{d}": 0 for d in digests})
        for d in digests:
            pipe.set(self.res + d, self.row)  # no TTL until read (shared.scripts)
        keys, finish = finish_call(
            self.keys, MODEL, 0, True, self.ttl_ms, [(d, b"r" * 60) for d in digests]
        )
        FINISH_SCRIPT.queue(pipe, keys, finish)
        pipe.execute()
        self.r.lpop(self.reply, 512)
        pipe = self.r.pipeline(transaction=False)
        for d in digests:
            pipe.getex(self.res + d, px=self.ttl_ms)
        pipe.execute()
        self.r.delete(self.stream, self.due)  # not read or swept here: keep them small

    def bare(self) -> None:
        pipe = self.r.pipeline(transaction=False)
        for _ in range(BATCH):
            pipe.rpush(self.reply, self.row)
        pipe.execute()
        self.r.lpop(self.reply, BATCH)


def measure(pid: int, fn: Callable[[], None], batches: int) -> tuple[float, float]:
    """Redis CPU (us) and minor faults per request over ``batches`` calls of ``fn``."""
    for _ in range(20):
        fn()
    cpu, faults = cpu_seconds(pid), minor_faults(pid)
    for _ in range(batches):
        fn()
    n = batches * BATCH
    return 1e6 * (cpu_seconds(pid) - cpu) / n, (minor_faults(pid) - faults) / n


async def run(args: argparse.Namespace, report: Report) -> None:
    report.line(
        f"# batches of {BATCH}, {args.batches} per case; row {4 * VOCAB:,} bytes; "
        f"growing: results kept {args.result_ttl_s} s; full: maxmemory {args.maxmemory_mb} MB, "
        "volatile-lru, filled first"
    )
    head = f"{'case':<26} {'Redis CPU us/req':>16} {'minor faults/req':>16} {'used memory':>12}"
    report.line(head)
    report.line("-" * len(head))
    for case in ("growing", "full"):
        cap = args.maxmemory_mb if case == "full" else 0
        if case == "full" and not cap:
            continue
        with RedisServer(maxmemory_mb=cap, maxmemory_policy="volatile-lru") as server:
            assert server.proc is not None
            if cap:
                benchkit.fill_cache(server.url, 4 * VOCAB)
            r = redis.Redis.from_url(server.url)
            paths = Paths(r, args.result_ttl_s * 1000 if case == "growing" else 600_000)
            for name, fn in (("pool", paths.pool), ("bare", paths.bare)):
                cpu, faults = measure(server.proc.pid, fn, args.batches)
                info: Any = r.info("memory")
                report.line(
                    f"{f'{name}, cache {case}':<26} {cpu:>16.1f} {faults:>16.1f} "
                    f"{info['used_memory_human']:>12}"
                )
            r.close()
    report.line(f"# load at the end: {benchkit.load_average()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=400, help="batches of 16 per case")
    benchkit.cache_args(parser)
    benchkit.output_args(parser)
    return benchkit.run_reported(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
