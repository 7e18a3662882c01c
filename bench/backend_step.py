"""The hf backend's SMC step against the bare loop's, in one process, no Redis: what the KV
path (plan, gather, cascade attention, stores) adds to the forward pass and the log-softmax.

A random Llama of ``bench/random_model.py``'s ``--shape`` (tiny by default), float32, one
torch thread; 64 particles over a shared 256-token prompt, each step one new token each
(distinct: no merging), ``--steps`` steps. Backend: ``HFBackend.logprobs`` then ``settle``;
bare: one decode step of the 64 rows with transformers' own cache, then the log-softmax.
Medians of the steps after the first four.

    python bench/backend_step.py --shape tiny
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import random_model
import torch

from shared.settings import Settings
from worker.backends.hf import HFBackend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tiny", choices=sorted(random_model.SHAPES))
    parser.add_argument("--particles", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        path = random_model.build(
            Path(folder), args.shape, random_model.default_tokenizer_dir(), torch.float32, 0
        )
        backend = HFBackend(Settings(kv_cache_mb=512, model=str(path)))
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(256)]
    backend.logprobs([prompt], None)
    rows = [[*prompt, rng.randrange(1000, 40000)] for _ in range(args.particles)]
    pool = []
    for _ in range(args.steps):
        started = time.perf_counter()
        backend.logprobs(rows, None)
        backend.settle()
        pool.append(time.perf_counter() - started)
        rows = [[*r, rng.randrange(1000, 40000)] for r in rows]
    bare = []
    with torch.inference_mode():
        out = backend.model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(args.particles)
        for _ in range(args.steps):
            tokens = torch.tensor([[rng.randrange(1000, 40000)] for _ in range(args.particles)])
            started = time.perf_counter()
            out = backend.model(
                input_ids=tokens, past_key_values=cache, use_cache=True, logits_to_keep=1
            )
            torch.log_softmax(out.logits[:, -1].float(), -1)
            bare.append(time.perf_counter() - started)
    ms = {name: 1000 * statistics.median(t[4:]) for name, t in (("backend", pool), ("bare", bare))}
    print(
        f"{args.shape}, {args.particles} particles, 256-token prompt: backend step "
        f"{ms['backend']:.2f} ms, bare step {ms['bare']:.2f} ms ({ms['backend'] / ms['bare']:.2f}x)"
    )


if __name__ == "__main__":
    main()
