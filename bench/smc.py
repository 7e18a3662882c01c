"""SMC-shaped workload through the pool: KV cache on vs off, affinity vs none, genlm's case.

Particles share a prompt; each step every particle asks for the next-token distribution of its
own prefix (one token longer than the last step), then draws a token; every 4th step the
particles are resampled, which duplicates some. Phases, each on fresh workers and a flushed Redis:

A. one hf worker, KV cache on: requests/s, tokens requested vs computed, KV hit rate
B. one hf worker, KV cache off (fewer steps: each costs a full forward of every prefix)
C. two workers, KV on, two concurrent SMC runs: KV hit rate with affinity (LMPOOL_SHARDS=4, one
   affinity key per run) and without (LMPOOL_SHARDS=1: any worker takes any request)
D. genlm-backend's favourite case: P prompts sharing a prefix plus 8 distinct tokens, through the
   pool with no cache_kv call, against genlm-backend's AsyncTransformer in this process after an
   explicit cache_kv of the prefix.

    python bench/smc.py                       # defaults sized for 2 CPU cores
    python bench/smc.py --particles 64 --steps 32 --prompt-tokens 256   # the full shape
    LMPOOL_MODEL=DIR python bench/smc.py --device cuda --dtype bfloat16 ...   # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import time
from collections.abc import Sequence
from typing import Any, cast

import benchkit
import redis
import torch

from localpool.redis_server import RedisServer
from shared.heap import keep_freed_memory
from shared.keys import Keys
from shared.settings import Settings


async def smc(lm: Any, prompt: list[int], particles: int, steps: int, affinity: str | None,
              seed: int) -> tuple[int, int, float]:  # fmt: skip
    """Run one SMC loop; returns (requests, tokens requested, seconds)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    seqs = [list(prompt) for _ in range(particles)]
    requests = tokens = 0
    started = time.perf_counter()
    for step in range(steps):
        rows = await asyncio.gather(*(lm.next_token_logprobs(s, affinity=affinity) for s in seqs))
        requests += len(seqs)
        tokens += sum(map(len, seqs))
        drawn = benchkit.draw(torch.stack(rows), gen)
        seqs = [[*s, t] for s, t in zip(seqs, drawn, strict=True)]
        if step % 4 == 3:  # resampling duplicates some particles, drops others
            seqs = [list(seqs[i]) for i in sorted(rng.choices(range(particles), k=particles))]
    return requests, tokens, time.perf_counter() - started


KEYS = Keys()


async def settle(url: str, seconds: float = 1.0) -> dict[str, int]:
    await asyncio.sleep(seconds)  # two heartbeats: the counters are final
    return benchkit.kv_totals(url)


MODEL = Settings.from_env()
"""LMPOOL_MODEL (default: the bundled model) and LMPOOL_CACHE_DIR reach the workers from here."""


def start(url: str, n: int, args: argparse.Namespace, **settings: Any) -> list[benchkit.Worker]:
    common: dict[str, Any] = {"heartbeat_s": 0.3, "max_batch": 64, "max_wait_ms": 2}
    common.update(device=args.device, dtype=args.dtype, cache_dir=MODEL.cache_dir)
    if MODEL.model:
        common["model"] = MODEL.model
    common.update(settings)
    return [benchkit.Worker(url, **common).start() for _ in range(n)]


async def phase(url: str, args: argparse.Namespace, n_workers: int, runs: Sequence[str | None],
                steps: int, **settings: Any) -> dict[str, Any]:  # fmt: skip
    r = redis.Redis.from_url(url)
    r.flushall()
    workers = start(url, n_workers, args, **settings)
    try:
        lm = await benchkit.connect_remote_lm(workers[0], url, MODEL.served_model_name, 600, 3600)
        # every worker must be up before the clock starts
        while cast(int, r.zcard(KEYS.workers(MODEL.served_model_name))) < n_workers:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # leases settle
        prompt = random.Random(args.seed).choices(range(1000, 40000), k=args.prompt_tokens)
        outs = await asyncio.gather(
            *(
                smc(lm, prompt, args.particles, steps, run, args.seed + i)
                for i, run in enumerate(runs)
            )
        )
        await lm.close()
        kv = await settle(url)
    finally:
        for w in workers:
            w.stop()
        r.close()
    requests = sum(o[0] for o in outs)
    seconds = max(o[2] for o in outs)
    return {
        "requests": requests,
        "tokens": sum(o[1] for o in outs),
        "seconds": seconds,
        "rps": requests / seconds,
        "kv": kv,
        "hit": kv.get("tokens_reused", 0) / max(kv.get("tokens_requested", 0), 1),
    }


async def genlm_case(url: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Seconds per repeat, (pool, genlm-backend), for P prompts = a shared prefix + 8 tokens.

    Each repeat draws a new prefix; each side first runs the first set untimed (warm-up at the
    measured shape), then every set timed.
    """
    rng = random.Random(args.seed + 99)

    def draw(n: int) -> list[int]:
        return rng.choices(range(1000, 40000), k=n)

    sets = []
    for _ in range(args.d_repeats + 1):
        prefix = draw(args.prompt_tokens)
        sets.append((prefix, [prefix + draw(8) for _ in range(args.particles)]))
    with redis.Redis.from_url(url) as r:
        r.flushall()
    debug = {"log_level": "DEBUG"} if args.worker_log else {}
    workers = start(url, 1, args, **debug)
    pool_s: list[float] = []
    try:
        lm = await benchkit.connect_remote_lm(workers[0], url, MODEL.served_model_name, 600, 3600)
        for _, prompts in sets:
            t0 = time.perf_counter()
            await lm.batch_next_token_logprobs(prompts)
            pool_s.append(time.perf_counter() - t0)
        await lm.close()
    finally:
        for w in workers:
            w.stop()
        if args.worker_log:
            shutil.copy(workers[0].log_path, args.worker_log)
    ref = benchkit.genlm_transformer(benchkit.model_dir(), args.device, args.dtype, 64)
    genlm_s: list[float] = []
    for prefix, prompts in sets:
        t0 = time.perf_counter()
        ref.cache_kv(prefix)
        await ref.batch_next_token_logprobs(prompts)
        if args.device == "cuda":
            torch.cuda.synchronize()
        genlm_s.append(time.perf_counter() - t0)
    return pool_s[1:], genlm_s[1:]


async def main_async(args: argparse.Namespace, report: benchkit.Report) -> None:
    # as RemoteLM.connect sets it (shared.heap), from the start: genlm-backend in this process
    # runs at its fastest so
    kept = keep_freed_memory()
    report.line(f"# C heap of this process: freed memory {'kept' if kept else 'given back'}")
    with RedisServer() as server:
        url = server.url
        report.line(
            f"# model {benchkit.model_dir()}, {args.dtype} on "
            f"{args.device}{benchkit.device_name(args.device)}; "
            f"torch {torch.__version__}"
        )
        p = f"{args.particles} particles, {args.prompt_tokens}-token prompt"
        if "A" in args.phases:
            a = await phase(url, args, 1, [None], args.steps)
            report.line(
                f"A. KV on,  1 worker, {p}, {args.steps} steps: {a['requests']} requests in "
                f"{a['seconds']:.1f}s = {a['rps']:.1f} req/s; tokens requested {a['tokens']}, "
                f"computed {a['kv'].get('tokens_computed')}, KV hit rate {a['hit']:.3f}"
            )
            b = await phase(url, args, 1, [None], args.off_steps, kv_cache_mb=0)
            report.line(
                f"B. KV off, 1 worker, {p}, {args.off_steps} steps: {b['requests']} requests "
                f"in {b['seconds']:.1f}s = {b['rps']:.2f} req/s"
            )
            report.line(f"   KV on / off: {a['rps'] / b['rps']:.1f}x (target >= 4x)")
            runs = ["run-a", "run-b"]
            c1 = await phase(url, args, 2, runs, args.steps, shards=4)
            c0 = await phase(url, args, 2, runs, args.steps, shards=1)
            report.line(
                f"C. 2 workers, 2 concurrent runs, {args.steps} steps: KV hit rate with affinity "
                f"{c1['hit']:.3f} ({c1['rps']:.1f} req/s), without {c0['hit']:.3f} "
                f"({c0['rps']:.1f} req/s); single worker {a['hit']:.3f}"
            )
            report.line(f"   affinity / single worker: {c1['hit'] / a['hit']:.3f} (target >= 0.9)")
        if "D" in args.phases:
            pools, genlms = await genlm_case(url, args)
            pool_s, genlm_s = sum(pools), sum(genlms)
            each = ", ".join(f"{p:.3f}/{g:.3f}" for p, g in zip(pools, genlms, strict=True))
            report.line(
                f"D. {args.particles} prompts = shared {args.prompt_tokens}-token prefix + 8, "
                f"{len(pools)} sets after one untimed: pool (no cache_kv) {pool_s:.3f}s, "
                f"genlm-backend in-process with cache_kv {genlm_s:.3f}s; genlm / pool = "
                f"{genlm_s / pool_s:.2f} (target >= 1); per set pool/genlm s: {each}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--off-steps", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--phases", default="ABCD", help="which phases to run (B and C report against A)"
    )
    parser.add_argument("--d-repeats", type=int, default=3, help="timed prompt sets in D")
    parser.add_argument("--worker-log", help="D: copy the worker's log (DEBUG) to this file")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="both sides")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    benchkit.output_args(parser)
    args = parser.parse_args(argv)
    report = benchkit.Report(args.out, args.append)
    with benchkit.cleanup_on_signal():
        asyncio.run(main_async(args, report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
