"""The pool at saturation for a while: does memory stay flat? Redis, workers and producers.

``--workers`` mock worker processes (vocabulary 49,152: 196 KB results) with a short result
TTL (``LMPOOL_RESULT_TTL_S=5``) so the shared cache turns over many times, and ``--producers``
producer processes, each keeping ``--in-flight`` distinct requests in flight (random prompts:
nothing is answered from the cache). Every ``--interval`` seconds: requests/s (the workers'
heartbeat counters), Redis ``used_memory`` (INFO memory), its estimate of expired keys not
yet freed, its RSS, the key count, the result keys, unread replies, the request streams'
length, and the resident memory (VmRSS) of every worker and producer process.

Anchors, same run: the first steady sample (after ``--steady-after`` seconds, several TTLs in)
for every column; for Redis, the live results expected (req/s x TTL) and what they take
(``MEMORY USAGE`` of one result x their count), and ``used_memory`` per live result, which
does not move with the throughput (a shared machine makes req/s, hence the cache, vary).
After the producers stop, the key count is sampled again once the TTL has passed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import benchkit
import poolbench
import redis
import torch
from benchkit import Report

from localpool.redis_server import RedisServer
from shared import protocol
from shared.keys import Keys

MIB = 1 << 20


@dataclass
class Sample:
    t: float
    rate: float
    redis_mib: float
    redis_rss_mib: float
    clients_mib: float
    keys: int
    results: int
    replies: int
    stale_pct: float
    queue: int
    worker_mib: list[float] = field(default_factory=list)
    producer_mib: list[float] = field(default_factory=list)


def slope_per_min(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (seconds), per minute."""
    if len(xs) < 2:
        return float("nan")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def run(args: argparse.Namespace, report: Report) -> None:
    model = f"mock-{args.vocab}"
    keys = Keys()
    result_bytes = len(protocol.encode_result(torch.zeros(args.vocab)))
    settings: dict[str, Any] = {
        "backend": "mock",
        "mock_vocab_size": args.vocab,
        "mock_delay_ms": args.delay_ms,
        "result_ttl_s": args.result_ttl_s,
        "heartbeat_s": 1.0,
        "log_level": "WARNING",
    }
    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    samples: list[Sample] = []
    with RedisServer() as server:
        url = server.url
        workers = [benchkit.Worker(url, extra_env=threads, **settings) for _ in range(args.workers)]
        producers: list[poolbench.Producer] = []
        r: Any = redis.Redis.from_url(url)  # the sync client; its stubs mix in Awaitable
        try:
            for w in workers:
                w.start()
            poolbench.wait_workers(workers, url, timeout_s=120)
            baseline_keys = int(r.dbsize())
            report.line(
                f"# {args.workers} mock workers (vocab {args.vocab}, result {result_bytes:,} B, "
                f"delay {args.delay_ms:g} ms/batch, max_batch default), result TTL "
                f"{args.result_ttl_s} s, heartbeat 1 s; {args.producers} producer processes x "
                f"{args.in_flight} in flight, distinct {args.tokens}-token prompts; redis "
                f"{server.binary}, no maxmemory"
            )
            report.line(
                f"# sample every {args.interval:g} s for {args.seconds:g} s; steady state from "
                f"t >= {args.steady_after:g} s; keys before the producers: {baseline_keys}"
            )
            for i in range(args.producers):
                producers.append(
                    poolbench.Producer(
                        url,
                        model,
                        priority="high",
                        in_flight=args.in_flight,
                        tokens=args.tokens,
                        vocab=args.vocab,
                        seed=args.seed + i,
                        max_s=args.seconds + 60,
                    ).start()
                )
            for p in producers:
                p.wait_ready()
            pids = [w.proc.pid for w in workers if w.proc is not None]
            assert server.proc is not None
            redis_pid = server.proc.pid
            report.line()
            head = (
                f"{'t s':>4} {'req/s':>6} {'redis MiB':>9} {'stale%':>6} {'redis RSS':>9} "
                f"{'keys':>6} {'results':>7} {'replies':>7} {'queue':>6} "
                + " ".join(f"{f'w{i + 1} RSS':>8}" for i in range(len(pids)))
                + " "
                + " ".join(f"{f'p{i + 1} RSS':>8}" for i in range(len(producers)))
            )
            report.line(head + "   (MiB)")
            report.line("-" * len(head))
            last = poolbench.heartbeats(url)
            t0 = time.monotonic()
            next_t = t0
            while True:
                now = time.monotonic()
                if now - t0 > args.seconds + 1e-6:
                    break
                beats = poolbench.heartbeats(url)
                rate = 0.0
                for pid in pids:
                    a, b = last.get(pid, {}), beats.get(pid, {})
                    dt = float(b.get("heartbeat_at", 0)) - float(a.get("heartbeat_at", 0))
                    if dt > 0:
                        rate += (int(b.get("requests", 0)) - int(a.get("requests", 0))) / dt
                last = beats
                for w in workers:
                    if not w.alive():
                        raise RuntimeError(f"a worker died:\n{w.log_tail()}")
                for p in producers:
                    if p.proc is not None and p.proc.poll() is not None:
                        raise RuntimeError(f"a producer died: {p.stderr_tail()}")
                mem = r.info("memory")
                stale = float(r.info("stats").get("expired_stale_perc", float("nan")))
                queue = sum(int(r.xlen(k)) for k in r.scan_iter(f"{keys.prefix}:req:{model}:*"))
                s = Sample(
                    t=now - t0,
                    rate=rate,
                    redis_mib=int(mem["used_memory"]) / MIB,
                    redis_rss_mib=poolbench.rss_mib(redis_pid),
                    clients_mib=int(mem.get("mem_clients_normal", 0)) / MIB,
                    keys=int(r.dbsize()),
                    results=sum(1 for _ in r.scan_iter(keys.results(model), count=1000)),
                    replies=sum(int(r.llen(k)) for k in r.scan_iter(keys.reply("*"))),
                    stale_pct=stale,
                    queue=queue,
                    worker_mib=[poolbench.rss_mib(pid) for pid in pids],
                    producer_mib=[poolbench.rss_mib(p.pid) for p in producers],
                )
                samples.append(s)
                report.line(
                    f"{s.t:>4.0f} {s.rate:>6.0f} {s.redis_mib:>9.1f} {s.stale_pct:>6.1f} "
                    f"{s.redis_rss_mib:>9.1f} "
                    f"{s.keys:>6} {s.results:>7} {s.replies:>7} {s.queue:>6} "
                    + " ".join(f"{m:>8.1f}" for m in s.worker_mib)
                    + " "
                    + " ".join(f"{m:>8.1f}" for m in s.producer_mib)
                )
                next_t += args.interval
                time.sleep(max(0.0, next_t - time.monotonic()))
            report.line(
                "redis MiB: INFO used_memory; stale%: INFO expired_stale_perc (keys past their "
                "TTL not yet freed, estimated); "
                "redis RSS, wN RSS (workers), pN RSS (producers): VmRSS; req/s: workers' "
                "heartbeat counters; results: result keys; replies: entries in reply lists not yet "
                "popped; queue: entries in the request streams"
            )
            one = next(r.scan_iter(keys.results(model), count=1000), None)
            footprint = int(r.memory_usage(one) or 0) if one is not None else 0
            summaries = [p.finish(timeout_s=60) for p in producers]
            stopped_at = time.monotonic()
            time.sleep(args.result_ttl_s + 1.5)
            keys_after = int(r.dbsize())
            new_keys = sorted(k.decode() for k in r.scan_iter(count=1000))[:20]
            mem_after = int(r.info("memory")["used_memory"]) / MIB
            after_s = time.monotonic() - stopped_at
            beats = poolbench.heartbeats(url)
        finally:
            for p in producers:
                p.stop()
            for w in workers:
                w.stop()
            r.close()

    steady = [s for s in samples if s.t >= args.steady_after]
    if len(steady) < 2:
        report.line("too few steady samples for a comparison: raise --seconds")
        return
    first, end = steady[0], steady[-1]
    ts = [s.t for s in steady]
    report.line()
    head = (
        f"{'steady state':<18} {'start':>9} {'end':>9} {'change':>8} {'max':>9} {'slope/min':>10}"
    )
    report.line(head + f"   (start: t = {first.t:.0f} s, end: t = {end.t:.0f} s)")
    report.line("-" * len(head))

    changes: dict[str, float] = {}

    def line(name: str, values: list[float], fmt: str = ".1f") -> None:
        if values[0]:
            changes[name] = 100 * (values[-1] - values[0]) / values[0]
            change = f"{changes[name]:>+7.1f}%"
        else:
            change = f"{'n/a':>8}"
        report.line(
            f"{name:<18} {values[0]:>9{fmt}} {values[-1]:>9{fmt}} {change} "
            f"{max(values):>9{fmt}} {slope_per_min(ts, values):>+10.2f}"
        )

    line("req/s", [s.rate for s in steady], ".0f")
    line("redis used MiB", [s.redis_mib for s in steady])
    line("  client buffers", [s.clients_mib for s in steady])
    line("redis RSS MiB", [s.redis_rss_mib for s in steady])
    line("redis keys", [float(s.keys) for s in steady], ".0f")
    line("  of them results", [float(s.results) for s in steady], ".0f")
    line("used KiB / result", [1024 * s.redis_mib / max(s.results, 1) for s in steady], ".0f")
    line("unread replies", [float(s.replies) for s in steady], ".0f")
    for i in range(len(first.worker_mib)):
        line(f"worker {i + 1} RSS MiB", [s.worker_mib[i] for s in steady])
    for i in range(len(first.producer_mib)):
        line(f"producer {i + 1} RSS MiB", [s.producer_mib[i] for s in steady])

    mean_rate = statistics.fmean(s.rate for s in steady)
    n_results = statistics.median(s.results for s in steady)
    n_replies = statistics.median(s.replies for s in steady)
    report.line()
    report.line(
        f"anchor: results expected live = mean {mean_rate:.0f} req/s x {args.result_ttl_s} s TTL "
        f"= {mean_rate * args.result_ttl_s:.0f}; counted (steady median) {n_results:.0f}"
    )
    report.line(
        f"anchor: one result is {result_bytes:,} B, MEMORY USAGE {footprint:,} B; "
        f"x {n_results:.0f} results = {n_results * footprint / MIB:.0f} MiB, + {n_replies:.0f} "
        f"unread replies of the same size = {(n_results + n_replies) * footprint / MIB:.0f} MiB; "
        f"redis used_memory steady median {statistics.median(s.redis_mib for s in steady):.0f} MiB"
        f" (expired_stale_perc median {statistics.median(s.stale_pct for s in steady):.0f}%)"
    )
    rss = {k: v for k, v in changes.items() if "RSS" in k and not k.startswith("redis")}
    worst = max(rss, key=lambda k: abs(rss[k]))
    report.line(
        f"flat? largest worker/producer RSS change start->end: {worst} {rss[worst]:+.1f}%; "
        f"redis used_memory per live result {changes['used KiB / result']:+.1f}% "
        "(used_memory itself follows req/s x TTL)"
    )
    done = sum(int(s["done"]) for s in summaries)
    errors = [s["errors"] for s in summaries if s["errors"]]
    served = sum(int(b.get("requests", 0)) for b in beats.values())
    hits = sum(int(b.get("cache_hits", 0)) for b in beats.values())
    lat = sorted(x for s in summaries for x in s["latencies"])
    p50, p99 = 1000 * benchkit.percentile(lat, 50), 1000 * benchkit.percentile(lat, 99)
    report.line(
        f"producers: {done} requests answered ({done / args.seconds:.0f} req/s over "
        f"{args.seconds:g} s), errors {errors or 'none'}, latency p50 {p50:.0f} ms p99 "
        f"{p99:.0f} ms (a uniform sample of {len(lat)}); workers: {served} served, {hits} "
        "cache hits"
    )
    report.line(
        f"after the producers stopped: {keys_after} keys ({baseline_keys} before they started), "
        f"redis used {mem_after:.1f} MiB, {after_s:.1f} s later (TTL {args.result_ttl_s} s)"
    )
    report.line(f"  keys left: {', '.join(new_keys)}{' ...' if keys_after > 20 else ''}")
    report.line(f"# load at the end: {benchkit.load_average()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="length of the soak")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument(
        "--steady-after", type=float, default=15.0, help="first sample that counts as steady"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=256, help="per producer")
    parser.add_argument("--vocab", type=int, default=49_152, help="mock backend vocabulary")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="LMPOOL_MOCK_DELAY_MS")
    parser.add_argument("--result-ttl-s", type=int, default=5, help="LMPOOL_RESULT_TTL_S")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--seed", type=int, default=0)
    benchkit.output_args(parser)
    args = parser.parse_args(argv)
    header = (poolbench.SHARED_NOTE, poolbench.code_version())
    return benchkit.run_reported_sync(run, args, header)


if __name__ == "__main__":
    sys.exit(main())
