"""The asyncio client's connection pool (``shared.redis_conn.ReadyPool``) on a real Redis, and
the whole pool on a unix socket."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch
from redis.asyncio.connection import AbstractConnection

from producer import RemoteLM
from shared.redis_conn import ReadyPool, connect_redis, connect_redis_sync
from worker import status
from worker.backends.mock import MockBackend


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


@pytest.mark.asyncio
async def test_commands_are_sent_without_a_task_each(redis_url: str) -> None:
    """With a socket timeout, redis-py sends each command in a task of its own
    (``asyncio.wait_for``); the pool's connections hand it to the transport directly."""
    r: Any = connect_redis(redis_url)
    await r.set("direct-send", b"v")  # connects first
    loop = asyncio.get_running_loop()
    created = 0

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        nonlocal created
        created += 1
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)
    try:
        for _ in range(20):
            assert await r.get("direct-send") == b"v"
        pipe = r.pipeline(transaction=False)
        pipe.set("direct-send", b"w").get("direct-send")
        assert await pipe.execute() == [True, b"w"]
    finally:
        loop.set_task_factory(None)
    await r.aclose()
    assert created == 0


@pytest.mark.asyncio
async def test_a_write_the_server_does_not_read_times_out() -> None:
    """A server that stops reading: the write waits for the socket under the socket timeout,
    then fails with redis-py's TimeoutError, and the connection is dropped."""
    from redis.asyncio import Redis
    from redis.exceptions import TimeoutError as RedisTimeoutError

    accepted: list[asyncio.StreamWriter] = []

    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(never_read, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = ReadyPool.from_url(
        f"redis://127.0.0.1:{port}", socket_timeout=0.5, lib_name=None, lib_version=None
    )
    r: Any = Redis.from_pool(pool)
    conn = await pool.get_connection("SET")
    assert conn.is_connected
    started = asyncio.get_running_loop().time()
    with pytest.raises(RedisTimeoutError, match="writing"):
        await conn.send_packed_command(conn.pack_command("SET", "k", b"x" * (64 << 20)))
    assert 0.4 < asyncio.get_running_loop().time() - started < 5
    assert not conn.is_connected
    await pool.release(conn)
    await r.aclose()
    for writer in accepted:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.mark.asyncio
async def test_a_connection_the_server_closed_is_replaced(redis_url: str) -> None:
    """The server drops the client's connection between two commands: the next command fails
    on that connection and redis-py's retry runs it on a new one."""
    r: Any = connect_redis(redis_url)
    await r.client_setname("to-be-killed")
    admin: Any = connect_redis(redis_url)
    for _ in range(3):
        assert await admin.client_kill_filter(skipme=True, _type=None, laddr=None) >= 1
        assert await r.set("direct-send", b"again") is True
        assert await r.get("direct-send") == b"again"
    await r.aclose()
    await admin.aclose()


def test_a_pool_on_a_unix_socket(
    redis_url: str, redis_server: Any, workers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``unix://`` URL, as the settings accept it, serves every client of the pool: a worker
    (arq's connection and lmpool's), a producer's calls (asyncio and blocking), a blocking
    client, the status command."""
    url = redis_server.unix_url
    assert url.startswith("unix://")
    worker = workers(url, backend="mock", mock_vocab_size=300)

    def reference(ids: list[int]) -> torch.Tensor:
        return MockBackend(300).logprobs([ids], None)[0]

    lm = asyncio.run(RemoteLM.connect(url, model="mock-300"))
    assert torch.equal(lm.next_token_logprobs_sync([1, 2, 3]), reference([1, 2, 3]))

    async def use() -> None:
        async with await RemoteLM.connect(url, model="mock-300") as again:
            assert torch.equal(await again.next_token_logprobs([4, 5]), reference([4, 5]))

    asyncio.run(use())
    asyncio.run(lm.close())
    blocking = connect_redis_sync(url)
    assert blocking.ping() is True
    blocking.close()
    assert status.main(["--redis-url", url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["models"]["mock-300"]["workers"], shown
    assert worker.proc.poll() is None
