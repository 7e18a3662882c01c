"""lmpool's own cost per request against a bare Redis round trip, with CPU per request.

Bare round trips (the anchor, measured in the same run), two of them: the hand-written
producer and worker of ``bench/reply_paths.py`` path (a) (``bare redis-py``): the producer XADDs
every request of an event-loop tick in one pipeline and one listener pops replies with
``BLMPOP COUNT 512``; the worker (sync redis-py) reads 16 entries with XREADGROUP and answers each
with one RPUSH of a precomputed 196 KB row (float32, 49,152 entries), then XACK + XDEL, in one
pipeline. And the same on raw RESP (``bare resp``, ``bench/bare_path.py``): the producer's
submissions and pops on ``shared.resp`` connections, each row handed over uncopied. Nothing is
validated, deduplicated, cached or computed. Each pass measures both, and the pools' ratio
(``x bare``) is to the faster of the two in that pass.

Pool: a real worker process (``arq worker.WorkerSettings``, mock backend at vocabulary 49,152,
one torch thread) and ``producer.RemoteLM`` with N concurrent distinct requests (neither cache can
answer), for each ``--wire-dtype``.

The shared cache as deployed, at its steady state (the default): Redis capped at
``--maxmemory-mb`` with ``volatile-lru`` (``docker-compose.yml`` caps it at 4 GB) and filled
before the first cell with expiring filler values of a row's size, results kept for the default
``LMPOOL_RESULT_TTL_S``: each new result takes the memory of an evicted one. With
``--maxmemory-mb 0`` the cache grows instead (results kept ``--result-ttl-s``, 2 s by default
there): every result then lands on pages Redis has not touched yet, and the page faults cost
Redis about twice the CPU of the rest of the request (``docs/performance.md``).

CPU per request: user + system time from ``/proc/PID/stat`` of the producer (this process), the
worker process and the Redis server over the measured window, divided by the requests completed
in it. The machine's cores are shared by all three, so on a small machine CPU, not latency,
bounds the rate at 16 and 128 in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import benchkit
from bare_path import RespPathClient
from benchkit import Cell, Report, closed_loop
from reply_paths import VOCAB, PathClient, lmpool_call, wait_flag

BARE = ("bare redis-py", "bare resp")


@dataclass
class Measured:
    cell: Cell
    cpu_ms: dict[str, float]
    """CPU milliseconds per completed request, by process."""


async def measure(
    call: Callable[[], Awaitable[object]],
    in_flight: int,
    pids: dict[str, int],
    warm_s: float,
    run_s: float,
) -> Measured:
    """A closed loop of ``call`` with the CPU of ``pids`` read at the window's edges."""
    marks: list[dict[str, float]] = []

    async def sample_cpu() -> None:
        await asyncio.sleep(warm_s)
        marks.append({k: benchkit.process_cpu_s(p) for k, p in pids.items()})
        await asyncio.sleep(run_s)
        marks.append({k: benchkit.process_cpu_s(p) for k, p in pids.items()})

    sampler = asyncio.create_task(sample_cpu())
    cell = await closed_loop(call, in_flight, warm_s, run_s)
    await sampler
    done = max(cell.done, 1)
    cpu = {k: 1000 * (marks[1][k] - marks[0][k]) / done for k in pids}
    return Measured(cell, cpu)


async def run(args: argparse.Namespace, report: Report) -> None:
    levels = [int(x) for x in args.in_flight.split(",")]
    dtypes = [d for d in args.wire_dtypes.split(",") if d]
    with benchkit.cache_redis(args, report, 4 * VOCAB) as (server, cache_settings):
        url = server.url
        assert server.proc is not None
        redis_pid = server.proc.pid
        report.line(f"# redis: {server.binary}, loopback; mock vocabulary {VOCAB:,}")
        report.line(
            f"# {args.warm:g} s warm-up + {args.seconds:g} s measured per cell, {args.repeat} "
            "pass(es) in alternating order; worker: 1 torch thread"
        )
        bare = subprocess.Popen(
            [sys.executable, str(benchkit.REPO / "bench" / "reply_paths.py"), "--worker-url", url],
            cwd=benchkit.REPO,
        )
        pools: dict[str, tuple[benchkit.Worker, object]] = {}
        results: dict[tuple[str, int], list[Measured]] = {}
        try:
            wait_flag(url, "bench:worker-ready", bare, 60)
            for dtype in dtypes:
                pools[dtype] = await benchkit.mock_pool(
                    url,
                    VOCAB,
                    f"mock-{VOCAB}-{dtype}",
                    extra_env={"MKL_NUM_THREADS": "1"},
                    # float32 is the default: not naming it lets this script measure older code
                    **({} if dtype == "float32" else {"wire_dtype": dtype}),
                    **cache_settings,
                )
            labels = [*BARE, *(f"pool {d}" for d in dtypes)]
            for n in levels:
                for rep in range(args.repeat):
                    for label in labels if rep % 2 == 0 else labels[::-1]:
                        if label in BARE:
                            client = (
                                PathClient(url, "blmpop")
                                if label == "bare redis-py"
                                else RespPathClient(url)
                            )
                            await client.start()
                            pids = {"producer": os.getpid(), "worker": bare.pid}
                            try:
                                m = await measure(
                                    client.request,
                                    n,
                                    {**pids, "redis": redis_pid},
                                    args.warm,
                                    args.seconds,
                                )
                            finally:
                                await client.close()
                        else:
                            worker, lm = pools[label.split()[1]]
                            assert worker.proc is not None
                            pids = {"producer": os.getpid(), "worker": worker.proc.pid}
                            m = await measure(
                                lmpool_call(lm),
                                n,
                                {**pids, "redis": redis_pid},
                                args.warm,
                                args.seconds,
                            )
                        results.setdefault((label, n), []).append(m)
        finally:
            for worker, lm in pools.values():
                await lm.close()  # type: ignore[attr-defined]
                worker.stop()
            benchkit.stop_process(bare)
    report.line()
    head = (
        f"{'path':<16} {'in flight':>9} {'req/s':>7} {'(min-max)':>11} {'x bare':>6} "
        f"{'per pass':>15} {'p50 ms':>7} {'p99 ms':>7} {'CPU ms/req: producer':>21} "
        f"{'worker':>7} {'redis':>6} {'total':>6}"
    )
    report.line(head)
    report.line("-" * len(head))
    for n in levels:
        # the anchor of each pass: the faster bare path in it
        fastest = [
            max(runs, key=lambda m: m.cell.rate)
            for runs in zip(*(results[(b, n)] for b in BARE), strict=True)
        ]
        bare_rate = statistics.mean(m.cell.rate for m in fastest)
        for (label, level), runs in results.items():
            if level != n:
                continue
            rates = [m.cell.rate for m in runs]
            rate = statistics.mean(rates)
            merged = Cell(sum(m.cell.done for m in runs), sum(m.cell.seconds for m in runs))
            for m in runs:
                merged.latencies.extend(m.cell.latencies)
            cpu = {k: statistics.mean(m.cpu_ms[k] for m in runs) for k in runs[0].cpu_ms}
            # each pass measures the bare path and the pools back to back: the ratio within a
            # pass is spared the machine's drift between passes
            passes = [m.cell.rate / b.cell.rate for m, b in zip(runs, fastest, strict=True)]
            spread = f"{statistics.median(passes):.2f} ({min(passes):.2f}-{max(passes):.2f})"
            report.line(
                f"{label:<16} {n:>9} {rate:>7.0f} {f'{min(rates):.0f}-{max(rates):.0f}':>11} "
                f"{rate / bare_rate:>6.2f} {spread:>15} {merged.p(50):>7.2f} {merged.p(99):>7.2f} "
                f"{cpu['producer']:>21.3f} {cpu['worker']:>7.3f} {cpu['redis']:>6.3f} "
                f"{sum(cpu.values()):>6.3f}"
            )
        report.line()
    report.line(
        "req/s: mean over passes; p50/p99 over all passes' requests; x bare: ratio of the mean "
        "req/s to the mean of each pass's faster bare path; per pass: median (range) of the "
        "ratio to the faster bare path within each pass"
    )
    report.line(f"# load at the end: {benchkit.load_average()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", default="1,16,128,512", help="concurrency levels")
    parser.add_argument(
        "--wire-dtypes", default="float32,float16", help="pools to run, by LMPOOL_WIRE_DTYPE"
    )
    benchkit.cache_args(parser)
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per cell")
    parser.add_argument("--warm", type=float, default=0.5, help="warm-up seconds per cell")
    parser.add_argument("--repeat", type=int, default=2, help="passes over every cell")
    benchkit.output_args(parser)
    return benchkit.run_reported(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
