"""Interactive latency while a low-priority batch job saturates the pool, against idle.

One worker process (``--backend mock``: vocabulary 49,152, ``LMPOOL_MOCK_DELAY_MS=5`` so a
batch takes 5 ms + 0.1 ms per row; ``--backend hf``: the default model on CPU). An interactive
``RemoteLM`` (``priority="high"``, this process) sends one request at a time, distinct prompts:

1. idle: ``--samples`` requests with nothing else running (the anchor);
2. under load: a batch job (``priority="low"``, a separate producer process with
   ``--in-flight`` requests in flight, distinct prompts) floods the pool; once its backlog is
   in the low stream, the interactive producer sends ``--samples`` requests again. The job
   keeps going until they are done and it has completed at least ``--batch-requests``;
3. idle again after the job has drained (the drift check).

Printed: p50/p99 of each phase, under-load p50 over idle p50 (target <= 2x), the batch job's
throughput during the measured window and overall, the low stream's backlog while measuring
(so saturation is shown, not assumed) and the worker's mean batch time under load.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from typing import Any

import benchkit
import poolbench
import torch
from benchkit import Report, percentile

from localpool.redis_server import RedisServer
from shared.keys import Keys
from shared.redis_conn import connect_redis
from shared.settings import Settings

WARM = 20


def worker_settings(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    settings: dict[str, Any] = {
        "backend": args.backend,
        "log_level": "WARNING",
        "max_batch": args.max_batch,
        "result_ttl_s": args.result_ttl_s,
    }
    if args.backend == "mock":
        settings.update(mock_vocab_size=args.vocab, mock_delay_ms=args.delay_ms)
        return settings, f"mock-{args.vocab}"
    here = Settings.from_env()
    settings.update(device="cpu", cache_dir=here.cache_dir)
    if here.model:
        settings["model"] = here.model
    return settings, here.served_model_name


async def run(args: argparse.Namespace, report: Report) -> None:
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    settings, model = worker_settings(args)
    threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    low_stream = Keys().stream(model, "low")
    with RedisServer() as server:
        url = server.url
        worker = benchkit.Worker(url, extra_env=threads, **settings).start()
        lm: Any = None
        flood: poolbench.Producer | None = None
        raw = connect_redis(url)
        try:
            lm = await benchkit.connect_remote_lm(worker, url, model, 300, 600)
            vocab = lm.vocab_size
            assert worker.proc is not None
            pid = worker.proc.pid
            delay = f", mock delay {args.delay_ms:g} ms/batch" if args.backend == "mock" else ""
            report.line(
                f"# worker: 1 {args.backend} worker, model {model!r}, vocab {vocab}{delay}, "
                f"max_batch {args.max_batch}, result TTL {args.result_ttl_s} s, "
                f"{args.threads} torch thread(s)"
            )
            report.line(
                f"# interactive: this process, priority high, one {args.tokens}-token request at "
                f"a time, {args.samples} per phase (+{WARM} warm-up); batch job: another "
                f"process, priority low, {args.in_flight} in flight, >= {args.batch_requests} "
                "requests; all prompts distinct (no cache hits)"
            )
            prompts = poolbench.random_prompts(rng, WARM + 3 * args.samples, args.tokens, vocab)
            await poolbench.sequential(lm, prompts[:WARM])
            phases = [prompts[WARM + i * args.samples :][: args.samples] for i in range(3)]

            idle_before = await poolbench.sequential(lm, phases[0])

            flood = poolbench.Producer(
                url,
                model,
                priority="low",
                in_flight=args.in_flight,
                tokens=args.tokens,
                vocab=vocab,
                seed=args.seed + 1,
                min_requests=args.batch_requests,
                max_s=args.max_s,
            ).start()
            flood.wait_ready()
            deadline = time.monotonic() + 30
            while await raw.xlen(low_stream) < args.in_flight // 4:
                if time.monotonic() > deadline:
                    raise RuntimeError("the batch job's requests never reached the low stream")
                await asyncio.sleep(0.01)
            await asyncio.sleep(1.0)  # the job runs at its pace before measuring
            hb0 = poolbench.heartbeats(url).get(pid, {})
            backlog: list[int] = []
            measuring = True

            async def watch_backlog() -> None:
                while measuring:
                    backlog.append(await raw.xlen(low_stream))
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch_backlog())
            t_load0 = time.monotonic()
            under_load = await poolbench.sequential(lm, phases[1])
            t_load1 = time.monotonic()
            measuring = False
            await watcher
            hb1 = poolbench.heartbeats(url).get(pid, {})
            job = flood.finish(timeout_s=args.max_s + 60)
            deadline = time.monotonic() + 60
            while await raw.xlen(low_stream) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            idle_after = await poolbench.sequential(lm, phases[2])
        finally:
            if lm is not None:
                await lm.close()
            if flood is not None:
                flood.stop()
            await raw.aclose()
            worker.stop()

    in_window = poolbench.completions_between(job, t_load0, t_load1)
    window_s = t_load1 - t_load0
    active = [i for i, n in enumerate(job["counts"]) if n]
    span = (active[-1] - active[0] + 1) * float(job["bucket_s"]) if active else float("nan")
    batches = int(hb1.get("batches", 0)) - int(hb0.get("batches", 0))
    rows = int(hb1.get("requests", 0)) - int(hb0.get("requests", 0))
    busy = float(hb1.get("busy_s", 0)) - float(hb0.get("busy_s", 0))
    idle_p50 = 1000 * percentile(idle_before, 50)

    report.line()
    head = f"{'interactive phase':<34} {'n':>5} {'p50 ms':>9} {'p99 ms':>9} {'p50 / idle':>11}"
    report.line(head)
    report.line("-" * len(head))
    for name, lat in (
        ("idle (before the batch job)", idle_before),
        ("under load (batch job saturating)", under_load),
        ("idle (after the batch job)", idle_after),
    ):
        p50, p99 = 1000 * percentile(lat, 50), 1000 * percentile(lat, 99)
        report.line(f"{name:<34} {len(lat):>5} {p50:>9.2f} {p99:>9.2f} {p50 / idle_p50:>10.2f}x")
    report.line()
    ratio = percentile(under_load, 50) / percentile(idle_before, 50)
    report.line(
        f"target: interactive p50 under load <= 2x idle: {ratio:.2f}x -> "
        f"{'met' if ratio <= 2 else 'NOT met'}"
    )
    report.line(
        f"batch job: {job['done']} requests done, errors {job['errors'] or 'none'}; offline "
        f"throughput {in_window / window_s:.0f} req/s during the {window_s:.1f} s interactive "
        f"window, {job['done'] / span:.0f} req/s over the whole job ({span:.1f} s)"
    )
    if backlog:
        report.line(
            f"low stream backlog while measuring (XLEN every 50 ms, {len(backlog)} samples): "
            f"min {min(backlog)}, median {statistics.median(backlog):.0f}, max {max(backlog)}"
        )
    if batches:
        report.line(
            f"worker while measuring (heartbeat deltas, +-1 period): {rows} requests in {batches} "
            f"batches (mean {rows / batches:.1f}), {1000 * busy / batches:.1f} ms busy per batch"
        )
    report.line(f"# load at the end: {benchkit.load_average()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("mock", "hf"), default="mock")
    parser.add_argument("--delay-ms", type=float, default=5.0, help="LMPOOL_MOCK_DELAY_MS")
    parser.add_argument("--vocab", type=int, default=49_152, help="mock backend vocabulary")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--samples", type=int, default=200, help="interactive requests/phase")
    parser.add_argument("--batch-requests", type=int, default=2000, help="batch job, at least")
    parser.add_argument("--in-flight", type=int, default=256, help="batch job's in-flight cap")
    parser.add_argument("--max-batch", type=int, default=16, help="LMPOOL_MAX_BATCH")
    parser.add_argument(
        "--result-ttl-s",
        type=int,
        default=10,
        help="LMPOOL_RESULT_TTL_S (short: the job's results need not pile up in Redis)",
    )
    parser.add_argument("--max-s", type=float, default=120.0, help="batch job's time limit")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the worker")
    parser.add_argument("--seed", type=int, default=0)
    benchkit.output_args(parser)
    args = parser.parse_args(argv)
    return benchkit.run_reported(
        run, args, header=(poolbench.SHARED_NOTE, poolbench.code_version())
    )


if __name__ == "__main__":
    sys.exit(main())
