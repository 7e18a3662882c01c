"""Helpers for cache_hit.py, priority.py and soak.py: load-generating producer processes,
worker heartbeats, process memory, and the header lines every result file carries.

As a script it is the load generator itself (one producer process; the benchmarks start it):

    python bench/poolbench.py --redis-url URL --model M --priority low --in-flight 256 \\
        --stop-file F --out F.json [--min-requests N] [--max-s S]

It prints ``ready`` once connected, keeps ``--in-flight`` distinct requests in flight (random
prompts, so nothing is answered from the cache) until ``--stop-file`` exists and at least
``--min-requests`` have completed (or ``--max-s`` passed), then writes a JSON summary:
completions per 0.1 s since its start (``time.monotonic()``, CLOCK_MONOTONIC: comparable
across processes) and a sample of latencies, both held in memory allocated at the start.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchkit
import redis

SHARED_NOTE = (
    "# note: the machine was shared with other engineers' jobs (tests, benchmarks) during this "
    "run; load averages are printed at the start and the end"
)
FIRST_ID = 100
"""Prompt token ids are drawn from [FIRST_ID, vocab): no special tokens of a real tokenizer."""


# -- header lines ---------------------------------------------------------------------------
def code_version() -> str:
    """Which lmpool code ran: the git commit and dirty files, or the folder when not a checkout."""
    repo = benchkit.REPO
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        origin = os.environ.get("BENCH_CODE_NOTE", "")
        return f"# code: {repo} (not a git checkout{'; ' + origin if origin else ''})"
    changed = [line[3:] for line in dirty if line.strip()]
    state = f"modified: {', '.join(changed)}" if changed else "clean"
    return f"# code: lmpool {head} in {repo} ({state})"


# -- prompts ----------------------------------------------------------------------------------
def random_prompts(rng: random.Random, n: int, tokens: int, vocab: int) -> list[list[int]]:
    """``n`` distinct random prompts; distinct first tokens, so no two share a prefix."""
    firsts = rng.sample(range(FIRST_ID, vocab), n)
    return [[f, *(rng.randrange(FIRST_ID, vocab) for _ in range(tokens - 1))] for f in firsts]


# -- workers ---------------------------------------------------------------------------------
async def sequential(
    lm: Any, prompts: list[list[int]], pause: Callable[[], float] | None = None
) -> list[float]:
    """Latency (s) of each prompt, sent one at a time; ``pause``: seconds to wait (untimed)
    before each, so that requests do not all arrive just after the last answer."""
    out: list[float] = []
    for p in prompts:
        if pause is not None:
            await asyncio.sleep(pause())
        t0 = time.perf_counter()
        await lm.next_token_logprobs(p)
        out.append(time.perf_counter() - t0)
    return out


def heartbeats(url: str, prefix: str = "lmpool") -> dict[int, dict[str, Any]]:
    """Every live worker's heartbeat hash, by process id."""
    r: Any = redis.Redis.from_url(url)  # the sync client; its stubs mix in Awaitable
    try:
        out: dict[int, dict[str, Any]] = {}
        for key in r.scan_iter(f"{prefix}:worker:*"):
            raw = r.hgetall(key)
            info = {k.decode(): json.loads(v) for k, v in raw.items()}
            if "pid" in info:
                out[int(info["pid"])] = info
        return out
    finally:
        r.close()


def wait_workers(workers: list[benchkit.Worker], url: str, timeout_s: float) -> None:
    """Until every worker has published a heartbeat (its pid is in a worker hash)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for w in workers:
            if not w.alive():
                raise RuntimeError(f"worker exited at start:\n{w.log_tail()}")
        seen = heartbeats(url)
        if all(w.proc is not None and w.proc.pid in seen for w in workers):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers not ready after {timeout_s:g}s:\n{workers[0].log_tail()}")
        time.sleep(0.1)


def rss_mib(pid: int) -> float:
    """Resident set size of ``pid`` (VmRSS in /proc/PID/status), MiB; NaN if unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


# -- producer processes -------------------------------------------------------------------------
class Producer:
    """One load-generating producer process (this file run as a script)."""

    def __init__(
        self,
        redis_url: str,
        model: str,
        *,
        priority: str,
        in_flight: int,
        tokens: int,
        vocab: int,
        seed: int,
        min_requests: int = 0,
        max_s: float = 600.0,
        timeout_s: float = 120.0,
        tenant: str = "",
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="lmpool-bench-producer-"))
        self.stop_file = self.dir / "stop"
        self.out_file = self.dir / "out.json"
        self.args = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--redis-url", redis_url,
            "--model", model,
            "--priority", priority,
            "--in-flight", str(in_flight),
            "--tokens", str(tokens),
            "--vocab", str(vocab),
            "--seed", str(seed),
            "--min-requests", str(min_requests),
            "--max-s", str(max_s),
            "--timeout-s", str(timeout_s),
            "--stop-file", str(self.stop_file),
            "--out", str(self.out_file),
            "--tenant", tenant,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Producer:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMPOOL_")}
        self.proc = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=(self.dir / "stderr").open("wb"), env=env
        )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until the process printed ``ready`` (connected to the pool)."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = b""
        while time.monotonic() < deadline and self.proc.poll() is None:
            line = self.proc.stdout.readline()
            if line.strip() == b"ready":
                return
        raise RuntimeError(f"producer not ready ({line!r}): {self.stderr_tail()}")

    def stderr_tail(self) -> str:
        try:
            return (self.dir / "stderr").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def finish(self, timeout_s: float) -> dict[str, Any]:
        """Ask it to stop, wait for it, and return its summary."""
        assert self.proc is not None
        self.stop_file.touch()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            benchkit.stop_process(self.proc, timeout_s=10)
            raise RuntimeError(f"producer did not finish in {timeout_s:g}s") from None
        if self.proc.returncode != 0 or not self.out_file.exists():
            raise RuntimeError(f"producer failed ({self.proc.returncode}): {self.stderr_tail()}")
        summary: dict[str, Any] = json.loads(self.out_file.read_text())
        return summary

    def stop(self) -> None:
        """Stop the process if it still runs (SIGTERM, then SIGKILL); for ``finally`` blocks."""
        with contextlib.suppress(OSError):
            self.stop_file.touch()
        benchkit.stop_process(self.proc, timeout_s=10)
        shutil.rmtree(self.dir, ignore_errors=True)


class Recorder:
    """What a producer records, in memory fixed at the start (so its RSS shows lmpool's own):
    completions per ``BUCKET_S`` since ``t0``, and a uniform sample of at most ``SAMPLE``
    latencies (reservoir sampling)."""

    BUCKET_S = 0.1
    SAMPLE = 20_000

    def __init__(self, max_s: float, seed: int) -> None:
        self.t0 = time.monotonic()
        self.counts = array.array("l", bytes(8 * (int(max_s / self.BUCKET_S) + 2)))
        self.sample = array.array("d", bytes(8 * self.SAMPLE))
        self.done = 0
        self.rng = random.Random(seed)

    def add(self, t_start: float, t_end: float) -> None:
        bucket = min(int((t_end - self.t0) / self.BUCKET_S), len(self.counts) - 1)
        self.counts[bucket] += 1
        if self.done < self.SAMPLE:
            self.sample[self.done] = t_end - t_start
        else:
            slot = self.rng.randrange(self.done + 1)
            if slot < self.SAMPLE:
                self.sample[slot] = t_end - t_start
        self.done += 1

    def summary(self) -> dict[str, Any]:
        return {
            "done": self.done,
            "t0": self.t0,
            "bucket_s": self.BUCKET_S,
            "counts": self.counts.tolist(),
            "latencies": self.sample[: min(self.done, self.SAMPLE)].tolist(),
        }


def completions_between(summary: dict[str, Any], t_from: float, t_to: float) -> int:
    """Completions a producer counted between two ``time.monotonic()`` times (to a bucket)."""
    t0, width = float(summary["t0"]), float(summary["bucket_s"])
    first, last = int((t_from - t0) / width), int((t_to - t0) / width)
    return sum(summary["counts"][max(first, 0) : max(last, 0)])


async def produce(args: argparse.Namespace) -> dict[str, Any]:
    from producer import RemoteLM
    from shared.errors import LMPoolError
    from shared.settings import Settings

    settings = Settings(
        redis_url=args.redis_url,
        timeout_s=args.timeout_s,
        connect_timeout_s=30,
        tenant=args.tenant,
    )
    lm = await RemoteLM.connect(
        model=args.model, cache_size=0, priority=args.priority, settings=settings
    )
    rng = random.Random(args.seed)
    errors: dict[str, int] = {}
    record = Recorder(args.max_s, args.seed)
    stop = asyncio.Event()

    def prompt() -> list[int]:
        return [rng.randrange(FIRST_ID, args.vocab) for _ in range(args.tokens)]

    async def watch() -> None:
        while not stop.is_set():
            now = time.monotonic()
            if now - record.t0 > args.max_s or (
                record.done >= args.min_requests and os.path.exists(args.stop_file)
            ):
                stop.set()
                return
            await asyncio.sleep(0.05)

    async def loop() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                await lm.next_token_logprobs(prompt())
            except LMPoolError as e:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                await asyncio.sleep(0.01)  # a failing pool: do not spin
                continue
            record.add(t0, time.monotonic())

    try:
        print("ready", flush=True)
        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(loop() for _ in range(args.in_flight)))
        await watcher
    finally:
        await lm.close()
    return {**record.summary(), "errors": errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one load-generating producer process")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--priority", choices=("high", "low"), default="high")
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-requests", type=int, default=0)
    parser.add_argument("--max-s", type=float, default=600.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tenant", default="", help="LMPOOL_TENANT (empty: none)")
    args = parser.parse_args(argv)
    with benchkit.cleanup_on_signal():
        summary = asyncio.run(produce(args))
    Path(args.out).write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
