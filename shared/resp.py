"""A minimal Redis connection for one hot pipeline: replies read straight into their buffers.

redis-py's asyncio client copies a reply five times on its way to the caller (the socket's
bytes, the stream reader's buffer, the chunk it reads, the hiredis buffer, the reply's bytes):
for a 196 KB vocabulary row, ~100 us of CPU per request (``bench/floor.py``). This connection
is an ``asyncio.BufferedProtocol``: the kernel writes what arrives into this object's buffer,
and a bulk string of at least ``BIG_BULK`` bytes straight into a ``bytearray`` of its own,
which the caller owns and decodes without a copy (``shared.codec.decode_tensor``).

It speaks RESP2 for commands that lmpool pipelines (script calls, pops, GET): replies come
back as ``bytes`` (``bytearray`` when big), ``int``, ``list`` or ``None``, and an error reply
as a ``ResponseError`` in its place, as redis-py's ``pipeline.execute(raise_on_error=False)``
gives them. Plain TCP and unix sockets, with the URL's user, password and database; TLS URLs
are left to redis-py (:func:`supported`). A lost connection or a timeout closes it and raises
redis-py's ``ConnectionError`` / ``TimeoutError`` (``shared.redis_conn.TRANSIENT``); the next
call connects again.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlparse

from redis.exceptions import BusyLoadingError, OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.aio import wait_event

BIG_BULK = 1 << 16
"""Bulk strings at least this long are received into a buffer of their own, and sent
uncopied (``pack_parts``)."""
READ_ROOM = 1 << 16
"""Free space offered to each socket read of everything else."""
CONNECT_TIMEOUT_S = 5.0


def supported(url: str) -> bool:
    """Whether this connection can serve ``url`` (``redis://`` or ``unix://``; not TLS)."""
    return urlparse(url).scheme in ("redis", "unix")


def pack(commands: Sequence[Sequence[Any]]) -> bytes:
    """The commands in RESP (bulk strings of their arguments: bytes, str, int or float)."""
    return b"".join(pack_parts(commands))


Piece = bytes | bytearray | memoryview


def pack_parts(commands: Sequence[Sequence[Any]]) -> list[Piece]:
    """:func:`pack` in pieces: arguments of ``BIG_BULK`` or more stand alone, uncopied,
    between the joined runs of everything else (a worker's 64 rows are 12.5 MB: one join would
    copy them all once more before the socket). An argument may itself come in pieces, a tuple
    of bytes and byte-format memoryviews (``shared.protocol.Encoded``): one bulk string."""
    parts: list[Piece] = []
    run: list[Piece] = []
    for args in commands:
        run.append(b"*%d\r\n" % len(args))
        for arg in args:
            pieces = arg if isinstance(arg, tuple) else (_bulk(arg),)
            run.append(b"$%d\r\n" % sum(len(piece) for piece in pieces))
            for piece in pieces:
                if len(piece) >= BIG_BULK:
                    parts += [b"".join(run), piece]
                    run = []
                else:
                    run.append(piece)  # the join below is its only copy
            run.append(b"\r\n")
    parts.append(b"".join(run))
    return parts


def _bulk(arg: Any) -> Piece:
    """One argument's bytes (bytes, str, int or float)."""
    if isinstance(arg, (bytes, bytearray)):
        return arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, bool):
        raise TypeError("cannot send a bool to Redis: send an int or a string")
    if isinstance(arg, (int, float)):
        return repr(arg).encode()
    if isinstance(arg, memoryview):
        return arg.tobytes()  # its length in bytes, whatever its format
    raise TypeError(f"cannot send {type(arg).__name__} to Redis")


class Loading(ResponseError, BusyLoadingError):
    """``LOADING``: a restarted Redis still reading its data. An error reply like any other
    (in its place among the replies), and, raised, transient as redis-py's ``BusyLoadingError``
    is (``shared.redis_conn.TRANSIENT``): loops wait and try again."""


def error_reply(message: str) -> ResponseError:
    """The exception for an error reply, of redis-py's class for the states a server passes
    through (loading its data, a replica before its promotion, full: ``OOM``), whole message
    kept."""
    code = message.partition(" ")[0]
    if code == "LOADING":
        return Loading(message)
    if code == "READONLY":
        return ReadOnlyError(message)
    if code == "OOM":
        return OutOfMemoryError(message)
    return ResponseError(message)


class _Protocol(asyncio.BufferedProtocol):
    """Parses the replies of the commands in flight as they arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray(READ_ROOM)
        self.start = 0
        """Where unparsed data begins in ``buf``."""
        self.end = 0
        """Where it ends."""
        self.big: bytearray | None = None
        """The big bulk string being received, if any."""
        self.big_filled = 0
        self.crlf_due = False
        """The CRLF after a big bulk string is still to be skipped."""
        self.stack: list[tuple[int, list[Any]]] = []
        """Arrays being filled: (their length, what they hold so far)."""
        self.replies: list[Any] = []
        self.expected = 0
        self.done: asyncio.Future[list[Any]] | None = None
        self.lost: BaseException | None = None
        self.closed = asyncio.Event()
        """Set once the socket is closed."""
        self.writable = asyncio.Event()
        """Clear while the transport holds unsent data (``write``)."""
        self.writable.set()

    # -- asyncio's side ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        # paused as soon as anything waits unsent: see ``write``
        transport.set_write_buffer_limits(high=0, low=0)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    async def write(self, pieces: list[Piece]) -> None:
        """Each piece to the socket once the one before has gone: asyncio's transport copies
        what the socket does not take at once into a buffer of its own (before Python 3.12),
        which for a worker's 12.5 MB of rows would be most of them."""
        assert self.transport is not None
        for piece in pieces:
            if not self.writable.is_set():
                await self.writable.wait()
            if self.lost is not None:
                raise self.lost
            self.transport.write(piece)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = RedisConnectionError(f"connection to Redis lost: {exc!r}")
        self.closed.set()
        self.writable.set()
        self._finish(self.lost)

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.big is not None:
            return memoryview(self.big)[self.big_filled :]
        if self.start == self.end:
            self.start = self.end = 0
        elif len(self.buf) - self.end < READ_ROOM:
            kept = self.end - self.start
            self.buf[:kept] = self.buf[self.start : self.end]
            self.start, self.end = 0, kept
        if len(self.buf) - self.end < READ_ROOM:
            self.buf.extend(bytes(READ_ROOM))
        return memoryview(self.buf)[self.end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.big is not None:
            self.big_filled += nbytes
            if self.big_filled == len(self.big):
                value, self.big = self.big, None
                self.crlf_due = True
                self._value(value)
        else:
            self.end += nbytes
        try:
            self._parse()
        except Exception as e:  # a reply this parser cannot read: the connection is unusable
            if self.transport is not None:
                self.transport.abort()
            self._finish(RedisConnectionError(f"unreadable reply from Redis: {e!r}"))

    # -- parsing ----------------------------------------------------------------------------
    def _parse(self) -> None:
        buf = self.buf
        while self.big is None:
            if self.crlf_due:
                if self.end - self.start < 2:
                    return
                if buf[self.start : self.start + 2] != b"\r\n":
                    raise ValueError("bulk string not followed by CRLF")
                self.start += 2
                self.crlf_due = False
            eol = buf.find(b"\r\n", self.start, self.end)
            if eol < 0:
                return
            kind, line = buf[self.start], bytes(buf[self.start + 1 : eol])
            after = eol + 2
            if kind == 0x24:  # $ bulk string
                n = int(line)
                if n < 0:
                    self.start = after
                    self._value(None)
                elif n >= BIG_BULK:
                    have = min(n, self.end - after)
                    big = bytearray(n)
                    big[:have] = buf[after : after + have]
                    self.start = after + have
                    if have == n:
                        self.crlf_due = True
                        self._value(big)
                    else:
                        self.big, self.big_filled = big, have
                elif self.end - after < n + 2:
                    return  # wait for the whole string
                else:
                    self.start = after + n + 2
                    self._value(bytes(buf[after : after + n]))
            elif kind == 0x2A:  # * array
                n = int(line)
                self.start = after
                if n < 0:
                    self._value(None)
                elif n == 0:
                    self._value([])
                else:
                    self.stack.append((n, []))
            elif kind == 0x3A:  # : integer
                self.start = after
                self._value(int(line))
            elif kind == 0x2B:  # + simple string
                self.start = after
                self._value(line)
            elif kind == 0x2D:  # - error
                self.start = after
                self._value(error_reply(line.decode(errors="replace")))
            else:
                raise ValueError(f"unknown reply type {chr(kind)!r}")

    def _value(self, value: Any) -> None:
        while self.stack:
            n, items = self.stack[-1]
            items.append(value)
            if len(items) < n:
                return
            self.stack.pop()
            value = items
        self.replies.append(value)
        if len(self.replies) == self.expected:
            replies, self.replies = self.replies, []
            self._finish(replies)

    def _finish(self, outcome: list[Any] | BaseException) -> None:
        done, self.done = self.done, None
        if done is None or done.done():
            return
        if isinstance(outcome, BaseException):
            done.set_exception(outcome)
        else:
            done.set_result(outcome)


class Commands:
    """The redis-py pipeline methods lmpool's writers call, collected as commands for
    :meth:`RespConnection.execute` (same arguments, same Redis commands)."""

    def __init__(self) -> None:
        self.commands: list[list[Any]] = []

    def __len__(self) -> int:
        return len(self.commands)

    def execute_command(self, *args: Any) -> None:
        self.commands.append(list(args))

    def set(self, name: str, value: Any, px: int | None = None) -> None:
        self.commands.append(["SET", name, value, *(["PX", px] if px is not None else [])])

    def xadd(
        self,
        name: str,
        fields: dict[str, Any],
        maxlen: int | None = None,
        approximate: bool = True,
    ) -> None:
        trim = ["MAXLEN", "~" if approximate else "=", maxlen] if maxlen is not None else []
        self.commands.append(["XADD", name, *trim, "*", *(x for kv in fields.items() for x in kv)])

    def xack(self, name: str, group: str, *ids: str) -> None:
        self.commands.append(["XACK", name, group, *ids])

    def xdel(self, name: str, *ids: str) -> None:
        self.commands.append(["XDEL", name, *ids])


class RespConnection:
    """One connection to the Redis of ``url``, connected lazily (again after a failure);
    pipelines sent on it from several tasks of its event loop take turns."""

    def __init__(self, url: str) -> None:
        if not supported(url):
            raise ValueError(f"not a redis:// or unix:// URL: {url!r}")
        self.url = url
        self._protocol: _Protocol | None = None
        self._turn: asyncio.Lock | None = None

    async def _connect(self) -> _Protocol:
        parts = urlparse(self.url)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            if parts.scheme == "unix":
                _, proto = await loop.create_unix_connection(_Protocol, unquote(parts.path))
            else:
                _, proto = await loop.create_connection(
                    _Protocol, parts.hostname or "localhost", parts.port or 6379
                )
                sock = proto.transport.get_extra_info("socket") if proto.transport else None
                if sock is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self._protocol = proto
        setup: list[list[Any]] = []
        if parts.password is not None:
            user = [unquote(parts.username)] if parts.username else []
            setup.append(["AUTH", *user, unquote(parts.password)])
        db = _database(parts.path if parts.scheme == "redis" else "", parts.query)
        if db:
            setup.append(["SELECT", db])
        if setup:
            for reply in await self._run(proto, setup, CONNECT_TIMEOUT_S):
                if isinstance(reply, ResponseError):
                    self.close()
                    raise reply
        return proto

    async def execute(self, commands: Sequence[Sequence[Any]], timeout_s: float) -> list[Any]:
        """Send ``commands`` at once; their replies, in order (errors in place, not raised)."""
        if self._turn is None:
            self._turn = asyncio.Lock()
        async with self._turn:
            proto = self._protocol
            if proto is None or proto.lost is not None:
                try:
                    proto = await self._connect()
                except (OSError, TimeoutError) as e:
                    self.close()
                    raise RedisConnectionError(f"cannot connect to Redis: {e!r}") from e
            return await self._run(proto, commands, timeout_s)

    async def _run(
        self, proto: _Protocol, commands: Sequence[Sequence[Any]], timeout_s: float
    ) -> list[Any]:
        assert proto.done is None, "one pipeline at a time"
        done: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        proto.done, proto.expected = done, len(commands)
        try:
            async with asyncio.timeout(timeout_s):
                await proto.write(pack_parts(commands))
                return await done
        except TimeoutError:
            self.close()
            raise RedisTimeoutError(f"no reply from Redis within {timeout_s:g}s") from None
        except BaseException:
            self.close()  # lost, or cancelled with replies outstanding (they would come unasked)
            raise

    def close(self) -> None:
        """Drop the connection (its socket closes on the event loop's next iteration)."""
        proto, self._protocol = self._protocol, None
        if proto is not None and proto.transport is not None:
            proto.transport.abort()

    async def aclose(self) -> None:
        """Drop the connection and wait until its socket is closed."""
        proto = self._protocol
        self.close()
        if proto is not None:
            await wait_event(proto.closed, CONNECT_TIMEOUT_S)


def _database(path: str, query: str) -> int:
    """The database a URL names (its path, or ``?db=``), 0 by default."""
    for item in query.split("&"):
        key, _, value = item.partition("=")
        if key == "db" and value:
            return int(value)
    path = path.strip("/")
    return int(path) if path else 0
