"""The vllm backend stepped as the worker steps it: batching, continuous batching, row transfer.

Prints, for one model (the tiny test Llama, or the bundled SmolLM2-135M with ``--model
default``), each figure against its anchor measured in the same run:

- start-up: ``VLLMBackend(...)`` until the first row is back (engine core and model worker are
  spawned processes);
- a logprobs batch of 16 distinct prompts vs 16 single-prompt calls one after the other;
- 8 concurrent 32-token samples vs one (target: <= 2x one);
- next-token latency alone vs submitted while those 8 samples decode (target: <= 3x alone);
- the row transfer: time per ``collective_rpc`` that fetches the captured rows, and per row.

    .venv-vllm/bin/python bench/generation_vllm.py                  # tiny model
    .venv-vllm/bin/python bench/generation_vllm.py --model default  # SmolLM2-135M
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchkit

sys.path.insert(0, str(benchkit.REPO))
sys.path.insert(0, str(benchkit.REPO / "tests"))

from shared.settings import Settings
from worker.backends.base import Work


def until_done(backend: Any, works: list[Work]) -> float:
    """Submit ``works`` and step until every one finished; seconds taken."""
    t0 = time.perf_counter()
    backend.submit(works)
    waiting = {id(w) for w in works}
    while waiting:
        for w in backend.step():
            waiting.discard(id(w))
    for w in works:
        if w.error is not None:
            raise w.error
    return time.perf_counter() - t0


def _drain(backend: Any, works: list[Work]) -> float:
    """Step until ``works`` (already submitted) finished; seconds taken."""
    t0 = time.perf_counter()
    waiting = {id(w) for w in works}
    while waiting:
        for w in backend.step():
            waiting.discard(id(w))
    return time.perf_counter() - t0


def sample(prompt: list[int], tokens: int, seed: int) -> Work:
    params = {"max_tokens": tokens, "eos": [], "temperature": 1.0, "seed": seed}
    return Work("sample", prompt, None, params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, default, or a model path")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    benchkit.output_args(parser)
    args = parser.parse_args()
    report = benchkit.Report(args.out, args.append)

    if args.model == "tiny":
        from poolkit import build_model

        model = str(build_model(Path(tempfile.mkdtemp(prefix="bench-vllm-")) / "model"))
    elif args.model == "default":
        model = ""
    else:
        model = args.model
    from worker.backends.vllm import VLLMBackend

    t0 = time.perf_counter()
    backend = VLLMBackend(Settings(backend="vllm", model=model, kv_cache_mb=args.kv_cache_mb))
    startup = time.perf_counter() - t0
    vocab = backend.info["vocab_size"]
    rng = random.Random(0)

    def prompt() -> list[int]:  # distinct first tokens: no prefix-cache hits between prompts
        return [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]

    report.line(f"# model: {model or 'SmolLM2-135M (bundled)'}, vocab {vocab}, {backend.dtype}")
    report.line(
        f"start-up (to the first row): {startup:.1f} s (backend's own: {backend.startup_s:.1f} s)"
    )
    until_done(backend, [Work("logprobs", prompt()) for _ in range(4)])  # warm

    batch, singles = [], []
    for _ in range(args.repeats):
        batch.append(until_done(backend, [Work("logprobs", prompt()) for _ in range(16)]))
        singles.append(sum(until_done(backend, [Work("logprobs", prompt())]) for _ in range(16)))
    b, s = statistics.median(batch), statistics.median(singles)
    report.line(
        f"logprobs, 16 prompts of {args.prompt_tokens} tokens: one batch {b * 1e3:.1f} ms, "
        f"16 singles {s * 1e3:.1f} ms ({s / b:.2f}x)"
    )

    one, eight = [], []
    for r in range(args.repeats):
        one.append(until_done(backend, [sample(prompt(), 32, r)]))
        eight.append(until_done(backend, [sample(prompt(), 32, r * 8 + i) for i in range(8)]))
    o, e = statistics.median(one), statistics.median(eight)
    report.line(
        f"sample, 32 tokens: one {o * 1e3:.1f} ms, 8 concurrent {e * 1e3:.1f} ms "
        f"({e / o:.2f}x one; target <= 2x)"
    )

    alone = [until_done(backend, [Work("logprobs", prompt())]) for _ in range(4 * args.repeats)]
    during: list[float] = []
    for r in range(args.repeats):
        gens = [sample(prompt(), 32, 1000 + r * 8 + i) for i in range(8)]
        backend.submit(gens)
        running = {id(g) for g in gens}
        probe: Work | None = None
        sent = 0.0
        steps = 0
        while running:
            if probe is None and steps % 3 == 1 and len(running) == len(gens):
                probe, sent = Work("logprobs", prompt()), time.perf_counter()
                backend.submit([probe])
            for w in backend.step():
                running.discard(id(w))
                if w is probe:
                    during.append(time.perf_counter() - sent)
                    probe = None
            steps += 1
        while probe is not None and probe.result is None and probe.error is None:
            backend.step()
    a, d = statistics.median(alone), statistics.median(during)
    single = a
    report.line(
        f"next-token latency: alone {a * 1e3:.1f} ms, during 8 samples {d * 1e3:.1f} ms "
        f"(median of {len(during)}; {d / a:.2f}x alone; target <= 3x)"
    )

    # The row transfer. Rows come back on vLLM's utility channel (collective_rpc), which the
    # engine core serves between engine steps; a fetch sent while a step runs (the backend
    # keeps one in flight while logprobs works are) comes back right after that step.
    # Idle: the engine has finished the works before the backend steps (pure transfer).
    for n in (1, 16):
        idle, waits = [], []
        for _ in range(args.repeats):
            works = [Work("logprobs", prompt()) for _ in range(n)]
            backend.submit(works)
            time.sleep(0.05 + 2 * (b if n > 1 else single))  # the engine finishes them meanwhile
            idle.append(_drain(backend, works))
            backend.transfer_s, backend.transfers = 0.0, 0
            until_done(backend, [Work("logprobs", prompt()) for _ in range(n)])
            waits.append(backend.transfer_s / max(backend.transfers, 1))
        report.line(
            f"{n} rows of {vocab} float32 from an idle engine: {statistics.median(idle) * 1e3:.2f}"
            f" ms (outputs + transfer); in a live batch the compute thread waited "
            f"{statistics.median(waits) * 1e3:.2f} ms per fetch"
        )
    backend.close()
    report.close()


if __name__ == "__main__":
    main()
