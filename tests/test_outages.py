"""A worker through Redis outages longer than a moment: it waits them out once serving, and a
stop during one still ends it (``worker.app.ServingRetry``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from poolkit import WorkerProcess, mock_row, wait_until

from localpool.redis_server import RedisServer
from producer import RemoteLM

V = 300
MODEL = f"mock-{V}"
pytestmark = pytest.mark.timeout(120)


@pytest.mark.asyncio
async def test_a_worker_rides_out_a_redis_restart_of_seconds(tmp_path: Path) -> None:
    """Down for 3 s (its arq connection refused, not only its streams'): the worker stays up,
    says so in its log, and serves once Redis is back (it exited 0.5 s into the outage)."""
    with RedisServer(appendonly=True) as server:
        w = WorkerProcess(server.url, tmp_path, backend="mock", mock_vocab_size=V)
        w.start().wait_ready()
        try:
            server.stop()
            await asyncio.sleep(3)
            alive = w.alive()
            server.start()
            assert alive, f"exited with {w.proc and w.proc.returncode}: {w.log()[-400:]}"
            async with await RemoteLM.connect(server.url, model=MODEL, connect_timeout_s=10) as lm:
                row = await lm.next_token_logprobs([1, 2])
            assert torch.equal(row, mock_row(V, [1, 2]))
            assert "arq's connection to Redis failed" in w.log()
            await wait_until(lambda: "connection to Redis is back" in w.log(), 10, "the end line")
        finally:
            w.stop()


def test_a_stop_during_an_outage_ends_the_worker(tmp_path: Path) -> None:
    """SIGTERM while Redis is down: the worker does not wait for Redis (it would, for good, were
    every call retried until Redis answers); it ends within seconds, with the one line that
    names the unreachable Redis."""
    with RedisServer() as server:
        w = WorkerProcess(server.url, tmp_path, backend="mock", mock_vocab_size=V)
        w.start().wait_ready()
        server.stop()
        time.sleep(1.5)  # the outage has begun for arq's connection too
        assert w.alive()
        started = time.monotonic()
        try:
            code = w.terminate(timeout_s=30)
        finally:
            if w.alive():
                w.kill()
        assert time.monotonic() - started < 10
        assert code == 1
        assert "cannot reach Redis at LMPOOL_REDIS_URL=" in w.log()
