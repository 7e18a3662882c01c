"""A worker through Redis outages longer than a moment: it waits them out once serving, and a
stop during one still ends it (``worker.app.ServingRetry``); a producer's calls, async and
blocking, ride them out too, and a Redis that stops answering fails them at their timeout."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from poolkit import WorkerProcess, mock_row, wait_until

from localpool.redis_server import RedisServer
from producer import RemoteLM
from shared.aio import OutageLog
from shared.errors import RequestTimeout
from shared.settings import Settings

V = 300
MODEL = f"mock-{V}"
pytestmark = pytest.mark.timeout(120)


@pytest.mark.asyncio
async def test_a_worker_rides_out_a_redis_restart_of_seconds(tmp_path: Path) -> None:
    """Down for 3 s (its arq connection refused, not only its streams'): the worker stays up,
    says so in its log, and serves once Redis is back (it exited 0.5 s into the outage). Each
    of its loops says the outage began and ended, once (before: a line at every try, 15 from
    the heartbeat alone, 0.2 s here)."""
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
            assert "Redis unreachable for arq's connections" in w.log()
            await wait_until(
                lambda: "Redis answers for arq's connections again after" in w.log(), 10, "its end"
            )
            await wait_until(
                lambda: "Redis answers for the heartbeat again after" in w.log(), 10, "its end"
            )
            began = re.findall(r"Redis unreachable (.+?) \(", w.log(10**6))
            assert "for the heartbeat" in began and "while reading" in began, began
            assert len(began) == len(set(began)), began  # one line a loop
        finally:
            w.stop()


def stopped_within(w: WorkerProcess, seconds: float) -> int:
    """SIGTERM ``w``: its exit status, asserted within ``seconds`` (killed if it is not)."""
    started = time.monotonic()
    try:
        code = w.terminate(timeout_s=3 * seconds)
    finally:
        if w.alive():
            w.kill()
    assert time.monotonic() - started < seconds
    return code


@pytest.mark.parametrize("down_s", [1.5, 0.0], ids=["outage-seen", "outage-unseen"])
def test_a_stop_during_an_outage_ends_the_worker(tmp_path: Path, down_s: float) -> None:
    """SIGTERM while Redis is down: the worker does not wait for Redis (it would, for good, were
    every call retried until Redis answers); it ends within seconds, with the one line that
    names the unreachable Redis. ``outage-seen``: arq's connection is already waiting between
    attempts; ``outage-unseen``: the signal comes first, and the first call that fails is the
    DEL of arq's health-check key after its main task ended (retried until Redis answered,
    before: such a worker never ended)."""
    with RedisServer() as server:
        w = WorkerProcess(server.url, tmp_path, backend="mock", mock_vocab_size=V)
        w.start().wait_ready()
        server.stop()
        time.sleep(down_s)
        assert w.alive()
        code = stopped_within(w, 10)
        assert code == 1
        assert "stopped without unregistering: cannot reach Redis at LMPOOL_REDIS_URL=" in w.log()


def test_a_stop_while_the_streams_redis_is_down_ends_the_worker(tmp_path: Path) -> None:
    """arq's queue on a Redis that answers, the streams' Redis down: SIGTERM ends the worker
    through its own shutdown, within seconds and with status 0, saying what it could not undo
    (before: the unregister's error went out through arq, and its last line named arq's
    Redis, LMPOOL_ARQ_REDIS_URL, as the one that could not be reached)."""
    with RedisServer() as arq_server:
        with RedisServer() as server:
            w = WorkerProcess(
                server.url,
                tmp_path,
                backend="mock",
                mock_vocab_size=V,
                arq_redis_url=arq_server.url,
            )
            w.start().wait_ready()
        code = stopped_within(w, 10)
        log = w.log(10**6)
        assert code == 0, log[-2000:]
        assert "could not unregister" in log and "heartbeat expires by itself" in log
        assert "LMPOOL_ARQ_REDIS_URL" not in log
        assert re.search(r"INFO lmpool\.worker\[\d+\] worker \S+ stopped", log), log[-2000:]


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


def test_an_outage_is_said_when_it_begins_every_minute_while_it_lasts_and_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    outage = OutageLog(logging.getLogger("lmpool.test"), "for the test", clock=lambda: now[0])
    error = ConnectionError("refused")
    with caplog.at_level(logging.WARNING, "lmpool.test"):
        for _ in range(30):  # a try every 2 s for 60 s: the first line only
            outage.failed(error)
            now[0] += 2.0
        outage.failed(error)  # 60 s on: the minute's line
        outage.failed(error)
        outage.answered()
        outage.answered()  # no outage: nothing
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "Redis unreachable for the test (ConnectionError('refused')); retrying",
        "Redis still unreachable for the test after 60 s and 31 tries (ConnectionError('refused'))",
        "Redis answers for the test again after 60.0 s",
    ], said
