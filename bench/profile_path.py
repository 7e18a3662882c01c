"""Where each request's time goes: the producer, the worker and Redis profiled under one load.

Starts a private Redis and a mock worker (vocabulary 49,152, one torch thread), then keeps N
distinct ``next_token_logprobs`` requests in flight from this process for ``--seconds``:
- producer: cProfile of this process (top functions by own time, per request);
- worker: ``py-spy record`` of the worker process (``--format raw`` folded stacks; the top
  frames by own samples are printed, with ``--idle`` off so blocking waits do not count);
- Redis: ``INFO commandstats`` over the window (calls and microseconds per request).

Writes the raw py-spy output next to ``--out`` when given. Used for docs/performance.md.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import benchkit
import redis
from benchkit import Report, closed_loop
from reply_paths import VOCAB, lmpool_call


async def run(args: argparse.Namespace, report: Report) -> None:
    with benchkit.cache_redis(args, report, 4 * VOCAB) as (server, cache_settings):
        url = server.url
        worker, lm = await benchkit.mock_pool(
            url,
            VOCAB,
            f"mock-{VOCAB}",
            **cache_settings,
            **dict(s.split("=", 1) for s in args.setting),
        )
        raw = Path(args.out).with_suffix(".pyspy.txt") if args.out else None
        spy_out = raw or Path(tempfile.mkdtemp()) / "pyspy.txt"
        try:
            call = lmpool_call(lm)
            await closed_loop(call, args.in_flight, 0.5, 1.0)  # warm up
            r = redis.Redis.from_url(url)
            r.config_resetstat()
            assert worker.proc is not None
            profiler = cProfile.Profile(time.process_time)  # CPU, not wall-clock, time
            with benchkit.py_spy(worker.proc.pid, spy_out, rate=500):
                profiler.enable()
                cell = await closed_loop(call, args.in_flight, 0.0, args.seconds)
                profiler.disable()
            stats = benchkit.commandstats(r)
            r.close()
        finally:
            await lm.close()
            worker.stop()
    n = max(cell.done, 1)
    report.line(
        f"# {args.in_flight} in flight, {args.seconds:g} s: {cell.done} requests, "
        f"{cell.rate:.0f} req/s, p50 {cell.p(50):.2f} ms; pid {os.getpid()}"
    )
    report.line("\n## Redis: INFO commandstats over the window (per request)")
    report.line(f"{'command':<14} {'calls/req':>9} {'us/req':>8} {'us/call':>8}")
    for name, (calls, usec) in sorted(stats.items(), key=lambda kv: -kv[1][1]):
        report.line(f"{name:<14} {calls / n:>9.2f} {usec / n:>8.1f} {usec / max(calls, 1):>8.1f}")
    report.line(f"{'total':<14} {'':>9} {sum(u for _, u in stats.values()) / n:>8.1f}")
    report.line("\n## producer: cProfile, own time per request (top functions)")
    buf = io.StringIO()
    ps = pstats.Stats(profiler, stream=buf)
    rows = sorted(ps.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
    total = sum(v[2] for _, v in rows)
    report.line(f"total own time {1e6 * total / n:.0f} us/req (profiler overhead included)")
    for (file, line, func), (_, ncalls, tottime, _, _) in rows[: args.top]:
        where = f"{Path(file).name}:{line}({func})"
        report.line(f"{1e6 * tottime / n:>8.1f} us/req {ncalls / n:>7.2f} calls/req  {where}")
    report.line("\n## worker: py-spy, share of busy samples by leaf frame")
    if spy_out.exists():
        for frame, share in benchkit.folded_shares(spy_out, args.top):
            report.line(f"{100 * share:>6.1f}%  {frame}")
    else:
        report.line("(py-spy produced no output: is ptrace allowed?)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--setting", action="append", default=[], help="extra worker setting NAME=VALUE"
    )
    benchkit.cache_args(parser)
    benchkit.output_args(parser)
    return benchkit.run_reported(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
