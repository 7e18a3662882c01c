"""worker.stream.reader against a real Redis: what one read takes while the model is idle."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from shared.redis_conn import connect_redis
from shared.settings import Settings
from worker.stream.reader import Reader

pytestmark = pytest.mark.asyncio


class Idle:
    """The model's side as the reader sees it between two SMC steps: nothing running or
    waiting."""

    busy = False
    ready: list[Any] = []
    gathering = 0.0


async def test_an_smc_step_that_comes_together_is_taken_by_one_read(redis_url: str) -> None:
    """Interactive requests came recently, so offline work would be taken 4 at a time
    (``LMPOOL_OFFLINE_BATCH``); a step's 64 particles, added together while the reader waits,
    come back from the one read that waited for them, not the first 4 of them from it and the
    rest from a second read (XREADGROUP's COUNT holds for every stream it reads)."""
    settings = Settings(backend="mock", offline_batch=4)
    redis = connect_redis(redis_url)
    reader = Reader(redis, settings, "reader-test")
    await reader.ensure_groups()
    reads: list[int] = []
    plain = reader._xreadgroup

    async def counted(streams: list[str], count: int, block_ms: int | None = None) -> Any:
        reply = await plain(streams, count, block_ms)
        reads.append(sum(len(items) for _, items in reply or []))
        return reply

    reader._xreadgroup = counted  # type: ignore[method-assign]
    reader.note_step(interactive=True, offline_only=False)
    await asyncio.sleep(0.02)  # past the grace that holds offline work back after a step
    assert reader._offline_count(128, busy=False, backlog=False) == 4

    async def read() -> list[Any]:  # as the consumer's loop reads
        while not (entries := await reader.read(128, Idle())):
            pass
        return entries

    try:
        reading = asyncio.create_task(read())
        await asyncio.sleep(0.05)  # it looked, found nothing, and waits
        assert not reading.done()
        stream = reader.keys.stream(settings.served_model_name, "high", 0)
        pipe = redis.pipeline(transaction=True)  # as SUBMIT adds a step's particles
        for i in range(64):
            pipe.xadd(stream, {"d": f"{i:064x}", "m": b"x"})
        await pipe.execute()
        entries = await asyncio.wait_for(reading, 5)
    finally:
        await redis.aclose()
    assert len(entries) == 64
    assert [n for n in reads if n] == [64], reads
