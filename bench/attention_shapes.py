"""Seconds per batch of the hf backend on CUDA with cuDNN attention on vs off (the worker's choice).

Each set is P prompts = a new shared prefix + 8 tokens (phase D of bench/smc.py, same draws),
through ``HFBackend.logprobs`` with its KV cache: the batches' shapes vary with what the cache
holds. Each side runs in a fresh process (a cold start, as a new worker has). cuDNN's attention
builds a plan the first time it meets a shape; the worker turns it off on CUDA.

    LMPOOL_MODEL=DIR python bench/attention_shapes.py [--sets 8 --particles 64 --prefix 256]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time

import torch


def one_side(cudnn: bool, args: argparse.Namespace) -> list[float]:
    from shared.settings import Settings
    from worker.backends.hf import HFBackend

    backend = HFBackend(Settings.from_env().replace(device="cuda", dtype=args.dtype))
    torch.backends.cuda.enable_cudnn_sdp(cudnn)  # after the backend's own choice
    rng = random.Random(args.seed + 99)  # bench/smc.py's phase-D draws
    seconds = []
    for _ in range(args.sets):
        prefix = rng.choices(range(1000, 40000), k=args.prefix)
        prompts = [prefix + rng.choices(range(1000, 40000), k=8) for _ in range(args.particles)]
        t0 = time.perf_counter()
        backend.logprobs(prompts, None)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", type=int, default=8)
    parser.add_argument("--particles", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        print(json.dumps(one_side(args.side == "on", args)))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    print(f"$ python {' '.join(sys.argv)}")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    totals = {}
    for side in ("on", "off"):
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--side", side],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        seconds = json.loads(out.strip().splitlines()[-1])
        totals[side] = sum(seconds[1:])
        each = " ".join(f"{s:.3f}" for s in seconds)
        worst = max(seconds[1:])
        print(f"cuDNN attention {side:>3}: {each} s; after the first set: total "
              f"{totals[side]:.3f} s, worst {worst:.3f} s")  # fmt: skip
    print(f"on / off, after the first set: {totals['on'] / totals['off']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
