"""Starting a worker process: the one launcher of the tests, the benchmarks and the demo.

``WorkerProcess(url, backend="mock", mock_vocab_size=1000).start().wait_ready()`` runs
``python -m arq worker.WorkerSettings`` with ``LMPOOL_REDIS_URL=url``, ``LMPOOL_BACKEND=mock``
and ``LMPOOL_MOCK_VOCAB_SIZE=1000``. Every other ``LMPOOL_`` variable of this process's
environment is dropped, so a setting exported in the shell never leaks into a test or a
measurement; the worker validates what it is given (a misspelled setting stops it at start,
and :meth:`WorkerProcess.wait_ready` fails with its log).

Readiness and counters are read from the worker's heartbeat hash (``shared.keys.Keys``), with
``shared.redis_conn.connect_redis_sync``: on a single Redis and on a Redis Cluster alike.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from shared.keys import Keys
from shared.redis_conn import connect_redis_sync
from shared.settings import ENV_PREFIX

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's from Python 3.11; lmpool runs on 3.10

SOURCE_ROOT = Path(__file__).resolve().parent.parent
"""The folder that holds the ``worker`` package: the worker's working directory, so that
``worker.WorkerSettings`` imports from this source tree."""


class WorkerProcess:
    """``arq worker.WorkerSettings`` in a subprocess, its settings given as keyword arguments.

    Args:
        redis_url: ``LMPOOL_REDIS_URL``.
        log_dir: folder of the log file (created; a new temporary folder when None). The log
            holds the worker's stdout and stderr.
        log_path: the log file itself (overrides ``log_dir``).
        extra_env: other variables (``OMP_NUM_THREADS``), set last: they may override.
        **settings: ``LMPOOL_<NAME>`` for each ``name=value`` (``str(value)``).
    """

    def __init__(
        self,
        redis_url: str,
        log_dir: Path | str | None = None,
        *,
        log_path: Path | str | None = None,
        extra_env: dict[str, str] | None = None,
        **settings: Any,
    ) -> None:
        self.redis_url = redis_url
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        env[f"{ENV_PREFIX}REDIS_URL"] = redis_url
        env.update({f"{ENV_PREFIX}{k.upper()}": str(v) for k, v in settings.items()})
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra_env or {})
        self.env = env
        prefix = env.get(f"{ENV_PREFIX}KEY_PREFIX")
        self.keys = Keys(prefix) if prefix else Keys()
        if log_path is None:
            folder = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="lmpool-worker-"))
            folder.mkdir(parents=True, exist_ok=True)
            log_path = folder / f"worker-{time.monotonic_ns()}.log"
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> Self:
        """Start the process (returns at once: :meth:`wait_ready` waits for it to serve)."""
        with self.log_path.open("wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "arq", "worker.WorkerSettings"],
                env=self.env,
                cwd=SOURCE_ROOT,
                stdout=log,
                stderr=log,
            )
        return self

    def wait_ready(self, timeout_s: float = 120) -> Self:
        """Wait until the worker's heartbeat hash appears.

        Raises:
            RuntimeError: the process exited first (its log in the message).
            TimeoutError: no heartbeat after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker exited at start:\n{self.log()}")
            if self.worker_ids():
                return self
            time.sleep(0.05)
        raise TimeoutError(f"worker not ready after {timeout_s}s:\n{self.log()}")

    def terminate(self, timeout_s: float = 30) -> int:
        """SIGTERM and wait (the graceful shutdown path); returns the exit code.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout_s``.
        """
        assert self.proc is not None, "not started"
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout_s: float = 15) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; nothing when not running."""
        if self.alive():
            try:
                self.terminate(timeout_s=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- state ---------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def alive(self) -> bool:
        """Started and not exited."""
        return self.proc is not None and self.proc.poll() is None

    def log(self, chars: int = 5000) -> str:
        """The last ``chars`` characters of the worker's output ("" before there is any)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def worker_ids(self) -> list[str]:
        """The ids of the heartbeat hashes this process publishes (one per served model)."""
        r = connect_redis_sync(self.redis_url)
        try:
            return self._worker_ids(r)
        finally:
            r.close()

    def _worker_ids(self, r: Any) -> list[str]:
        ids = []
        for key in r.scan_iter(self.keys.worker_pattern()):
            pid = r.hget(key, "pid")
            if pid is not None and json.loads(pid) == self.pid:
                ids.append(self.keys.worker_id_of(key))
        return ids

    def info(self) -> dict[str, Any]:
        """This worker's heartbeat hash (its counters), decoded; empty before the first."""
        r = connect_redis_sync(self.redis_url)
        try:
            for wid in self._worker_ids(r):
                raw = r.hgetall(self.keys.worker(wid))
                return {k.decode(): json.loads(v) for k, v in raw.items()}
            return {}
        finally:
            r.close()

    async def wait_counter(self, name: str, at_least: int, timeout_s: float = 10) -> int:
        """Wait until this worker's heartbeat reports ``name >= at_least``; returns the value
        (the last one read when ``timeout_s`` passes first)."""
        deadline = time.monotonic() + timeout_s
        value = 0
        while time.monotonic() < deadline:
            value = int(self.info().get(name, 0))
            if value >= at_least:
                return value
            await asyncio.sleep(0.05)
        return value
