"""Where one request's time goes at one in flight: a timeline across producer and worker.

Starts a private Redis and a mock worker (vocabulary 49,152, one torch thread) whose request
path is probed (``bench/timeline_probe``: the folder goes first on the worker's PYTHONPATH),
probes this process's producer the same way, then sends ``--requests`` sequential
``next_token_logprobs`` calls of distinct prompts. Every probe marks when a stage starts (``>``)
and ends (``<``) on the host's wall clock; for each request the marks are taken relative to its
start, and the table gives each mark's median offset and each stage's median duration. The
probes add a few microseconds each: the request's p50 is printed with and without them.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchkit
from benchkit import Report
from reply_paths import VOCAB, lmpool_call

PROBES = Path(__file__).resolve().parent / "timeline_probe"
sys.path.insert(0, str(PROBES))

import timeline_marks  # noqa: E402  (lives in PROBES)


async def requests(call: object, n: int) -> list[float]:
    latencies = []
    for _ in range(n):
        started = time.perf_counter()
        timeline_marks.mark("request >")
        await call()  # type: ignore[operator]
        timeline_marks.mark("request <")
        latencies.append(time.perf_counter() - started)
    return latencies


def offsets(events: list[tuple[int, str]]) -> dict[str, list[float]]:
    """Per mark (the k-th occurrence in a request numbered), its offsets in microseconds
    from the start of the request it falls in."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    cycle: list[tuple[int, str]] = []

    def close() -> None:
        if not cycle:
            return
        start = cycle[0][0]
        seen: collections.Counter[str] = collections.Counter()
        for t, name in cycle:
            seen[name] += 1
            key = name if seen[name] == 1 else f"{name} (#{seen[name]})"
            out[key].append((t - start) / 1000)

    for t, name in sorted(events):
        if name == "request >":
            close()
            cycle = []
        if cycle or name == "request >":
            cycle.append((t, name))
    close()
    return out


def durations(events: list[tuple[int, str]]) -> dict[str, list[float]]:
    """Per stage, the microseconds from its first start in a request to the end that follows
    (a stage that starts before the request, like the worker's blocking read, is left out)."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    started: dict[str, int] = {}
    done: set[str] = set()
    for t, name in sorted(events):
        if name == "request >":
            started, done = {}, set()
        stage, edge = name[:-2], name[-1]
        if edge == ">" and stage not in started and stage not in done:
            started[stage] = t
        elif edge == "<" and stage in started:
            out[stage].append((t - started.pop(stage)) / 1000)
            done.add(stage)
    return out


async def run(args: argparse.Namespace, report: Report) -> None:
    from producer import loop

    with (
        benchkit.cache_redis(args, report, 4 * VOCAB) as (server, cache_settings),
        tempfile.TemporaryDirectory() as tmp,
    ):
        marks_file = Path(tmp) / "worker-marks.txt"
        path = os.pathsep.join(
            filter(None, [str(PROBES), str(benchkit.REPO), os.environ.get("PYTHONPATH")])
        )
        worker, lm = await benchkit.mock_pool(
            server.url,
            VOCAB,
            f"mock-{VOCAB}",
            extra_env={"PYTHONPATH": path, "BENCH_TIMELINE_OUT": str(marks_file)},
            **cache_settings,
        )
        try:
            call = lmpool_call(lm)
            bare = await requests(call, args.warm)  # warm-up, unprobed producer
            bare = await requests(call, args.requests)
            timeline_marks.wrap(loop.LoopState, "_flush", "producer SUBMIT")
            timeline_marks.wrap(loop.LoopState, "_send_whole", "producer SUBMIT + pop + GET")
            timeline_marks.wrap(loop.LoopState, "_deliver", "producer reply")
            timeline_marks.wrap(loop.LoopState, "_fetch", "producer GET")
            timeline_marks.EVENTS.clear()
            first_ns = time.time_ns()
            probed = await requests(call, args.requests)
            mine = list(timeline_marks.EVENTS)
        finally:
            await lm.close()
            worker.stop()
        theirs = [
            (int(t), name)
            for t, name in (line.rstrip("\n").split(" ", 1) for line in marks_file.open())
            if int(t) >= first_ns
        ]
    report.line(
        f"# {args.requests} sequential requests, mock vocabulary {VOCAB:,}, float32; p50 "
        f"{1000 * statistics.median(bare):.2f} ms unprobed, "
        f"{1000 * statistics.median(probed):.2f} ms probed"
    )
    report.line()
    marks = offsets(mine + theirs)
    spans = durations(mine + theirs)
    enough = [(k, v) for k, v in marks.items() if len(v) >= args.requests // 2]
    report.line(f"{'mark':<34} {'seen in':>8} {'median offset us':>17}")
    for name, values in sorted(enough, key=lambda kv: statistics.median(kv[1])):
        report.line(f"{name:<34} {len(values):>8} {statistics.median(values):>17.0f}")
    report.line()
    report.line(f"{'stage':<28} {'median duration us':>19}")
    for name, _values in sorted(enough, key=lambda kv: statistics.median(kv[1])):
        if name.endswith(" >") and name[:-2] in spans:
            report.line(f"{name[:-2]:<28} {statistics.median(spans[name[:-2]]):>19.0f}")
    report.line(f"# load at the end: {benchkit.load_average()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="probed requests")
    parser.add_argument("--warm", type=int, default=300, help="warm-up requests")
    benchkit.cache_args(parser)
    benchkit.output_args(parser)
    return benchkit.run_reported(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
