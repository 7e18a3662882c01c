"""Shared-cache hit latency against recomputing, with a raw Redis GET of the same value as anchor.

One worker process (``--backend hf``: the default model, LMPOOL_MODEL unset = the bundled
SmolLM2-135M-Instruct, on CPU with ``LMPOOL_KV_CACHE_MB=0`` so that nothing is reused between
prompts; ``--backend mock``: the mock backend with a 49,152-token vocabulary). Requests go one
at a time, so each latency is one request alone:

1. computed: producer A asks for ``--prompts`` distinct random prompts of ``--tokens`` tokens,
   each for the first time: the worker runs the forward pass (end-to-end latency at A);
2. shared-cache hit: producer B (a second ``RemoteLM``, its own local cache empty) asks for the
   same prompts: the SUBMIT script finds each result in Redis; repeated ``--rounds`` times,
   B's local cache emptied (``clear_cache()``) before each round;
3. local LRU hit: B asks again without emptying its cache (no Redis round trip);
4. anchor: a plain GET of one stored result (redis-py asyncio, the producer's own client
   settings), and GET followed by ``protocol.decode_result`` (what a hit must do at least).

Rounds interleave 2, 3 and 4 so that a shared machine's drift hits them alike. Every hit is
checked equal to the computed row, and the worker's request counter is checked not to move
while hits are served.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import benchkit
import poolbench
import torch
from benchkit import Report, percentile

from localpool.redis_server import RedisServer
from shared import protocol
from shared.keys import Keys
from shared.redis_conn import connect_redis
from shared.scripts import SUBMIT_SCRIPT, run_script, submit_call
from shared.settings import Settings
from worker.status import collect

WARM_PROMPTS = 4


async def timed_each(
    items: list[Any], call: Callable[[Any], Awaitable[Any]]
) -> tuple[list[float], list[Any]]:
    """Await ``call(item)`` for each item in turn; latencies (s) and results."""
    latencies: list[float] = []
    results: list[Any] = []
    for item in items:
        t0 = time.perf_counter()
        out = await call(item)
        latencies.append(time.perf_counter() - t0)
        results.append(out)
    return latencies, results


def worker_settings(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The worker's LMPOOL_* settings and the model name producers ask for."""
    settings: dict[str, Any] = {
        "backend": args.backend,
        "log_level": "WARNING",
        "max_batch": args.max_batch,
    }
    if args.backend == "mock":
        settings["mock_vocab_size"] = args.vocab
        return settings, f"mock-{args.vocab}"
    here = Settings.from_env()  # the worker gets no LMPOOL_* variable but these
    settings.update(device="cpu", kv_cache_mb=0, cache_dir=here.cache_dir)
    if here.model:
        settings["model"] = here.model
    return settings, here.served_model_name


def row(name: str, values: list[float], ref: float | None = None, note: str = "") -> str:
    p50, p99 = 1000 * percentile(values, 50), 1000 * percentile(values, 99)
    ratio = f"{ref / p50:>10.1f}x" if ref is not None else f"{'':>11}"
    return f"{name:<44} {len(values):>5} {p50:>9.3f} {p99:>9.3f} {ratio}  {note}".rstrip()


async def run(args: argparse.Namespace, report: Report) -> None:
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    settings, model = worker_settings(args)
    threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    keys = Keys()
    with RedisServer() as server:
        url = server.url
        worker = benchkit.Worker(url, extra_env=threads, **settings).start()
        lm_a: Any = None
        lm_b: Any = None
        raw = connect_redis(url)
        try:
            lm_a = await benchkit.connect_remote_lm(worker, url, model, 300, 600)
            from producer import RemoteLM

            lm_b = await RemoteLM.connect(
                model=model,
                cache_size=2 * args.prompts,
                settings=Settings(redis_url=url, timeout_s=600, connect_timeout_s=10),
            )
            vocab = lm_a.vocab_size
            report.line(
                f"# worker: 1 {args.backend} worker, model {model!r}, vocab {vocab}, "
                f"{lm_a.meta.get('dtype')} on {lm_a.meta.get('device')}, "
                + ("kv_cache_mb 0, " if args.backend == "hf" else "")
                + f"{args.threads} torch thread(s); redis {server.binary}, loopback"
            )
            report.line(
                f"# {args.prompts} distinct random {args.tokens}-token prompts, one request at a "
                f"time; {args.rounds} rounds of hits, each round: shared hits, anchor GETs, "
                f"local hits; warm-up: {WARM_PROMPTS} other prompts"
            )
            warm = poolbench.random_prompts(rng, WARM_PROMPTS + args.prompts, args.tokens, vocab)
            prompts, warm = warm[WARM_PROMPTS:], warm[:WARM_PROMPTS]
            await timed_each(warm, lm_a.next_token_logprobs)

            before = await wait_counter(url, worker, "requests", WARM_PROMPTS)
            computed_s, computed = await timed_each(prompts, lm_a.next_token_logprobs)
            hb = await wait_counter(url, worker, "requests", WARM_PROMPTS + args.prompts)
            busy_s = float(hb.get("busy_s", 0)) - float(before.get("busy_s", 0))

            # the first prompt's digest and shard, as the producer computes them
            first = lm_a._prepare("logprobs", prompts[0], None, {})
            digest, shard = first.digest, first.shard
            result_key = keys.result(model, shard, digest)
            value = await raw.get(result_key)
            assert value is not None, "the computed result is not in the shared cache"

            # the SUBMIT script's KEYS for a hit: its own counter, not the pool's
            submit_keys, submit_args = submit_call(
                keys,
                model,
                shard,
                keys.stream(model, "high", shard),
                [(digest, "0", b"unused")],
                reply=keys.reply("bench"),
                wait_ms=60_000,
                max_queue=100_000,
                stale_ms=15_000,
            )
            submit_keys[0] = "bench:stats"

            async def get_decode(_: object) -> torch.Tensor:
                return protocol.decode_result(await raw.get(result_key))

            async def submit_hit(_: object) -> Any:
                answer = await run_script(raw, SUBMIT_SCRIPT, submit_keys, submit_args)
                assert answer[0] == 1, answer
                return answer

            paths: dict[str, list[float]] = {
                k: [] for k in ("shared", "local", "get", "dec", "lua")
            }
            mismatches = 0
            requests_before = int(hb.get("requests", 0))
            for _ in range(args.rounds):
                lm_b.clear_cache()
                lat, rows = await timed_each(prompts, lm_b.next_token_logprobs)
                paths["shared"] += lat
                mismatches += sum(
                    not torch.equal(a, b) for a, b in zip(rows, computed, strict=True)
                )
                paths["get"] += (await timed_each(prompts, lambda _p: raw.get(result_key)))[0]
                paths["dec"] += (await timed_each(prompts, get_decode))[0]
                paths["lua"] += (await timed_each(prompts, submit_hit))[0]
                lat, rows = await timed_each(prompts, lm_b.next_token_logprobs)
                paths["local"] += lat
                mismatches += sum(
                    not torch.equal(a, b) for a, b in zip(rows, computed, strict=True)
                )
            await asyncio.sleep(2.5)  # a heartbeat period: the worker's counters catch up
            hb = await wait_counter(url, worker, "requests", requests_before)
            requests_after = int(hb.get("requests", 0))
            stats = (await collect(raw, keys))["models"][model]["producer_counters"]
        finally:
            for lm in (lm_a, lm_b):
                if lm is not None:
                    await lm.close()
            await raw.aclose()
            worker.stop()

    ms = {k: 1000 * percentile(v, 50) for k, v in paths.items()}
    comp_ms = 1000 * percentile(computed_s, 50)
    report.line()
    head = f"{'path':<46} {'n':>5} {'p50 ms':>9} {'p99 ms':>9} {'computed/x':>11}"
    report.line(head)
    report.line("-" * len(head))
    report.line(row("computed: first request (worker forward pass)", computed_s, comp_ms))
    report.line(
        row(
            "shared-cache hit (2nd RemoteLM, empty LRU)",
            paths["shared"],
            comp_ms,
            f"= {ms['shared'] / ms['get']:.1f}x the GET anchor",
        )
    )
    report.line(row("local LRU hit (same RemoteLM again)", paths["local"], comp_ms))
    report.line(row(f"anchor: redis GET of the {len(value):,} B result", paths["get"], comp_ms))
    report.line(row("anchor: GET + protocol.decode_result", paths["dec"], comp_ms))
    report.line(row("anchor: SUBMIT script alone (EVALSHA, a hit)", paths["lua"], comp_ms))
    report.line()
    n_c = len(computed_s)
    p99_note = "the slowest of them" if n_c <= 100 else "nearest rank"
    report.line(
        "computed/x: p50 of the computed path / p50 of this path; p50, p99: nearest rank "
        f"(p99 of the {n_c} computed requests is {p99_note})"
    )
    report.line(
        f"worker: {busy_s / n_c * 1000:.1f} ms busy per computed request (batch of 1: read, "
        "forward pass, write; heartbeat busy_s)"
    )
    report.line(
        f"checks: {mismatches} of {2 * args.rounds * n_c} hits differ from the computed row; "
        f"worker requests while hits were served: {requests_before} -> {requests_after}; "
        f"pool's producer stats: {dict(sorted(stats.items()))}"
    )
    ratio = comp_ms / ms["shared"]
    target_note = "" if args.backend == "hf" else " (the target is about --backend hf)"
    report.line(
        f"target: shared hit >= 20x faster than recomputing: {ratio:.1f}x -> "
        f"{'met' if ratio >= 20 else 'NOT met'}{target_note}"
    )
    report.line(
        f"target: shared hit p50 < 1 ms for a {vocab:,}-entry float32 vector: "
        f"{ms['shared']:.3f} ms -> {'met' if ms['shared'] < 1 else 'NOT met'} "
        f"(anchor: raw GET p50 {ms['get']:.3f} ms)"
    )
    report.line(f"# load at the end: {benchkit.load_average()}")


async def wait_counter(
    url: str, worker: benchkit.Worker, name: str, at_least: int, timeout_s: float = 10.0
) -> dict[str, Any]:
    """The worker's heartbeat once its counter ``name`` reaches ``at_least`` (it lags)."""
    assert worker.proc is not None
    deadline = time.monotonic() + timeout_s
    info: dict[str, Any] = {}
    while time.monotonic() < deadline:
        info = poolbench.heartbeats(url).get(worker.proc.pid, {})
        if int(info.get(name, 0)) >= at_least:
            break
        await asyncio.sleep(0.1)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("hf", "mock"), default="hf")
    parser.add_argument("--prompts", type=int, default=48, help="distinct prompts")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of hits over all prompts")
    parser.add_argument("--vocab", type=int, default=49_152, help="mock backend vocabulary")
    parser.add_argument("--max-batch", type=int, default=16, help="LMPOOL_MAX_BATCH")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the worker (default 1: the machine has 2 shared cores)",
    )
    parser.add_argument("--seed", type=int, default=0)
    benchkit.output_args(parser)
    args = parser.parse_args(argv)
    return benchkit.run_reported(
        run, args, header=(poolbench.SHARED_NOTE, poolbench.code_version())
    )


if __name__ == "__main__":
    sys.exit(main())
