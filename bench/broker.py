"""What the broker costs per result: a single Redis against a 3-master Redis Cluster.

For each broker (single server; cluster of 3 masters with 1 replica each), vocabulary size
(49,152: SmolLM2; 128,256: Llama 3) and wire dtype (float32, float16, bfloat16): one mock
worker process (one torch thread) and ``RemoteLM`` in this process keep ``--in-flight``
distinct ``next_token_logprobs`` requests out for ``--seconds``. Printed per cell: results/s,
the bytes of results through the broker per second (each result enters Redis once and leaves
it once), and CPU seconds per 1,000 results of Redis (every server process, replicas
included), the producer and the worker, from ``/proc``.

On a machine of few cores the three sides share the cores, so results/s is a lower bound of
what one broker sustains; CPU per result is the figure that carries over to bigger machines
(``docs/scaling.md`` builds on it).

    python bench/broker.py --out bench/results/broker-cpu.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import benchkit
from benchkit import Report, closed_loop
from benchkit import process_cpu_s as cpu_seconds
from reply_paths import lmpool_call

from localpool.redis_cluster import RedisCluster
from localpool.redis_server import RedisServer

ROW_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


async def measure(
    url: str, redis_pids: list[int], arq_url: str, vocab: int, dtype: str, args: Any
) -> dict[str, float]:
    name = f"mock-{vocab}-{dtype}"
    arq: dict[str, Any] = {"arq_redis_url": arq_url} if arq_url != url else {}
    worker, lm = await benchkit.mock_pool(url, vocab, name, wire_dtype=dtype, result_ttl_s=2, **arq)
    try:
        call = lmpool_call(lm, vocab)
        await closed_loop(call, args.in_flight, 0.5, 1.0)  # warm up
        assert worker.proc is not None
        pids = {"producer": [os.getpid()], "worker": [worker.proc.pid], "redis": redis_pids}

        def cpu() -> dict[str, float]:
            return {k: sum(cpu_seconds(p) for p in ps) for k, ps in pids.items()}

        before = cpu()
        cell = await closed_loop(call, args.in_flight, 0.0, args.seconds)
        after = cpu()
        await lm.close()
    finally:
        worker.stop()
    done = max(cell.done, 1)
    out = {k: 1000 * (after[k] - before[k]) / done for k in before}
    out["rate"] = cell.rate
    out["gbps"] = cell.rate * 2 * vocab * ROW_BYTES[dtype] / 1e9
    return out


async def run(args: argparse.Namespace, report: Report) -> None:
    vocabs = [int(v) for v in args.vocabs.split(",")]
    dtypes = args.wire_dtypes.split(",")
    report.line(
        f"# {args.in_flight} requests in flight, {args.seconds:g} s per cell, {args.repeat} "
        "pass(es); one mock worker (1 torch thread), producer in this process"
    )
    rows: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    with RedisServer() as single:
        assert single.proc is not None
        with RedisCluster(masters=3, replicas=1) as cluster:
            cluster_pids = [n.pid for n in cluster.nodes if n.pid is not None]
            brokers = {
                "single": (single.url, [single.proc.pid]),
                "cluster 3x2": (cluster.url, cluster_pids),
            }
            for _ in range(args.repeat):
                for vocab in vocabs:
                    for dtype in dtypes:
                        for broker, (url, pids) in brokers.items():
                            m = await measure(url, pids, single.url, vocab, dtype, args)
                            rows.setdefault((broker, vocab, dtype), []).append(m)
    report.line()
    head = (
        f"{'broker':<12} {'vocab':>7} {'dtype':>9} {'results/s':>10} {'GB/s':>6} "
        f"{'CPU s per 1000 results: redis':>30} {'producer':>9} {'worker':>7}"
    )
    report.line(head)
    report.line("-" * len(head))
    for (broker, vocab, dtype), ms in rows.items():

        def mean(key: str, ms: list[dict[str, float]] = ms) -> float:
            return statistics.mean(m[key] for m in ms)

        report.line(
            f"{broker:<12} {vocab:>7} {dtype:>9} {mean('rate'):>10.0f} {mean('gbps'):>6.2f} "
            f"{mean('redis'):>30.3f} {mean('producer'):>9.3f} {mean('worker'):>7.3f}"
        )
    report.line()
    report.line("GB/s: result bytes into and out of the broker; CPU: seconds per 1,000 results")
    report.line(f"# load at the end: {benchkit.load_average()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", default="49152,128256")
    parser.add_argument("--wire-dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=1)
    benchkit.output_args(parser)
    return benchkit.run_reported(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
