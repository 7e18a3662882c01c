"""A batch of long scores through the hf backend: its time and the worker's peak memory.

lm-evaluation-harness's perplexity tasks and ``lmpool-score`` over long documents send batches
of long continuations; a score pass keeps the logits of every continuation position, float32
rows of the vocabulary (16 continuations of 1,024 tokens at SmolLM2's 49,152: 3.2 GB).
Each run is a fresh process (its peak resident memory is its own): the default model on the
CPU, ``--items`` prompts of 32 random tokens each with a continuation of ``--tokens``, scored by
one ``score_many`` call, as a worker runs one batch, with the KV cache on (512 MB) and off.
The anchor is the process' resident memory before the call (the model loaded); the peak is
the call's own (``VmHWM``, reset before it).

    python bench/score_memory.py                       # 16 x 1,024 tokens
    python bench/score_memory.py --root /tmp/before    # another checkout's backend, same runs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import benchkit


def status_mib(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in MiB."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) // 1024


def one_run(kv_cache_mb: int, items: int, tokens: int, threads: int) -> dict[str, float]:
    import torch

    from shared.settings import Settings
    from worker.backends.hf import HFBackend

    torch.set_num_threads(threads)
    backend = HFBackend(Settings(backend="hf", kv_cache_mb=kv_cache_mb))
    rng = random.Random(0)
    work = [
        (
            [rng.randrange(100, 40_000) for _ in range(32)],
            [rng.randrange(100, 40_000) for _ in range(tokens)],
        )
        for _ in range(items)
    ]
    before = status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from here: loading the model is not the call's
    started = time.perf_counter()
    out = backend.score_many(work, None)
    backend.settle()
    seconds = time.perf_counter() - started
    peak = status_mib("VmHWM")
    total = float(sum(float(o.sum()) for o in out if isinstance(o, torch.Tensor)))
    return {"seconds": seconds, "before_mib": before, "peak_mib": peak, "sum": total}


def run(args: argparse.Namespace, report: benchkit.Report) -> None:
    root = Path(args.root).resolve() if args.root else Path(__file__).resolve().parent.parent
    report.line(
        f"# backend from {root}; default model, CPU, {args.threads} torch thread(s); "
        f"{args.items} continuations of {args.tokens} tokens after 32-token prompts, one "
        "score_many call in a fresh process per run"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    for kv in (512, 0):
        argv = [sys.executable, __file__, "--one", str(kv), "--items", str(args.items)]
        argv += ["--tokens", str(args.tokens), "--threads", str(args.threads)]
        r = benchkit.child_json(argv, env=env, cwd=root)
        report.line(
            f"KV cache {'on ' if kv else 'off'}: {r['seconds']:.1f} s, resident memory "
            f"{r['before_mib']:.0f} MiB before the call, peak {r['peak_mib']:.0f} MiB "
            f"(+{r['peak_mib'] - r['before_mib']:.0f}); sum of the scores {r['sum']:.4f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--root", help="another checkout whose backend runs (an A/B)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    benchkit.output_args(parser)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one_run(args.one, args.items, args.tokens, args.threads)))
        return 0
    return benchkit.run_reported_sync(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
