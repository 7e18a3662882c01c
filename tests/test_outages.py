"""A worker through Redis outages longer than a moment: it waits them out once serving, and a
stop during one still ends it (``worker.app.ServingRetry``); a producer's calls, async and
blocking, ride them out too, and a Redis that stops answering fails them at their timeout."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from poolkit import WorkerProcess, mock_row, wait_until

from localpool.redis_server import RedisServer
from producer import RemoteLM
from shared.errors import RequestTimeout
from shared.settings import Settings

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


@pytest.mark.asyncio
async def test_calls_of_a_tenant_ride_out_a_redis_restart(tmp_path: Path) -> None:
    """Redis restarted (with its data) while blocking calls wait for their rows, and async and
    blocking calls made while it is down, by a tenant (whose calls ask its quota first): every
    call gets its row once Redis is back (before: a blocking call, or any call of a tenant,
    failed with redis-py's ConnectionError at once)."""
    with RedisServer(appendonly=True) as server:
        w = WorkerProcess(
            server.url, tmp_path, backend="mock", mock_vocab_size=V, mock_delay_ms=300
        )
        w.start().wait_ready()
        settings = Settings(redis_url=server.url, resend_s=1.0)
        try:
            async with await RemoteLM.connect(
                server.url, model=MODEL, timeout_s=20, settings=settings, tenant="alice"
            ) as lm:
                assert torch.equal(await lm.next_token_logprobs([1, 2]), mock_row(V, [1, 2]))
                batch = [[5, i] for i in range(4)]
                calls = [
                    asyncio.create_task(asyncio.to_thread(lm.next_token_logprobs_sync, [3, 4])),
                    asyncio.create_task(
                        asyncio.to_thread(lm.batch_next_token_logprobs_sync, batch)
                    ),
                ]
                await asyncio.sleep(0.1)  # sent: the worker computes them (300 ms)
                server.stop()
                await asyncio.sleep(1.2)  # the tenant's quota is asked again by the next call
                down = [[6, 7], [8], [9, 1, 2]]
                calls.append(asyncio.create_task(lm.next_token_logprobs(down[0])))
                calls.append(asyncio.create_task(lm.batch_next_token_logprobs(down[1:])))
                calls.append(
                    asyncio.create_task(asyncio.to_thread(lm.next_token_logprobs_sync, [6]))
                )
                await asyncio.sleep(0.5)
                server.start()
                one, rows, alone, more, blocking = await asyncio.gather(*calls)
            assert torch.equal(one, mock_row(V, [3, 4]))
            assert all(torch.equal(r, mock_row(V, ids)) for r, ids in zip(rows, batch, strict=True))
            assert torch.equal(alone, mock_row(V, down[0]))
            assert all(torch.equal(r, mock_row(V, i)) for r, i in zip(more, down[1:], strict=True))
            assert torch.equal(blocking, mock_row(V, [6]))
        finally:
            w.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("blocking", [False, True], ids=["async", "blocking"])
async def test_a_call_to_a_redis_that_stopped_answering_times_out_on_time(
    tmp_path: Path, blocking: bool
) -> None:
    """Redis frozen (SIGSTOP: connections neither answered nor reset, as of a host gone without
    a reset): a call with a 1 s timeout raises RequestTimeout within about a second more
    (before: it waited until Redis answered again, here 10 s, for good were it gone), and the
    pool serves once Redis answers again."""
    with RedisServer() as server:
        w = WorkerProcess(server.url, tmp_path, backend="mock", mock_vocab_size=V)
        w.start().wait_ready()
        assert server.proc is not None
        pid = server.proc.pid
        try:
            async with await RemoteLM.connect(server.url, model=MODEL, timeout_s=1) as lm:
                assert torch.equal(await lm.next_token_logprobs([1, 2]), mock_row(V, [1, 2]))
                os.kill(pid, signal.SIGSTOP)
                thaw = asyncio.get_running_loop().call_later(10, os.kill, pid, signal.SIGCONT)
                started = time.monotonic()
                try:
                    with pytest.raises(RequestTimeout):
                        if blocking:
                            await asyncio.to_thread(lm.next_token_logprobs_sync, [3, 4])
                        else:
                            await lm.next_token_logprobs([3, 4])
                    elapsed = time.monotonic() - started
                finally:
                    thaw.cancel()
                    os.kill(pid, signal.SIGCONT)
                assert elapsed < 3.5, elapsed
                row = await lm.next_token_logprobs([3, 5])
                assert torch.equal(row, mock_row(V, [3, 5]))
        finally:
            w.stop()
