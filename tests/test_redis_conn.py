"""The asyncio client's connection pool (``shared.redis_conn.ReadyPool``) on a real Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.asyncio.connection import AbstractConnection

from shared.redis_conn import ReadyPool, connect_redis


@pytest.mark.asyncio
async def test_commands_take_pooled_connections_without_a_read_first(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py reads under a zero timeout before handing out a pooled connection (a timer, a
    loop iteration and a cancelled read per command); the pool looks at the buffers instead."""
    reads = 0
    original = AbstractConnection.can_read_destructive

    async def counted(self: AbstractConnection) -> Any:
        nonlocal reads
        reads += 1
        return await original(self)

    monkeypatch.setattr(AbstractConnection, "can_read_destructive", counted)
    r: Any = connect_redis(redis_url)
    assert isinstance(r.connection_pool, ReadyPool)
    await r.set("ready-pool", b"v")
    for _ in range(20):
        assert await r.get("ready-pool") == b"v"
    pipe = r.pipeline(transaction=False)
    pipe.get("ready-pool").get("ready-pool")
    assert await pipe.execute() == [b"v", b"v"]
    await r.aclose()
    assert reads == 0


@pytest.mark.asyncio
async def test_a_pooled_connection_with_an_unread_reply_is_replaced(redis_url: str) -> None:
    """A connection given back with a reply still unread (which redis-py's own commands never
    do: they drop such a connection) must not answer the next command with that reply."""
    r: Any = connect_redis(redis_url)
    await r.set("ready-pool", b"stale")
    conn = await r.connection_pool.get_connection("GET")
    await conn.send_command("GET", "ready-pool")  # its reply is never read
    await asyncio.sleep(0.1)  # ...but has arrived in the connection's buffer
    await r.connection_pool.release(conn)
    assert await r.ping() is True
    assert await r.get("ready-pool") == b"stale"
    await r.aclose()
