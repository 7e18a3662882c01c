"""Requests/s of HFBackend.logprobs on an SMC-shaped workload, kv cache on vs off.

A tiny random Llama (built in a temp dir) serves ``particles`` prompts per step over a shared
``prefix``, each step one token longer, resampled with duplicates between steps.

    python bench/kv_micro.py [--prefix 200 --particles 16 --steps 20 --hidden 64 --layers 2]

The counts of computed tokens include each run's warm-up request (the prefix).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shared.settings import Settings
from shared.tokenizer import byte_tokenizer
from worker.backends.hf import HFBackend

VOCAB = 1000


def build(path: Path, hidden: int, layers: int) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    byte_tokenizer(VOCAB).save_pretrained(path)


def workload(prefix: int, particles: int, steps: int) -> list[list[list[int]]]:
    rng = random.Random(0)
    shared = [rng.randrange(VOCAB) for _ in range(prefix)]
    parts = [list(shared) for _ in range(particles)]
    batches = []
    for _ in range(steps):
        parts = [[*p, rng.randrange(VOCAB)] for p in parts]
        batches.append(parts)
        parts = [list(rng.choice(parts)) for _ in parts]
    return batches


def run(backend: HFBackend, batches: list[list[list[int]]]) -> float:
    if backend.kv_cache is not None:
        backend.kv_cache.clear()
    backend.logprobs(batches[0][:1], None)  # warm-up (and, with the cache, the prefix)
    start = time.perf_counter()
    for batch in batches:
        backend.logprobs(batch, None)
    return sum(map(len, batches)) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--particles", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5, help="best of this many runs, alternating")
    args = parser.parse_args()
    batches = workload(args.prefix, args.particles, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp), args.hidden, args.layers)
        backends = {mb: HFBackend(Settings(model=tmp, kv_cache_mb=mb)) for mb in (0, 512)}
        best = dict.fromkeys(backends, 0.0)
        for _ in range(args.repeat):
            for mb, backend in backends.items():
                best[mb] = max(best[mb], run(backend, batches))
        requested = sum(map(len, (p for b in batches for p in b)))
        for mb, backend in backends.items():
            stats = backend.kv_stats()
            computed = stats["tokens_computed"] // args.repeat if mb else requested
            print(
                f"kv_cache_mb={mb:<4} {best[mb]:8.1f} requests/s (best of {args.repeat})  "
                f"tokens computed per run: {computed} of {requested} requested"
            )


if __name__ == "__main__":
    main()
