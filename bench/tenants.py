"""Tenants of one pool: a lone researcher beside another's flood, weights, and what tenants cost.

One mock worker (``LMPOOL_MOCK_DELAY_MS``: a fixed cost per batch plus 0.1 ms a row, so batches
cost as on a GPU whatever their make-up), max batch 16, on a private Redis. Load comes from
producer processes (``bench/poolbench.py``), each with its own tenant and ``--in-flight``
requests always in flight; B, the lone researcher, is this process, one request at a time.

1. B alone: p50 of ``--samples`` sequential requests (the anchor).
2. B while tenant A keeps ``--flood`` requests in flight, same priority: p50 / alone
   (target <= 1.5x); the same with B pausing a random part of a step before each request (its
   requests then arrive anywhere in A's steps, not just after one began); then the same
   without tenants (A and B both unnamed): what a shared FIFO queue did before.
3. Weights 1 (A) and 3 (B), both saturating (a worker with ``LMPOOL_TENANT_WEIGHTS``): the
   requests each got over a window, from the worker's heartbeats (target: 1:3 within 10%).
4. One producer saturating, as a tenant and as none, alternating ``--rounds`` times: the pool's
   throughput (worker heartbeats) with tenants on / off (target >= 0.95x).
5. Accounting: the workers' per-tenant counters summed against their totals.
6. Quotas: tenant Q with a quota of ``--quota`` requests in flight keeps that many in flight
   (one batch call) while this process times ``--samples`` more calls of Q: each is refused
   (``QuotaExceeded``) in how long (target < 10 ms), and the worker computed only the admitted
   requests, every one answered (target: 0 lost, 0 computed for a refused call).

    python bench/tenants.py --out bench/results/tenants-cpu.txt
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import time
from typing import Any

import benchkit
import poolbench
from benchkit import Report, percentile

from localpool.redis_server import RedisServer
from producer import RemoteLM
from shared.keys import Keys
from shared.settings import Settings

WARM = 10


def served(url: str) -> dict[str, float]:
    """Tenant -> requests answered, summed over the live workers' last heartbeats, plus
    ``"__total__"``: the workers' own request counters."""
    out: dict[str, float] = {"__total__": 0.0}
    for beat in poolbench.heartbeats(url).values():
        out["__total__"] += float(beat.get("requests", 0))
        for tenant, counters in (beat.get("tenants") or {}).items():
            out[tenant] = out.get(tenant, 0.0) + float(counters["requests"])
    return out


class Pool:
    """One mock worker on ``url`` and the load processes of a phase."""

    def __init__(self, url: str, args: argparse.Namespace, **settings: Any) -> None:
        self.url, self.args = url, args
        self.worker = benchkit.Worker(
            url,
            extra_env={"OMP_NUM_THREADS": "1"},
            backend="mock",
            mock_vocab_size=args.vocab,
            mock_delay_ms=args.delay_ms,
            max_batch=args.max_batch,
            heartbeat_s=0.2,
            log_level="WARNING",
            **settings,
        ).start()
        self.model = f"mock-{args.vocab}"
        self.floods: list[poolbench.Producer] = []

    async def lm(self, tenant: str) -> Any:
        await benchkit.connect_remote_lm(self.worker, self.url, self.model, 120, 120)
        return await RemoteLM.connect(
            model=self.model,
            cache_size=0,
            settings=Settings(redis_url=self.url, tenant=tenant, timeout_s=120),
        )

    def flood(self, tenant: str, in_flight: int, seed: int) -> poolbench.Producer:
        p = poolbench.Producer(
            self.url, self.model, priority="high", in_flight=in_flight,
            tokens=self.args.tokens, vocab=self.args.vocab, seed=seed, max_s=600, tenant=tenant,
        ).start()  # fmt: skip
        p.wait_ready()
        self.floods.append(p)
        return p

    async def backlog(self, tenant: str, at_least: int) -> int:
        """Until ``tenant``'s streams hold ``at_least`` entries; returns what they hold."""
        from shared.redis_conn import connect_redis

        keys = Keys()
        shards = Settings().shards
        streams = [keys.stream(self.model, "high", s, tenant) for s in range(shards)]
        raw = connect_redis(self.url)
        try:
            deadline = time.monotonic() + 60
            while True:
                n = sum([int(await raw.xlen(s)) for s in streams])
                if n >= at_least or time.monotonic() > deadline:
                    return n
                await asyncio.sleep(0.02)
        finally:
            await raw.aclose()

    def stop_floods(self) -> list[dict[str, Any]]:
        out = [p.finish(timeout_s=60) for p in self.floods]
        self.floods = []
        return out

    def close(self) -> None:
        for p in self.floods:
            p.stop()
        self.worker.stop()


async def lone_beside_flood(url: str, args: argparse.Namespace, report: Report) -> None:
    rng = random.Random(args.seed)

    def prompts(n: int) -> list[list[int]]:
        return poolbench.random_prompts(rng, n, args.tokens, args.vocab)

    pool = Pool(url, args)
    step_s = float("nan")
    try:
        b = await pool.lm("b")
        none = await pool.lm("")
        await poolbench.sequential(b, prompts(WARM))
        alone = await poolbench.sequential(b, prompts(args.samples))
        rows: list[tuple[str, list[float], int | None]] = [("B alone", alone, None)]
        for tenants, lm in ((True, b), (False, none)):
            pool.flood("a" if tenants else "", args.flood, args.seed + 1)
            queued = await pool.backlog("a" if tenants else "", args.flood // 2)
            n = args.samples if tenants else max(args.samples // 10, 5)
            beat0 = next(iter(poolbench.heartbeats(url).values()))
            lat = await poolbench.sequential(lm, prompts(n))
            beat1 = next(iter(poolbench.heartbeats(url).values()))
            name = "B beside A's flood, tenants" if tenants else "B beside A's flood, no tenants"
            rows.append((name, lat, queued))
            if tenants:
                batches = int(beat1["batches"]) - int(beat0["batches"])
                step_s = (float(beat1["busy_s"]) - float(beat0["busy_s"])) / max(batches, 1)
                # B pausing a random part of a step before each request: its requests land
                # anywhere in A's steps, not just after one began
                paused = await poolbench.sequential(
                    lm, prompts(n), pause=functools.partial(rng.uniform, 0, step_s)
                )
                rows.append(("  the same, B pausing 0-1 step first", paused, None))
            pool.stop_floods()
        await b.close()
        await none.close()
    finally:
        pool.close()
    anchor = percentile(alone, 50)
    head = f"{'phase':<34} {'n':>4} {'p50 ms':>9} {'p99 ms':>9} {'p50 / alone':>12}  A's queue"
    report.line(head)
    report.line("-" * len(head))
    for name, lat, backlog in rows:
        p50, p99 = percentile(lat, 50), percentile(lat, 99)
        q = "" if backlog is None else f"  {backlog} entries when B began"
        report.line(
            f"{name:<34} {len(lat):>4} {1000 * p50:>9.2f} {1000 * p99:>9.2f} "
            f"{p50 / anchor:>11.2f}x{q}"
        )
    ratio = percentile(rows[1][1], 50) / anchor
    report.line(
        f"target: B's p50 beside A's {args.flood} in flight <= 1.5x B alone: {ratio:.2f}x -> "
        f"{'met' if ratio <= 1.5 else 'NOT met'}"
    )
    floor_s = 2 * step_s
    report.line(
        f"   the worker's step during A's flood: {1000 * step_s:.2f} ms (a full batch). B asks "
        f"again as soon as its answer arrives, and the worker began its next step (of A's rows) "
        f"when it handed that answer over: B's request waits all of that step, then runs in the "
        f"next. B's floor beside the flood, for a worker that never idles while A has work: "
        f"about 2 steps = {1000 * floor_s:.1f} ms ({floor_s / anchor:.2f}x B alone); a request "
        f"arriving at a random point of a step waits half of one on the median, then runs in "
        f"the next: 1.5 steps = {1500 * step_s:.1f} ms ({1.5 * step_s / anchor:.2f}x B alone) "
        f"before its own round trip"
    )


async def weighted(url: str, args: argparse.Namespace, report: Report) -> None:
    pool = Pool(url, args, tenant_weights='{"b": 3}')
    try:
        lm = await pool.lm("a")
        await lm.close()
        pool.flood("a", args.flood // 2, args.seed + 2)
        pool.flood("b", args.flood // 2, args.seed + 3)
        await pool.backlog("a", args.flood // 8)
        await pool.backlog("b", args.flood // 8)
        await asyncio.sleep(1.0)
        before = served(url)
        await asyncio.sleep(args.window_s)
        after = served(url)
        pool.stop_floods()
    finally:
        pool.close()
    a = after.get("a", 0) - before.get("a", 0)
    b = after.get("b", 0) - before.get("b", 0)
    ratio = b / a if a else float("inf")
    report.line(
        f"weights a=1, b=3, both saturating ({args.flood // 2} in flight each), {args.window_s:g} s"
        f" window: served a {a:.0f}, b {b:.0f}: b / a = {ratio:.2f} (target 3 within 10%: "
        f"{'met' if abs(ratio / 3 - 1) <= 0.1 else 'NOT met'})"
    )


async def throughput(url: str, args: argparse.Namespace, report: Report) -> None:
    pool = Pool(url, args)
    rates: dict[bool, list[float]] = {True: [], False: []}
    try:
        lm = await pool.lm("")
        await lm.close()
        for i in range(args.rounds):
            for tenants in (True, False) if i % 2 == 0 else (False, True):  # drift cancels
                name = "a" if tenants else ""
                pool.flood(name, args.flood, args.seed + 4)
                await pool.backlog(name, args.flood // 2)
                await asyncio.sleep(0.5)
                t0, before = time.monotonic(), served(url)["__total__"]
                await asyncio.sleep(args.window_s)
                t1, after = time.monotonic(), served(url)["__total__"]
                rates[tenants].append((after - before) / (t1 - t0))
                pool.stop_floods()
        total = served(url)
    finally:
        pool.close()
    on = sum(rates[True]) / len(rates[True])
    off = sum(rates[False]) / len(rates[False])
    report.line(
        f"one producer saturating ({args.flood} in flight), {args.rounds} x {args.window_s:g} s "
        f"each, alternating: tenant {on:.0f} req/s ({', '.join(f'{r:.0f}' for r in rates[True])}"
        f"), no tenant {off:.0f} req/s ({', '.join(f'{r:.0f}' for r in rates[False])}): "
        f"on / off = {on / off:.3f} (target >= 0.95: {'met' if on / off >= 0.95 else 'NOT met'})"
    )
    per_tenant = sum(v for k, v in total.items() if k != "__total__")
    same = "equal" if per_tenant == total["__total__"] else "DIFFERENT"
    report.line(
        f"accounting: the worker's per-tenant request counters sum to {per_tenant:.0f}, its "
        f"total is {total['__total__']:.0f} ({same}; tenants "
        f"{sorted(k for k in total if k != '__total__')})"
    )


async def over_quota(url: str, args: argparse.Namespace, report: Report) -> None:
    from shared.errors import QuotaExceeded
    from shared.redis_conn import connect_redis
    from worker.quota import read_quotas, set_quota

    keys, rng = Keys(), random.Random(args.seed + 6)
    raw = connect_redis(url)
    await set_quota(raw, keys, "q", {"in_flight": args.quota})
    pool = Pool(url, args)
    refusals: list[float] = []
    admitted = answered = 0
    try:
        lm = await pool.lm("q")
        await lm.next_token_logprobs([1])  # its connection made, the quota known
        admitted, answered = 1, 1
        while len(refusals) < args.samples:
            batch = [
                [rng.randrange(1, args.vocab) for _ in range(args.tokens)]
                for _ in range(args.quota)
            ]
            held = asyncio.create_task(lm.batch_next_token_logprobs(batch))
            while int(await raw.zcard(keys.quota_leases("q"))) < args.quota:
                await asyncio.sleep(0.0005)
            admitted += args.quota
            while not held.done() and len(refusals) < args.samples:
                t0 = time.perf_counter()
                try:
                    await lm.next_token_logprobs([rng.randrange(1, args.vocab) for _ in range(4)])
                except QuotaExceeded:
                    refusals.append(time.perf_counter() - t0)
                else:  # the batch's answers came and its leases ended meanwhile
                    admitted, answered = admitted + 1, answered + 1
            answered += len(await held)
        await lm.close()
        await asyncio.sleep(0.6)  # the worker's heartbeats: its counters are final
        computed = served(url).get("q", 0)
        use = (await read_quotas(raw, keys))["q"]
    finally:
        pool.close()
        await raw.aclose()
    refusals.sort()
    ms = [1000 * percentile(refusals, q) for q in (50, 99)] + [1000 * refusals[-1]]
    report.line(
        f"over quota (tenant Q: {args.quota} in flight at its quota of {args.quota}): "
        f"{len(refusals)} calls refused with QuotaExceeded in p50 {ms[0]:.2f} ms, p99 "
        f"{ms[1]:.2f} ms, max {ms[2]:.2f} ms (target < 10 ms: "
        f"{'met' if ms[2] < 10 else 'NOT met'})"
    )
    lost = admitted - answered
    report.line(
        f"   admitted {admitted} requests, answered {answered} (lost {lost}); the worker "
        f"computed {computed:.0f} of Q's; QUOTA counted {use['admitted']} admitted, "
        f"{use['refused']} refused (target: 0 lost, 0 computed for a refused call: "
        f"{'met' if lost == 0 and computed == admitted else 'NOT met'})"
    )


async def run(args: argparse.Namespace, report: Report) -> None:
    report.line(
        f"# 1 mock worker (vocabulary {args.vocab}, {args.delay_ms:g} ms a batch + 0.1 ms a row, "
        f"max batch {args.max_batch}); B: this process, one {args.tokens}-token request at a "
        f"time; floods: producer processes; all prompts distinct"
    )
    phases = {
        "lone": lone_beside_flood,
        "weights": weighted,
        "throughput": throughput,
        "quota": over_quota,
    }
    with RedisServer() as server:
        for name in args.phases.split(","):
            await phases[name](server.url, args, report)
            report.line()
    report.line(f"# load at the end: {benchkit.load_average()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=2000, help="A's requests in flight")
    parser.add_argument("--samples", type=int, default=100, help="B's requests per phase")
    parser.add_argument("--delay-ms", type=float, default=5.0, help="LMPOOL_MOCK_DELAY_MS")
    parser.add_argument("--vocab", type=int, default=1024, help="mock backend vocabulary")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--max-batch", type=int, default=16, help="LMPOOL_MAX_BATCH")
    parser.add_argument("--window-s", type=float, default=4.0, help="measured seconds")
    parser.add_argument("--rounds", type=int, default=4, help="tenant on/off alternations")
    parser.add_argument(
        "--phases", default="lone,weights,throughput,quota", help="which, comma-separated"
    )
    parser.add_argument("--quota", type=int, default=64, help="Q's quota of requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    benchkit.output_args(parser)
    args = parser.parse_args(argv)
    return benchkit.run_reported(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
