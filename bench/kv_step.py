"""An SMC run through the hf backend's KV cache in this process: milliseconds a step, the
part of it spent gathering the rows' pasts into the pass's buffers, and page faults a step.

The default model (SmolLM2-135M, float32), one torch thread, 64 particles over a shared
256-token prompt, 32 steps, survivors resampled every 4th step (duplicates merged, as the
worker's batcher merges them). No Redis and no worker process: what the backend itself does
with a step.

    python bench/kv_step.py [--model DIR] [--particles 64] [--steps 32]

For a before / after, the backend of another checkout with this script:
``cd /tmp/old && PYTHONPATH=/tmp/old python /path/to/bench/kv_step.py``.
"""

from __future__ import annotations

import argparse
import random
import resource
import time
from typing import Any

import torch

from shared.settings import Settings
from worker.backends.hf import HFBackend
from worker.backends.hf.kv_cache import KVCache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder (default: the bundled default model)")
    parser.add_argument("--particles", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    more = {"model": args.model} if args.model else {}
    backend = HFBackend(Settings(kv_cache_mb=512, **more))
    spent = [0.0]
    gather = KVCache._gather

    def timed(self: KVCache, *a: Any, **k: Any) -> None:
        started = time.perf_counter()
        gather(self, *a, **k)
        spent[0] += time.perf_counter() - started

    KVCache._gather = timed  # type: ignore[method-assign]
    rng = random.Random(args.seed)
    n = args.particles
    prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
    backend.logprobs([prompt], None)
    parts = [[*prompt, rng.randrange(1000, 40000)] for _ in range(n)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    for step in range(args.steps):
        backend.logprobs(list(map(list, dict.fromkeys(map(tuple, parts)))), None)
        backend.settle()
        parts = [[*p, rng.randrange(1000, 40000)] for p in parts]
        if step % 4 == 3:
            parts = sorted(list(parts[rng.randrange(n)]) for _ in range(n))
    seconds = time.perf_counter() - started
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(
        f"{n} particles, {args.prompt_tokens}-token prompt, {args.steps} steps: "
        f"{1000 * seconds / args.steps:.1f} ms a step, of which gathering the pasts "
        f"{1000 * spent[0] / args.steps:.2f} ms; {faults / args.steps:.0f} page faults a step"
    )


if __name__ == "__main__":
    main()
