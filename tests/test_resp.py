"""``shared.resp``: the reply parser on every split of its input, and the connection against a
real Redis (auth, database, unix socket, errors, a server that dies, timeouts, cancellation)."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from typing import Any

import numpy as np
import pytest
import redis
import torch
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from localpool.redis_server import RedisServer
from shared.codec import decode_tensor, encode_tensor
from shared.resp import BIG_BULK, RespConnection, _Protocol, pack, pack_parts, supported

BIG = bytes(random.Random(0).randbytes(BIG_BULK * 3 + 17))
WIRE = (
    b"+OK\r\n"
    b"-ERR wrong number of arguments\r\n"
    b":42\r\n"
    b"$5\r\nhello\r\n"
    b"$-1\r\n"
    b"*-1\r\n"
    b"*0\r\n"
    b"$0\r\n\r\n"
    b"*2\r\n$4\r\nlist\r\n*3\r\n:1\r\n$2\r\nab\r\n$" + str(len(BIG)).encode() + b"\r\n" + BIG
    + b"\r\n"
    b"$" + str(BIG_BULK).encode() + b"\r\n" + BIG[:BIG_BULK] + b"\r\n"
    b":-7\r\n"
)  # fmt: skip
EXPECTED: list[Any] = [
    b"OK",
    ResponseError("ERR wrong number of arguments"),
    42,
    b"hello",
    None,
    None,
    [],
    b"",
    [b"list", [1, b"ab", BIG]],
    BIG[:BIG_BULK],
    -7,
]


def same(got: list[Any], want: list[Any]) -> bool:
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        if isinstance(w, ResponseError):
            if not (isinstance(g, ResponseError) and str(g) == str(w)):
                return False
        elif isinstance(w, list):
            if not (isinstance(g, list) and same(g, w)):
                return False
        elif g != w or (w is None) != (g is None):
            return False
    return True


def parse_all(chunks: list[bytes]) -> list[Any]:
    loop = asyncio.new_event_loop()
    try:
        proto = _Protocol()
        done = loop.create_future()
        proto.done, proto.expected = done, len(EXPECTED)
        for chunk in chunks:
            while chunk:
                view = proto.get_buffer(-1)
                n = min(len(view), len(chunk))
                view[:n] = chunk[:n]
                del view
                proto.buffer_updated(n)
                chunk = chunk[n:]
        assert done.done(), "the replies did not complete"
        result: list[Any] = done.result()
        return result
    finally:
        loop.close()


@pytest.mark.parametrize("cut_every", [1, 2, 3, 7, 4096, 1 << 20])
def test_replies_parse_however_the_bytes_arrive(cut_every: int) -> None:
    chunks = [WIRE[i : i + cut_every] for i in range(0, len(WIRE), cut_every)]
    assert same(parse_all(chunks), EXPECTED)


def test_replies_parse_with_every_split_around_a_big_string() -> None:
    """Two pieces, the cut at each byte of the headers and of the end of the big string."""
    start = WIRE.index(b"$" + str(len(BIG)).encode())
    end = start + len(str(len(BIG))) + 3 + len(BIG) + 2
    for cut in [*range(start - 3, start + 12), *range(end - 6, end + 8)]:
        assert same(parse_all([WIRE[:cut], WIRE[cut:]]), EXPECTED), cut


def test_a_big_string_arrives_in_a_writable_buffer_of_its_own() -> None:
    got = parse_all([WIRE])
    big = got[8][1][2]
    assert isinstance(big, bytearray) and big == BIG
    assert isinstance(got[3], bytes)  # small strings are plain bytes


def test_an_unreadable_reply_fails_the_call() -> None:
    loop = asyncio.new_event_loop()
    try:
        proto = _Protocol()
        done = loop.create_future()
        proto.done, proto.expected = done, 1
        view = proto.get_buffer(-1)
        view[:6] = b"?what\r"
        del view
        proto.buffer_updated(6)
        assert not done.done()
        view = proto.get_buffer(-1)
        view[:1] = b"\n"
        del view
        proto.buffer_updated(1)
        assert isinstance(done.exception(), RedisConnectionError)
    finally:
        loop.close()


def test_pack_writes_resp_and_refuses_what_redis_cannot_take() -> None:
    assert pack([["GET", b"k"], ["BLMPOP", 1.5, 1, "l", "LEFT"]]) == (
        b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"
        b"*5\r\n$6\r\nBLMPOP\r\n$3\r\n1.5\r\n$1\r\n1\r\n$1\r\nl\r\n$4\r\nLEFT\r\n"
    )
    words = memoryview(b"\x01\x00\x00\x00\x02\x00\x00\x00").cast("i")  # 2 items, 8 bytes
    assert pack([["SET", bytearray(b"ab"), words]]) == (
        b"*3\r\n$3\r\nSET\r\n$2\r\nab\r\n$8\r\n\x01\x00\x00\x00\x02\x00\x00\x00\r\n"
    )
    with pytest.raises(TypeError, match="bool"):
        pack([["SET", "k", True]])
    with pytest.raises(TypeError, match="NoneType"):
        pack([["SET", "k", None]])


def test_big_arguments_are_sent_as_parts_of_their_own_uncopied() -> None:
    row, other = bytes(BIG_BULK), bytearray(BIG_BULK + 1)
    commands: list[list[Any]] = [
        ["SET", "a", row, "PX", 5],
        ["SET", "b", b"small"],
        ["SET", "c", other],
    ]
    parts = pack_parts(commands)
    assert b"".join(parts) == pack(commands)
    assert sum(p is row for p in parts) == 1 and sum(p is other for p in parts) == 1
    assert len(parts) == 5  # the runs before, between and after the two big arguments
    assert pack_parts([["GET", b"k" * (BIG_BULK - 1)]]) == [pack([["GET", b"k" * (BIG_BULK - 1)]])]


def test_a_value_in_pieces_is_one_bulk_string_its_big_pieces_uncopied() -> None:
    head, body = encode_tensor(torch.zeros(0))[:16], memoryview(bytearray(range(256)) * 400)
    value = b"".join((head, body))
    commands: list[list[Any]] = [
        ["SET", "a", (head, body)],
        ["SET", "b", (b"x", memoryview(b"yz"))],
    ]
    parts = pack_parts(commands)
    assert b"".join(parts) == pack([["SET", "a", value], ["SET", "b", b"xyz"]])
    assert sum(p is body for p in parts) == 1 and len(parts) == 3


def test_tls_urls_are_left_to_redis_py() -> None:
    assert supported("redis://h:1/0") and supported("unix:///tmp/r.sock")
    assert not supported("rediss://h:1/0")
    with pytest.raises(ValueError, match="rediss"):
        RespConnection("rediss://h:1/0")


# -- against a real Redis ---------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_pipeline_on_a_real_redis_matches_redis_py(redis_url: str) -> None:
    value = encode_tensor(torch.randn(49_152))
    r = redis.Redis.from_url(redis_url)
    r.set("resp:row", value)
    r.delete("resp:list")
    conn = RespConnection(redis_url)
    try:
        for _ in range(3):  # one connection, several pipelines
            got = await conn.execute(
                [
                    ["GET", "resp:row"],
                    ["GET", "resp:none"],
                    ["RPUSH", "resp:list", b"a", b"b"],
                    ["BLMPOP", 0.1, 1, "resp:list", "LEFT", "COUNT", 5],
                    ["BLMPOP", 0.05, 1, "resp:list", "LEFT", "COUNT", 5],
                    ["INCR", "resp:row"],
                    ["EVAL", "return {1, 'x', {2}}", 0],
                ],
                5,
            )
            assert got[0] == value and isinstance(got[0], bytearray)
            assert got[1:5] == [None, 2, [b"resp:list", [b"a", b"b"]], None]
            assert isinstance(got[5], ResponseError) and "not an integer" in str(got[5])
            assert got[6] == [1, b"x", [2]]
            row = decode_tensor(got[0])
            assert torch.equal(row, decode_tensor(value))
            assert row.numpy().base is not None  # the tensor is the received buffer itself
            assert np.shares_memory(row.numpy(), np.frombuffer(got[0], np.uint8))
    finally:
        conn.close()
        r.close()


@pytest.mark.asyncio
async def test_a_big_pipeline_leaves_piece_by_piece_and_asyncio_holds_at_most_one(
    redis_url: str,
) -> None:
    """A worker's write of 64 rows (12.5 MB) goes to the socket a piece at a time, each once
    the one before has gone: asyncio's transport, which copies what the socket does not take
    at once, never holds more than one piece (before: most of the 12.5 MB)."""
    rows = [encode_tensor(torch.full((49_152,), float(i))) for i in range(64)]
    conn = RespConnection(redis_url)
    try:
        assert await conn.execute([["PING"]], 5) == [b"PONG"]
        transport = conn._protocol.transport  # type: ignore[union-attr]
        assert transport is not None
        held: list[int] = []
        write = transport.write

        def recording(data: bytes | bytearray | memoryview) -> None:
            write(data)
            held.append(transport.get_write_buffer_size())

        transport.write = recording  # type: ignore[method-assign]
        sets = [["SET", f"resp:big:{i}", row] for i, row in enumerate(rows)]
        assert await conn.execute(sets, 10) == [b"OK"] * 64
        assert len(held) >= 64 and max(held) <= max(map(len, rows)) + 64, max(held)
        r = redis.Redis.from_url(redis_url)
        assert [r.get(f"resp:big:{i}") for i in (0, 31, 63)] == [rows[0], rows[31], rows[63]]
        r.close()
    finally:
        conn.close()


@pytest.mark.asyncio
async def test_a_write_to_a_stopped_server_times_out_and_the_next_call_reconnects() -> None:
    """A server that stops reading mid-write (stopped: the socket's buffers fill) fails the
    call at its timeout, not later; the connection is dropped (half a command was sent) and the
    next call, once the server runs again, connects anew."""
    rows = [encode_tensor(torch.randn(49_152)) for _ in range(64)]
    with RedisServer() as server:
        conn = RespConnection(server.url)
        assert await conn.execute([["PING"]], 5) == [b"PONG"]
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(RedisTimeoutError):
                await conn.execute([["SET", f"k{i}", row] for i, row in enumerate(rows)], 0.5)
            assert time.monotonic() - started < 2.0
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert await conn.execute([["SET", "k", rows[0]], ["GET", "k"]], 5) == [b"OK", rows[0]]
        conn.close()


@pytest.mark.asyncio
async def test_auth_database_and_unix_socket() -> None:
    rules = ["user alice on >secret ~* &* +@all"]
    with RedisServer(password="admin", acl_lines=rules, unix_socket=True) as server:
        admin = redis.Redis.from_url(server.url.replace("/0", "/3"))
        admin.set("where", b"db3")
        for url in (
            server.url_for("alice", "secret").replace("/0", "/3"),
            server.url.replace("/0", "/3"),
            server.unix_url.replace("db=0", "db=3"),
        ):
            conn = RespConnection(url)
            assert await conn.execute([["GET", "where"]], 5) == [b"db3"], url
            conn.close()
        wrong = RespConnection(server.url_for("alice", "wrong"))
        with pytest.raises(ResponseError, match="WRONGPASS"):
            await wrong.execute([["PING"]], 5)
        admin.close()


@pytest.mark.asyncio
async def test_a_server_that_dies_fails_the_call_and_the_next_call_reconnects() -> None:
    with RedisServer() as server:
        conn = RespConnection(server.url)
        assert await conn.execute([["PING"]], 5) == [b"PONG"]
        call = asyncio.ensure_future(conn.execute([["BLPOP", "nothing", 5]], 10))
        await asyncio.sleep(0.2)
        server.kill()
        with pytest.raises(RedisConnectionError):
            await call
        with pytest.raises(RedisConnectionError, match="connect"):
            await conn.execute([["PING"]], 5)
        server.start()
        assert await conn.execute([["PING"]], 5) == [b"PONG"]
        conn.close()


@pytest.mark.asyncio
async def test_no_reply_in_time_times_out_and_a_cancelled_call_leaves_no_stray_reply(
    redis_url: str,
) -> None:
    conn = RespConnection(redis_url)
    with pytest.raises(RedisTimeoutError):
        await conn.execute([["BLPOP", "resp:empty", 2]], 0.3)
    # cancelled while Redis holds the pop: its late reply must not answer the next call
    call = asyncio.ensure_future(conn.execute([["BLPOP", "resp:late", 0.5]], 5))
    await asyncio.sleep(0.1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    redis.Redis.from_url(redis_url).rpush("resp:late", b"x")
    assert await conn.execute([["GET", "resp:nothing"]], 5) == [None]
    assert await conn.execute([["LPOP", "resp:late"]], 5) == [b"x"]
    conn.close()


@pytest.mark.asyncio
async def test_a_write_pipeline_loads_its_script_once_and_raises_an_error_reply(
    redis_url: str,
) -> None:
    """``shared.scripts.execute_resp`` with the writer's commands: a flushed script cache costs
    one SCRIPT LOAD and a second run; an error reply is raised, as redis-py's pipeline does."""
    from shared.scripts import Script, execute_resp

    script = Script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    r: Any = redis.Redis.from_url(redis_url)
    r.delete("resp:n", "resp:s", "resp:dead")
    r.script_flush()
    r.xgroup_create("resp:s", "g", id="0", mkstream=True)
    entry = r.xadd("resp:s", {"m": b"x"})
    r.xreadgroup("g", "c", {"resp:s": ">"})

    def build(pipe: Any) -> None:
        pipe.set("resp:v", b"\x00\xff" * 40_000, px=60_000)
        script.queue(pipe, ["resp:n"], [5])
        pipe.xadd("resp:dead", {"why": "test", "size": 3}, maxlen=10, approximate=True)
        pipe.xack("resp:s", "g", entry)
        pipe.xdel("resp:s", entry)

    conn = RespConnection(redis_url)
    r.config_resetstat()
    try:
        assert (await execute_resp(conn, build, [script], 5))[1:2] == [5]
        assert (await execute_resp(conn, build, [script], 5))[1:2] == [10]
        stats: Any = r.info("commandstats")
        assert stats["cmdstat_script|load"]["calls"] == 1
        assert stats["cmdstat_evalsha"]["calls"] == 3  # NOSCRIPT, again, the second pipeline
        assert r.get("resp:v") == b"\x00\xff" * 40_000 and 0 < r.pttl("resp:v") <= 60_000
        # the first pipeline ran twice (its other commands are repeated with it)
        assert r.xlen("resp:dead") == 3 and r.xlen("resp:s") == 0
        assert r.xpending("resp:s", "g")["pending"] == 0
        with pytest.raises(ResponseError, match="WRONGTYPE"):
            await execute_resp(conn, lambda pipe: pipe.xack("resp:v", "g", entry), [], 5)
    finally:
        conn.close()
        r.close()
