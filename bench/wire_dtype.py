"""What a lighter wire dtype costs in accuracy: float16 / bfloat16 rows against float32.

Computes next-token log-prob rows of the default model (SmolLM2-135M, hf backend, float32 on
the CPU) for ``--prompts`` random prompts, sends each through the codec in float16 and in
bfloat16 (``LMPOOL_WIRE_DTYPE``) and compares what the caller gets back (float32) with the
float32 row: the largest absolute error over the whole vocabulary, over the tokens that carry
the mass (log-prob > -10), and of the probabilities. The speed-up is measured by
``bench/overhead.py`` (it runs a pool per wire dtype).

    python bench/wire_dtype.py --out bench/results/wire_dtype-cpu.txt
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from typing import Any

import benchkit
import torch
from benchkit import Report

from shared.codec import decode_tensor, encode_tensor
from shared.settings import Settings


async def run(args: argparse.Namespace, report: Report) -> None:
    from worker.backends.hf import HFBackend

    backend = await asyncio.to_thread(HFBackend, Settings(backend="hf", kv_cache_mb=0))
    rng = random.Random(args.seed)
    vocab = backend.info["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(args.tokens)] for _ in range(args.prompts)]
    rows = torch.cat(
        [backend.logprobs(prompts[i : i + 16], None) for i in range(0, len(prompts), 16)]
    )
    report.line(
        f"# {backend.info['name_or_path']}: {len(prompts)} random {args.tokens}-token prompts, "
        f"vocab {vocab}, rows computed in float32 on the CPU"
    )
    report.line()
    head = (
        f"{'wire dtype':<10} {'bytes/row':>10} {'max |err| all':>14} {'max |err| lp>-10':>17} "
        f"{'max |err| prob':>15}"
    )
    report.line(head)
    report.line("-" * len(head))
    for name, dtype in (
        ("float32", torch.float32),
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
    ):
        wire = [encode_tensor(r, dtype) for r in rows]
        back = torch.stack([decode_tensor(w) for w in wire])
        err = (back - rows).abs()
        heavy = err[rows > -10]
        perr = (back.exp() - rows.exp()).abs().max().item()
        report.line(
            f"{name:<10} {len(wire[0]):>10,} {err.max().item():>14.3g} "
            f"{heavy.max().item():>17.3g} {perr:>15.3g}"
        )
    report.line()
    report.line(
        "each value is rounded to the nearest representable one (float16: 11 significant bits, "
        "bfloat16: 8), so the error grows with |log-prob|: the largest errors sit on the least "
        "likely tokens"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    benchkit.output_args(parser)
    args: Any = parser.parse_args(argv)
    return benchkit.run_reported(run, args)


if __name__ == "__main__":
    sys.exit(main())
