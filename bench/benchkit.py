"""Helpers shared by the benchmark scripts: output with a header, timing loops, worker processes.

Imported as ``benchkit`` by ``bench/*.py`` (run as ``python bench/NAME.py``: the script's own
folder is first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from localpool.launch import WorkerProcess

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parent.parent


# -- output -------------------------------------------------------------------------------
class Report:
    """Prints to stdout and, with ``--out``, to a file headed by the command and the date.

    ``append``: add this run after what the file holds (one file for repeated runs).
    """

    def __init__(self, out: str | None, append: bool = False) -> None:
        self._file: TextIO | None = None
        if out:
            path = Path(out)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a" if append else "w")
            if append and path.stat().st_size:
                self._file.write("\n")
        self.line("$ " + command_line())
        self.line(f"# date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
        self.line(f"# host: {platform.node()}, {os.cpu_count()} CPUs, load {load_average()}")

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        if self._file is not None:
            self._file.write(text + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def output_args(parser: argparse.ArgumentParser) -> None:
    """``--out FILE`` (the report also goes there) and ``--append`` (add to it)."""
    parser.add_argument("--out", help="also write the output to this file")
    parser.add_argument("--append", action="store_true", help="append to --out, not replace")


def cache_args(parser: argparse.ArgumentParser) -> None:
    """``--maxmemory-mb`` (Redis' cap, ``volatile-lru``; 0: none) and ``--result-ttl-s`` (how
    long results are kept while the cache grows)."""
    parser.add_argument(
        "--maxmemory-mb",
        type=int,
        default=512,
        help="Redis' memory cap (volatile-lru), filled before measuring; 0: an unbounded cache",
    )
    parser.add_argument(
        "--result-ttl-s", type=int, default=2, help="results' lifetime in an unbounded cache"
    )


def redis_placement_args(parser: argparse.ArgumentParser) -> None:
    """``--pin-redis`` and ``--unix-socket`` (for a bench whose Redis ``cache_redis`` starts)."""
    parser.add_argument(
        "--unix-socket",
        action="store_true",
        help="the pool's clients reach Redis on a unix socket (unix://), as on a single host",
    )
    parser.add_argument(
        "--pin-redis",
        action="store_true",
        help="Redis on a core of its own (the first this process may use), this process and "
        "the workers it starts on the others, as where Redis has a host or a core to itself",
    )


def pin_redis(pid: int) -> str:
    """Redis (``pid``) on the first core this process may use, the calling thread (and the
    processes it starts from now on) on the others; what was done, for the report."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--pin-redis needs 2 cores or more")
    os.sched_setaffinity(pid, {cores[0]})
    os.sched_setaffinity(0, set(cores[1:]))
    return f"Redis on core {cores[0]}, this process and its workers on {cores[1:]}"


@contextlib.contextmanager
def cache_redis(args: Any, report: Report, row_bytes: int) -> Iterator[tuple[Any, dict[str, Any]]]:
    """A private Redis as ``cache_args`` chose it: capped (``volatile-lru``) and filled first
    with expiring values of ``row_bytes``, so the shared cache is at its steady state, or
    unbounded. Yields the server and the worker settings that go with it; reports the choice."""
    from localpool.redis_server import RedisServer

    unix = getattr(args, "unix_socket", False)
    with RedisServer(
        maxmemory_mb=args.maxmemory_mb, maxmemory_policy="volatile-lru", unix_socket=unix
    ) as server:
        report.line(f"# redis: {describe_binary(server.binary)}, started with {malloc_note()}")
        if unix:
            report.line(f"# the pool's clients on Redis' unix socket: {server.unix_url}")
        if getattr(args, "pin_redis", False):
            assert server.proc is not None
            report.line(f"# pinned: {pin_redis(server.proc.pid)}")
        if args.maxmemory_mb > 0:
            filled = fill_cache(server.url, row_bytes)
            report.line(
                f"# cache: maxmemory {args.maxmemory_mb} MB, volatile-lru, filled with {filled} "
                "expiring rows first; results kept the default LMPOOL_RESULT_TTL_S"
            )
            yield server, {}
        else:
            report.line(
                f"# cache: unbounded, growing; results kept {args.result_ttl_s} s "
                "(LMPOOL_RESULT_TTL_S)"
            )
            # results of distinct prompts pile up at a row each
            yield server, {"result_ttl_s": args.result_ttl_s}


def describe_binary(binary: str) -> str:
    """``binary`` and what its ``--version`` says of itself (version, malloc: libc or jemalloc)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{binary} ({e})"
    words = dict(w.split("=", 1) for w in out.stdout.split() if "=" in w)
    return f"{binary} (v={words.get('v', '?')}, malloc={words.get('malloc', '?')})"


def malloc_note() -> str:
    """The ``GLIBC_TUNABLES`` a Redis this package starts runs with (``shared.heap``)."""
    try:
        from shared.heap import server_environment
    except ImportError:  # older code, run by this script: it started Redis as it was
        return "the environment as it is (older code)"
    return f"GLIBC_TUNABLES={server_environment()['GLIBC_TUNABLES']}"


def fill_cache(url: str, value_bytes: int) -> int:
    """Fill a capped Redis with expiring values of ``value_bytes`` until it evicts (they go
    first, being the least recently used); returns how many were written."""
    from localpool.redis_server import fill_until_evicting

    return fill_until_evicting(url, value_bytes, "bench:fill")


def command_line() -> str:
    """The command that started this script, as typed from the repository root."""
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(REPO)
    return shlex.join(["python", str(script), *sys.argv[1:]])


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


# -- measurements -------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def draw(rows: torch.Tensor, gen: torch.Generator) -> list[int]:
    """One token per row of log-probs ``[N, V]`` by inverse CDF, batched (the SMC benches).

    ``torch.multinomial`` over 64 rows of 49,152 took 63 ms on this machine's CPU, as long as
    the whole bare step of the tiny model: with it, the sampler would set the pace of both
    sides of a comparison and hide what differs between them.
    """
    import torch

    cdf = rows.float().exp().cumsum(-1)
    u = torch.rand((rows.shape[0], 1), generator=gen) * cdf[:, -1:]
    return torch.searchsorted(cdf, u)[:, 0].clamp(max=rows.shape[1] - 1).tolist()


@dataclass
class Cell:
    """One closed-loop measurement: completions in the window and the latencies of them."""

    done: int
    seconds: float
    latencies: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0

    def p(self, q: float) -> float:
        """Latency percentile in milliseconds."""
        return 1000 * percentile(self.latencies, q)


async def closed_loop(
    call: Callable[[], Awaitable[object]],
    in_flight: int,
    warm_s: float,
    run_s: float,
    grace_s: float = 60.0,
) -> Cell:
    """``in_flight`` loops each awaiting ``call()`` back to back for ``warm_s + run_s`` seconds.

    Counts the calls that complete inside the measuring window (after the warm-up) and keeps
    the latency of those that also started inside it. No loop starts a call after the window.
    """
    t0 = time.perf_counter() + warm_s
    t_end = t0 + run_s
    latencies: list[float] = []
    done = 0

    async def one() -> None:
        nonlocal done
        while (start := time.perf_counter()) < t_end:
            await call()
            end = time.perf_counter()
            if t0 <= end <= t_end:
                done += 1
                if start >= t0:
                    latencies.append(end - start)

    await asyncio.wait_for(
        asyncio.gather(*(one() for _ in range(in_flight))), warm_s + run_s + grace_s
    )
    return Cell(done, run_s, latencies)


# -- worker processes ---------------------------------------------------------------------
class Worker(WorkerProcess):
    """``localpool.launch.WorkerProcess``, logging to a new temporary folder, stopped with 20 s
    of grace: ``Worker(url, extra_env={"OMP_NUM_THREADS": "1"}, backend="mock").start()``."""

    def __init__(self, redis_url: str, extra_env: dict[str, str] | None = None, **settings: Any):
        log_dir = Path(tempfile.mkdtemp(prefix="lmpool-bench-"))
        super().__init__(
            redis_url, log_path=log_dir / "worker.log", extra_env=extra_env, **settings
        )

    def log_tail(self, chars: int = 4000) -> str:
        return self.log(chars)

    def stop(self, timeout_s: float = 20.0) -> None:
        super().stop(timeout_s)


@contextlib.contextmanager
def py_spy(pid: int, out: Path, rate: int = 200) -> Iterator[None]:
    """``py-spy record`` of process ``pid`` while the block runs (folded stacks in ``out``,
    busy samples only: blocking waits do not count)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    argv = [exe, "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate)]
    spy = subprocess.Popen(
        [*argv, "--output", str(out), "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)  # attached before the block starts
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
        try:
            spy.wait(timeout=60)
        except subprocess.TimeoutExpired:
            spy.kill()


def child_json(argv: list[str], **kwargs: Any) -> Any:
    """Run ``argv`` (a bench script's side in a process of its own: its memory and C heap its
    own), checked, and return the JSON of the last line it printed."""
    done = subprocess.run(argv, check=True, capture_output=True, text=True, **kwargs)
    return json.loads(done.stdout.strip().splitlines()[-1])


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_wait_s(pid: int | None = None) -> float:
    """Seconds the threads of process ``pid`` (default: this one) have spent ready to run but
    waiting for a core (the run queue's delay, ``/proc/PID/task/*/schedstat``), threads that
    ended excluded: what several busy processes on too few cores cost each other."""
    total = 0
    for task in Path(f"/proc/{pid or os.getpid()}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def redis_pid(url: str) -> int:
    """Process id of the Redis server at ``url``."""
    import redis

    with redis.Redis.from_url(url) as r:
        info: Any = r.info("server")
    return int(info["process_id"])


def process_faults(pid: int | None = None) -> int:
    """Minor page faults process ``pid`` (default: this one) has taken so far: fresh pages
    touched, which a heap that keeps its freed memory avoids (``shared.heap``)."""
    fields = Path(f"/proc/{pid or os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])


def kv_totals(url: str) -> dict[str, int]:
    """Sum of the KV counters in every live worker's heartbeat (``P:worker:W``'s ``kv``)."""
    import json

    import redis

    from shared.keys import Keys

    r = redis.Redis.from_url(url)
    totals: dict[str, int] = {}
    for key in r.scan_iter(Keys().worker_pattern()):
        raw = r.hget(key, "kv")
        counters: dict[str, int] = json.loads(raw) if isinstance(raw, bytes) else {}
        for k, v in counters.items():
            totals[k] = totals.get(k, 0) + int(v)
    r.close()
    return totals


def redis_cpu_s(url: str) -> float:
    """CPU seconds the Redis server at ``url`` has used so far (its main thread and others)."""
    import redis

    with redis.Redis.from_url(url) as r:
        info: Any = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def commandstats(r: Any) -> dict[str, tuple[int, float]]:
    """Redis' ``INFO commandstats``: command -> (calls, microseconds) since the last reset."""
    info: Any = r.info("commandstats")
    return {k.removeprefix("cmdstat_"): (v["calls"], v["usec"]) for k, v in info.items()}


def folded_shares(path: Path, top: int, inclusive: bool = False) -> list[tuple[str, float]]:
    """Frames of py-spy's folded stacks by share of samples: the leaf frame of each stack
    (own time), or with ``inclusive`` every frame on it (time spent in it and below)."""
    frames: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        names = stack.split(";")
        for frame in set(names) if inclusive else names[-1:]:
            frames[frame] += n
    return [(frame, n / max(total, 1)) for frame, n in frames.most_common(top)]


def stop_process(proc: subprocess.Popen[bytes] | None, timeout_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; only the given process."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def device_name(device: str) -> str:
    """`` (the GPU's name)`` for ``cuda``, empty otherwise: for report headers."""
    import torch

    return f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""


def model_dir() -> Path:
    """The HF directory both sides load: the converted default GGUF, or LMPOOL_MODEL's folder."""
    from shared.settings import Settings
    from worker.model_files import converted_gguf, resolve_model

    settings = Settings.from_env()
    source = resolve_model(settings.model)
    return converted_gguf(source, Path(settings.cache_dir)) if source.is_file() else source


def genlm_transformer(
    path: Path, device: str, dtype: str, batch_size: int, quantization: str = "none"
) -> Any:
    """genlm-backend's ``AsyncTransformer`` over the files a worker loads, with the worker's
    device, dtype and bitsandbytes options: the in-process anchor of the benchmarks."""
    import torch
    from genlm.backend.llm import AsyncTransformer
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from worker.backends.hf import quantization_kwargs

    hf_logging.disable_progress_bar()
    torch_dtype = getattr(torch, dtype)
    quantized = quantization_kwargs(quantization, torch.device(device), torch_dtype)
    # Any: mypy reads PreTrainedModel.to (a functools.wraps wrapper) as an unbound function
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, **quantized)
    if not quantized:
        model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return AsyncTransformer(model.eval(), tokenizer, batch_size=batch_size)


async def mock_pool(
    url: str,
    vocab: int,
    name: str,
    extra_env: dict[str, str] | None = None,
    producer: dict[str, Any] | None = None,
    **settings: Any,
) -> tuple[Worker, Any]:
    """A mock worker of ``vocab`` serving ``name`` as the overhead benchmarks run it (one torch
    thread, ``OMP_NUM_THREADS=1``, warnings only; ``settings`` add to that), started, and a
    ``RemoteLM`` connected to it (``producer``: its own settings). The worker is stopped if the
    connect fails."""
    worker = Worker(
        url,
        extra_env={"OMP_NUM_THREADS": "1", **(extra_env or {})},
        backend="mock",
        mock_vocab_size=vocab,
        model_name=name,
        torch_threads=1,
        log_level="WARNING",
        **settings,
    ).start()
    try:
        return worker, await connect_remote_lm(worker, url, name, 120, 60, **(producer or {}))
    except BaseException:
        worker.stop()
        raise


async def connect_remote_lm(
    worker: Worker,
    redis_url: str,
    model: str,
    timeout_s: float,
    request_timeout_s: float,
    **more: Any,
) -> Any:
    """``RemoteLM`` of ``model`` once ``worker`` serves it (``more``: other settings); fails
    early if the worker dies."""
    from producer import RemoteLM
    from shared.errors import NoWorker
    from shared.settings import Settings

    settings = Settings(
        redis_url=redis_url, timeout_s=request_timeout_s, connect_timeout_s=2.0, **more
    )
    deadline = time.monotonic() + timeout_s
    said = logging.getLogger("lmpool.producer")
    once = _SayOnce("LMPOOL_CONNECT_TIMEOUT_S")  # the wait's warning once, not every 2 s
    said.addFilter(once)
    try:
        while True:
            if not worker.alive():
                raise RuntimeError(f"worker exited at start:\n{worker.log_tail()}")
            try:
                return await RemoteLM.connect(model=model, cache_size=0, settings=settings)
            except NoWorker:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"worker not ready after {timeout_s:g}s:\n{worker.log_tail()}"
                    ) from None
    finally:
        said.removeFilter(once)


class _SayOnce(logging.Filter):
    """Lets the first record whose message holds ``mark`` through, and drops the others."""

    def __init__(self, mark: str) -> None:
        super().__init__()
        self.mark, self.seen = mark, False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.mark not in str(record.msg):
            return True
        seen, self.seen = self.seen, True
        return not seen


def run_reported(
    run: Callable[[Any, Report], Coroutine[Any, Any, None]],
    args: Any,
    header: tuple[str, ...] = (),
) -> int:
    """``asyncio.run(run(args, report))`` with the report headed, closed, and SIGTERM turned
    into cleanup; the ``main`` of every benchmark script."""
    return run_reported_sync(lambda a, r: asyncio.run(run(a, r)), args, header)


def run_reported_sync(
    run: Callable[[Any, Report], None], args: Any, header: tuple[str, ...] = ()
) -> int:
    """:func:`run_reported` for a ``run`` that is not a coroutine."""
    report = Report(args.out, getattr(args, "append", False))
    for line in header:
        report.line(line)
    try:
        with cleanup_on_signal():
            run(args, report)
    finally:
        report.close()
    return 0


@contextlib.contextmanager
def cleanup_on_signal() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so ``finally`` blocks stop what was started."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
