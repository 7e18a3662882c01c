"""``lmpool-score``: the command line (arguments, progress bar, exit status)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from producer.remote_lm import RemoteLM
from producer.scoring.files import errors_path
from producer.scoring.job import ScoreFileArgs, enqueue_score_file, read_job_progress
from producer.scoring.options import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SHARD_ROWS,
    MODES,
    ScoreOptions,
)
from producer.scoring.run import ScoreStats, error_text, score_jsonl
from shared.errors import LMPoolError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmpool-score",
        description="Score a JSONL file of prompts through the lmpool workers (resumable).",
        epilog="Formats, loading and resuming: python -c 'import producer.score; "
        "help(producer.score)' or README 'Offline scoring'.",
    )
    p.add_argument("input", nargs="?", help="JSONL prompts: ids or text, optional id")
    p.add_argument("output", nargs="?", help="JSONL results (index of OUT.d/ shards for vectors)")
    p.add_argument("--mode", choices=MODES, default="logprobs")
    p.add_argument("--top-k", type=int, help="logprobs: keep only the K most likely tokens")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="sample")
    p.add_argument("--temperature", type=float, default=1.0, help="sample")
    p.add_argument("--seed", type=int, help="sample: seed (a line's own 'seed' wins)")
    p.add_argument(
        "--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="requests in flight"
    )
    p.add_argument("--shard-rows", type=int, default=DEFAULT_SHARD_ROWS, help="rows per .npy")
    p.add_argument("--redis-url", help="default LMPOOL_REDIS_URL")
    p.add_argument("--model", help="model name the workers registered; default from LMPOOL_*")
    p.add_argument("--timeout-s", type=float, help="seconds per request; default LMPOOL_TIMEOUT_S")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--enqueue", action="store_true", help="run it as the arq job score_file; print its id"
    )
    p.add_argument("--job-status", metavar="JOB_ID", help="print a score_file job's progress")
    return p


def options_from_args(args: argparse.Namespace) -> ScoreOptions:
    return ScoreOptions(
        mode=args.mode,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        concurrency=args.concurrency,
        shard_rows=args.shard_rows,
    )


async def _run_cli(args: argparse.Namespace, options: ScoreOptions) -> ScoreStats:
    from tqdm import tqdm

    lm = await RemoteLM.connect(
        args.redis_url, args.model, args.timeout_s, cache_size=0, priority="low"
    )
    stats = ScoreStats()
    bar: Any = None
    last_failed = 0

    def progress(s: ScoreStats) -> None:
        nonlocal bar, last_failed
        if bar is None:
            tty = sys.stderr.isatty()
            bar = tqdm(
                total=s.total,
                initial=min(s.known_done, s.total),
                unit="line",
                dynamic_ncols=True,
                mininterval=0.1 if tty else 5.0,
                file=sys.stderr,
            )
        bar.update(1)
        if s.failed != last_failed:
            last_failed = s.failed
            bar.set_postfix(failed=s.failed, refresh=False)

    try:
        await score_jsonl(
            lm, args.input, args.output, options, None if args.no_progress else progress, stats
        )
    finally:
        if bar is not None:
            bar.close()
        await lm.close()
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.job_status:
        info = asyncio.run(read_job_progress(args.redis_url, args.job_status))
        print(json.dumps(info or {"job": args.job_status, "state": "unknown"}, indent=1))
        # a script can tell: 0 running or finished, 1 failed, interrupted or unknown
        return 0 if info and info.get("state") not in ("failed", "interrupted") else 1
    if args.input is None or args.output is None:
        parser.error("INPUT and OUTPUT are needed")
    try:
        options = options_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    if args.enqueue:
        job_args = ScoreFileArgs.from_options(options, model=args.model, timeout_s=args.timeout_s)
        job = asyncio.run(
            enqueue_score_file(args.redis_url, args.input, args.output, **job_args.job_kwargs())
        )
        print(job)
        return 0
    try:
        stats = asyncio.run(_run_cli(args, options))
    except KeyboardInterrupt:
        print("interrupted; run again with the same output to resume", file=sys.stderr)
        return 130
    except (LMPoolError, OSError) as e:
        print(f"lmpool-score: {error_text(e)}", file=sys.stderr)
        return 2
    print(stats.summary())
    if stats.failed:
        print(f"failed lines and their errors: {errors_path(args.output)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
