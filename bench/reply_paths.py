"""How should a waiting producer be woken? Four reply paths for ~196 KB results, and lmpool's own.

One producer (this process, asyncio, redis-py with hiredis) keeps N requests in flight against
one worker process. The worker is a minimal loop (sync client): XREADGROUP COUNT 16 BLOCK, then
one pipeline per batch that replies to each request by the path under test and does XACK +
XDEL. Every reply carries the same precomputed encoded row (``encode_result`` of a float32
vector of 49,152 entries) in a msgpack ``[request id, row]`` envelope, so the transport is
measured, not compute. Requests are submitted like lmpool's producer does: all requests of one
event-loop tick go in one pipeline (plain XADD here, not the SUBMIT script).

Paths:
  (a) list + BLMPOP COUNT 512: the producer's reply list, many replies per round trip (lmpool)
  (b) list + BLPOP: the same list, one reply per round trip
  (c) pub/sub: one channel per producer, the worker PUBLISHes (nothing stored)
  (d) stream + XREAD BLOCK COUNT 512: a reply stream per producer; the worker's XADD trims it
      with MAXLEN ~ 1024 (the producer holds at most 128 unread entries here)

Anchor, same run, same client library: SET + GET of the same payload from one client,
sequential and pipelined (64 pairs per pipeline); a path's "requests" are compared with anchor
"pairs" (each moves the payload into and out of Redis once). The anchor is measured before and
after the paths and the mean is used.

Also lmpool end to end: a real worker process (``arq worker.WorkerSettings``, mock backend,
vocabulary 49,152) and ``producer.RemoteLM`` with N concurrent distinct requests. That path
does more than transport: the mock row is computed (a seeded randn + log_softmax per request),
the result is also SET in the shared cache, and the producer decodes it to a tensor.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import benchkit
import msgpack
import redis
from benchkit import Cell, Report, closed_loop
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from localpool.redis_server import RedisServer
from shared import protocol

VOCAB = 49_152
WORKER_BATCH = 16
POP_COUNT = 512
REPLY_STREAM_MAXLEN = 1024
REQ_STREAM = "bench:req"
GROUP = "bench"
PATHS = {
    "blmpop": "(a) list BLMPOP COUNT 512",
    "blpop": "(b) list BLPOP",
    "pubsub": "(c) pub/sub channel",
    "xread": "(d) stream XREAD COUNT 512",
}
LMPOOL = "lmpool RemoteLM (mock worker)"
HOW = {"blmpop": b"list", "blpop": b"list", "pubsub": b"pub", "xread": b"stream"}


def payload() -> bytes:
    """The encoded mock row every reply carries: float32 log-probs over 49,152 tokens."""
    import torch

    g = torch.Generator().manual_seed(0)
    return protocol.encode_result(torch.log_softmax(torch.randn(VOCAB, generator=g) * 3, dim=-1))


def envelope(request_id: str, row: bytes) -> bytes:
    """A bare reply: the request's id and the row, in one msgpack array."""
    return msgpack.packb([request_id, row], use_bin_type=True)


# -- the minimal worker (subprocess) ------------------------------------------------------
def worker_main(url: str) -> None:
    """XREADGROUP a batch, reply by each request's path, XACK + XDEL, in one pipeline."""
    row = payload()
    r = redis.Redis.from_url(url)
    with_group(r)
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    r.set("bench:worker-ready", b"1")
    while not stop:
        got: Any = r.xreadgroup(GROUP, "w", {REQ_STREAM: ">"}, count=WORKER_BATCH, block=200)
        if not got:
            continue
        entries = got[0][1]
        pipe = r.pipeline(transaction=False)
        ids = []
        for entry_id, fields in entries:
            ids.append(entry_id)
            reply = envelope(fields[b"id"].decode(), row)
            to, how = fields[b"to"], fields[b"how"]
            if how == b"list":
                pipe.rpush(to, reply)
            elif how == b"pub":
                pipe.publish(to, reply)
            else:
                pipe.xadd(to, {b"r": reply}, maxlen=REPLY_STREAM_MAXLEN, approximate=True)
        pipe.xack(REQ_STREAM, GROUP, *ids)
        pipe.xdel(REQ_STREAM, *ids)
        pipe.execute()
    r.close()


def with_group(r: redis.Redis) -> None:
    try:
        r.xgroup_create(REQ_STREAM, GROUP, id="0", mkstream=True)
    except ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


# -- the producer side of the minimal paths -----------------------------------------------
class PathClient:
    """Submits requests (one pipeline per event-loop tick) and routes replies by request id."""

    def __init__(self, url: str, path: str) -> None:
        self.path = path
        self.how = HOW[path]
        self.reply_key = f"bench:reply:{path}:{uuid.uuid4().hex}"
        self.redis = Redis.from_url(url)
        self.listen_redis = Redis.from_url(url, socket_timeout=15)
        self.pending: dict[str, asyncio.Future[bytes]] = {}
        self.queue: list[str] = []
        self.flushing = False
        self.ids = itertools.count()
        self.listener: asyncio.Task[None] | None = None
        self.pubsub: Any = None
        self.closing = False

    async def start(self) -> None:
        if self.path == "pubsub":
            self.pubsub = self.listen_redis.pubsub()
            await self.pubsub.subscribe(self.reply_key)
            # The subscribe confirmation, so replies published from now on reach us.
            while await self.pubsub.get_message(timeout=1.0) is None:
                pass
        self.listener = asyncio.create_task(self.listen())

    async def request(self) -> bytes:
        rid = str(next(self.ids))
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        self.queue.append(rid)
        if not self.flushing:
            self.flushing = True
            asyncio.get_running_loop().create_task(self.flush())
        return await asyncio.wait_for(fut, 30)

    async def flush(self) -> None:
        await asyncio.sleep(0)  # every request of this tick joins the pipeline
        batch, self.queue = self.queue, []
        self.flushing = False
        pipe = self.redis.pipeline(transaction=False)
        for rid in batch:
            pipe.xadd(REQ_STREAM, {b"id": rid, b"to": self.reply_key, b"how": self.how})
        await pipe.execute()

    def deliver(self, raw: bytes) -> None:
        digest, result = msgpack.unpackb(raw)
        fut = self.pending.pop(digest, None)
        if fut is not None and not fut.done():
            assert isinstance(result, bytes)
            fut.set_result(result)

    async def listen(self) -> None:
        r, key = self.listen_redis, self.reply_key
        last = b"0-0"
        while not self.closing:
            if self.path == "blmpop":
                popped = await r.blmpop(1, 1, key, direction="LEFT", count=POP_COUNT)
                for raw in popped[1] if popped else []:
                    self.deliver(raw)
            elif self.path == "blpop":
                one = await r.blpop([key], timeout=1)
                if one:
                    self.deliver(one[1])
            elif self.path == "pubsub":
                msg = await self.pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if msg is not None and msg["type"] == "message":
                    self.deliver(msg["data"])
            else:
                got = await r.xread({key: last}, count=POP_COUNT, block=1000)
                for _, entries in got or []:
                    for entry_id, fields in entries:
                        last = entry_id
                        self.deliver(fields[b"r"])

    async def close(self) -> None:
        # On Python 3.11 redis-py can swallow a cancel (asyncio.timeout(0) in its connection
        # check), so the loop also checks a flag; every blocking read returns within 1 s.
        self.closing = True
        if self.listener is not None:
            self.listener.cancel()
            await asyncio.wait_for(asyncio.gather(self.listener, return_exceptions=True), 10)
        if self.pubsub is not None:
            await self.pubsub.aclose()
        await self.redis.delete(self.reply_key)
        await self.redis.aclose()
        await self.listen_redis.aclose()


# -- anchor -------------------------------------------------------------------------------
async def anchor(url: str, row: bytes, seconds: float, depth: int = 64) -> tuple[float, float]:
    """SET + GET pairs per second from one client: sequential, and pipelined ``depth`` pairs."""
    r = Redis.from_url(url)
    try:
        key = "bench:anchor"
        for _ in range(20):  # warm the connection and the allocator
            await r.set(key, row)
            await r.get(key)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            await r.set(key, row)
            got = await r.get(key)
            assert got is not None and len(got) == len(row)
            n += 1
        seq = n / (time.perf_counter() - t0)
        keys = [f"bench:anchor:{i}" for i in range(depth)]
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            pipe = r.pipeline(transaction=False)
            for k in keys:
                pipe.set(k, row)
                pipe.get(k)
            out = await pipe.execute()
            assert len(out[1]) == len(row)
            n += depth
        piped = n / (time.perf_counter() - t0)
        await r.delete(key, *keys)
        return seq, piped
    finally:
        await r.aclose()


# -- one measurement ----------------------------------------------------------------------
async def measure_path(url: str, path: str, in_flight: int, warm_s: float, run_s: float) -> Cell:
    client = PathClient(url, path)
    await client.start()
    try:
        return await closed_loop(client.request, in_flight, warm_s, run_s)
    finally:
        await client.close()


def lmpool_call(lm: Any, vocab: int = VOCAB) -> Callable[[], Awaitable[object]]:
    """Distinct prompts every call, so neither cache (local or shared) can answer (ids below
    ``vocab`` and below 40,000)."""
    nonce = random.randrange(vocab)
    counter = itertools.count()

    async def call() -> object:
        i = next(counter)
        return await lm.next_token_logprobs([nonce, 1 + i // 40_000, i % 40_000])

    return call


def wait_flag(url: str, key: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    r = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + timeout_s
        while not r.exists(key):
            if proc.poll() is not None:
                raise RuntimeError("the minimal worker exited at start")
            if time.monotonic() > deadline:
                raise RuntimeError("the minimal worker did not start")
            time.sleep(0.05)
    finally:
        r.close()


async def run(args: argparse.Namespace, report: Report) -> None:
    levels = [int(x) for x in args.in_flight.split(",")]
    paths = [p for p in args.paths.split(",") if p]
    row = payload()
    reply_size = len(envelope("0" * 40, row))
    threads = f"{args.lmpool_threads} torch thread(s)" if args.lmpool_threads else "torch default"
    with RedisServer() as server:
        url = server.url
        probe = redis.Redis.from_url(url)
        info: Any = probe.info("server")
        probe.close()
        report.line(
            f"# redis {info.get('redis_version')} ({server.binary}), loopback; "
            f"result {len(row):,} B, reply envelope {reply_size:,} B"
        )
        report.line(
            f"# {args.warm:g} s warm-up + {args.seconds:g} s measured per cell, {args.repeat} "
            f"pass(es) in alternating order; minimal worker batch {WORKER_BATCH}"
        )
        if args.lmpool:
            report.line(
                f"# lmpool worker: mock backend, vocab {VOCAB}, default settings "
                f"(max_batch 16, max_wait_ms 2), result TTL 2 s, {threads}"
            )
        minimal = subprocess.Popen(
            [sys.executable, __file__, "--worker-url", url], cwd=benchkit.REPO
        )
        real: benchkit.Worker | None = None
        lm: Any = None
        anchors: list[tuple[float, float]] = []
        cells: dict[tuple[str, int], list[Cell]] = {}
        try:
            if args.lmpool:
                extra = {}
                if args.lmpool_threads:
                    extra = {
                        "OMP_NUM_THREADS": str(args.lmpool_threads),
                        "MKL_NUM_THREADS": str(args.lmpool_threads),
                    }
                real = benchkit.Worker(
                    url,
                    extra_env=extra,
                    backend="mock",
                    mock_vocab_size=VOCAB,
                    result_ttl_s=2,  # results of distinct prompts pile up at ~200 KB each
                    log_level="WARNING",
                )
                real.start()
            wait_flag(url, "bench:worker-ready", minimal, 60)
            if real is not None:
                lm = await benchkit.connect_remote_lm(real, url, f"mock-{VOCAB}", 120, 60)
            anchors.append(await anchor(url, row, args.anchor_seconds))
            for n in levels:
                for rep in range(args.repeat):
                    order: list[str] = [*paths, "lmpool"] if lm is not None else list(paths)
                    for path in order if rep % 2 == 0 else order[::-1]:
                        if path == "lmpool":
                            cell = await closed_loop(lmpool_call(lm), n, args.warm, args.seconds)
                            cells.setdefault((LMPOOL, n), []).append(cell)
                        else:
                            cell = await measure_path(url, path, n, args.warm, args.seconds)
                            cells.setdefault((PATHS[path], n), []).append(cell)
                anchors.append(await anchor(url, row, args.anchor_seconds))
        finally:
            if lm is not None:
                await lm.close()
            if real is not None:
                real.stop()
            benchkit.stop_process(minimal)
    seq = statistics.median(a[0] for a in anchors)
    piped = statistics.median(a[1] for a in anchors)
    report.line()
    report.line(
        "anchor: one client (redis-py asyncio + hiredis), SET + GET of the same payload, pairs/s"
    )
    report.line(f"  measured {len(anchors)} times: before the first level and after each one")
    report.line(
        f"  sequential          median {seq:6.0f}   ("
        + " ".join(f"{a[0]:.0f}" for a in anchors)
        + ")"
    )
    report.line(
        f"  pipelined, 64 deep  median {piped:6.0f}   ("
        + " ".join(f"{a[1]:.0f}" for a in anchors)
        + ")"
    )
    report.line()
    head = (
        f"{'reply path':<32} {'in flight':>9} {'req/s':>7} {'(min-max)':>11} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'/seq':>5} {'/pipe':>5}"
    )
    report.line(head)
    report.line("-" * len(head))
    last_n = None
    for (label, n), runs in cells.items():
        if last_n is not None and n != last_n:
            report.line()
        last_n = n
        rates = [c.rate for c in runs]
        rate = statistics.mean(rates)
        merged = Cell(sum(c.done for c in runs), sum(c.seconds for c in runs))
        for c in runs:
            merged.latencies.extend(c.latencies)
        spread = f"{min(rates):.0f}-{max(rates):.0f}"
        report.line(
            f"{label:<32} {n:>9} {rate:>7.0f} {spread:>11} {merged.p(50):>8.2f} "
            f"{merged.p(99):>8.2f} {rate / seq:>5.2f} {rate / piped:>5.2f}"
        )
    report.line()
    report.line(
        "req/s: mean over passes (min-max: the passes); p50/p99: all passes' requests pooled;"
    )
    report.line(
        "/seq, /pipe: mean req/s divided by the anchor's median sequential, pipelined pairs/s"
    )
    report.line(f"# load at the end: {benchkit.load_average()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", default="1,16,128", help="concurrency levels")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"subset of {list(PATHS)}")
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per cell")
    parser.add_argument("--warm", type=float, default=0.5, help="warm-up seconds per cell")
    parser.add_argument("--anchor-seconds", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=2, help="passes over every cell")
    parser.add_argument(
        "--lmpool-threads",
        type=int,
        default=1,
        help="torch threads of lmpool's mock worker (OMP_NUM_THREADS); 0: torch's default",
    )
    parser.add_argument(
        "--no-lmpool", dest="lmpool", action="store_false", help="skip lmpool's real path"
    )
    benchkit.output_args(parser)
    parser.add_argument("--worker-url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_url:
        worker_main(args.worker_url)
        return 0
    unknown = set(args.paths.split(",")) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}; choose from {list(PATHS)}")
    return benchkit.run_reported(run, args)


if __name__ == "__main__":
    sys.exit(main())
