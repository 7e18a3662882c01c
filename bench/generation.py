"""Generation through the pool: are concurrent samples batched, and do they get in the way?

One worker (``--backend hf`` by default, the bundled SmolLM2-135M unless ``LMPOOL_MODEL`` is
set) and ``RemoteLM`` in this process. Every figure is measured against its anchor in the same
run:

- one 32-token ``sample`` alone, then eight at once (target: eight <= 2x one);
- one ``next_token_logprobs`` alone, then while those eight decode (target: <= 3x alone);
- one ``score`` of a 32-token continuation alone, then eight at once.

The first two are measured in ``--repeats`` rounds, each timing the anchor right before what it
anchors (this machine's two cores are shared, so a single timing can be off by 20%); the table
gives the median over rounds of each ratio and its range.

Prompts are distinct (no cache answers) and samples ignore EOS, so each runs its 32 tokens.

    python bench/generation.py --out bench/results/generation-cpu.txt
    .venv-vllm/bin/python bench/generation.py --backend vllm
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import benchkit
from benchkit import Report

from localpool.redis_server import RedisServer


@dataclass
class Round:
    """One round's timings (seconds): each ratio is taken within its round."""

    one: float
    many: float
    alone: float
    during: float


async def timed(coro: Any) -> float:
    t0 = time.perf_counter()
    await coro
    return time.perf_counter() - t0


async def run(args: argparse.Namespace, report: Report) -> None:
    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(args.prompt_tokens)]

    n, tokens = args.concurrent, args.max_tokens
    with RedisServer() as server:
        worker = benchkit.Worker(
            server.url,
            backend=args.backend,
            max_batch=max(16, n),
            torch_threads=args.threads,
            log_level="WARNING",
        ).start()
        try:
            lm: Any = await benchkit.connect_remote_lm(worker, server.url, args.model, 900, 600)
            report.line(
                f"# backend {args.backend}, model {lm.model} (vocab {lm.vocab_size}), "
                f"{args.prompt_tokens}-token prompts, {tokens}-token samples, "
                f"{args.threads or 'default'} torch thread(s) on the worker"
            )
            await lm.sample(prompt(), 4, [], seed=0)  # warm up both paths
            await lm.next_token_logprobs(prompt())
            rounds: list[Round] = []
            for r in range(args.repeats):
                # each round measures every anchor next to what it anchors
                one = await timed(lm.sample(prompt(), tokens, [], seed=r))
                many = await timed(
                    asyncio.gather(*(lm.sample(prompt(), tokens, [], seed=i) for i in range(n)))
                )
                alone = statistics.median(
                    [await timed(lm.next_token_logprobs(prompt())) for _ in range(5)]
                )
                samples = asyncio.gather(
                    *(lm.sample(prompt(), tokens, [], seed=i) for i in range(n))
                )
                await asyncio.sleep(one / 4)  # the generations are under way
                during = [await timed(lm.next_token_logprobs(prompt())) for _ in range(3)]
                await samples
                rounds.append(Round(one, many, alone, max(during)))
                report.line(
                    f"  round {r + 1}: sample one {one:.3f} s, {n} {many:.3f} s "
                    f"({many / one:.2f}x); next-token alone {alone:.3f} s, during "
                    f"{max(during):.3f} s ({max(during) / alone:.2f}x)"
                )
            score_one = statistics.mean(
                [await timed(lm.score(prompt(), prompt()[:tokens])) for _ in range(2)]
            )
            score_many = await timed(
                asyncio.gather(*(lm.score(prompt(), prompt()[:tokens]) for _ in range(n)))
            )
            await lm.close()
        finally:
            worker.stop()
    report.line()
    report.line(
        f"{'measure (median over rounds)':<48} {'seconds':>9} {'x anchor':>9} "
        f"{'(range)':>13} {'target':>8}"
    )

    def row(what: str, seconds: float, ratios: list[float] | None, target: str = "") -> None:
        ratio = statistics.median(ratios) if ratios else 1.0
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else ""
        report.line(f"{what:<48} {seconds:>9.3f} {ratio:>9.2f} {spread:>13} {target:>8}")

    med = statistics.median
    row(f"one {tokens}-token sample (anchor)", med(r.one for r in rounds), None)
    row(
        f"{n} concurrent samples",
        med(r.many for r in rounds),
        [r.many / r.one for r in rounds],
        "<= 2",
    )
    row("next-token request alone (anchor, median of 5)", med(r.alone for r in rounds), None)
    row(
        f"next-token while {n} samples decode (worst of 3)",
        med(r.during for r in rounds),
        [r.during / r.alone for r in rounds],
        "<= 3",
    )
    row(f"one score of {tokens} tokens (anchor, mean of 2)", score_one, None)
    row(f"{n} concurrent scores", score_many, [score_many / score_one])
    report.line(f"# load at the end: {benchkit.load_average()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="the pool's model name")
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="worker torch threads; 0: default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=5, help="rounds, each timing anchors and loads in turn"
    )
    benchkit.output_args(parser)
    return benchkit.run_reported(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
