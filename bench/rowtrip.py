"""The fastest bare round trip of an SMC step's rows through Redis, the anchor that puts a number
on what moving the rows costs any pool built on Redis (``bench/efficiency.py``).

One blocking socket, nothing else: each row ``SET`` under a new key with an expiry (as the
worker stores a result; pipelined, the row's own memory handed to ``sendmsg``, no copy in this
process), then every row ``GET`` back (pipelined) and received in place into one ``[N, V]``
tensor, the shape the caller draws from. No queue, no notification, no decoding: the bytes in
and out, as the pool must move them, and nothing more.
"""

from __future__ import annotations

import socket
import statistics
import time
from pathlib import Path

import benchkit
import torch

KEY = b"efficiency-rowtrip:%d"
"""Its keys: outside lmpool's prefix, expiring, evictable as the pool's results are."""


def _send(sock: socket.socket, parts: list[memoryview | bytes]) -> None:
    """All of ``parts``, in as few ``sendmsg`` calls as the socket takes them."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        sent = sock.sendmsg(views[:512])
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("Redis closed the connection")
        view = view[got:]


class RowTrip:
    """A step's rows into Redis and back on one socket, timed."""

    def __init__(self, url: str, port: int, unix_path: Path | None = None) -> None:
        """On the loopback ``port``, or on the unix socket at ``unix_path``."""
        self.url = url
        self.trips = 0
        if unix_path is not None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(str(unix_path))
        else:
            self.sock = socket.create_connection(("127.0.0.1", port))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        self.sock.close()

    def once(self, rows: torch.Tensor) -> tuple[float, float] | None:
        """Seconds of the SETs (all acknowledged) and of the GETs (all received in place); None
        when Redis evicted a row before its GET (the trip moved fewer bytes: not counted)."""
        rows = rows.contiguous()
        n, v = rows.shape
        size = rows.element_size() * v
        keys = [KEY % (self.trips * n + i) for i in range(n)]  # new results, as each step's
        self.trips += 1
        parts: list[memoryview | bytes] = []
        for i, key in enumerate(keys):
            parts.append(b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, size))
            parts.append(rows[i].view(torch.uint8).numpy().data)
            parts.append(b"\r\n$2\r\nEX\r\n$3\r\n600\r\n")
        acks = bytearray(5 * n)
        out = torch.empty(n, v, dtype=rows.dtype)
        expected = b"$%d\r\n" % size
        header = bytearray(len(expected))
        crlf = bytearray(2)
        started = time.perf_counter()
        _send(self.sock, parts)
        _recv_exact(self.sock, memoryview(acks))
        stored = time.perf_counter()
        if acks != b"+OK\r\n" * n:
            raise RuntimeError(f"Redis refused a SET: {bytes(acks[:200])!r}")
        _send(self.sock, [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys])
        evicted = 0
        for i in range(n):
            _recv_exact(self.sock, memoryview(header)[:5])  # a nil or an error is 5 bytes at least
            if header[:5] == b"$-1\r\n":
                evicted += 1  # a row stored just now, evicted already (a cap, LRU clocks alike)
                out[i] = rows[i]
                continue
            if header[:5] != expected[:5]:
                raise RuntimeError(f"GET of a row stored just now answered {bytes(header[:5])!r}")
            _recv_exact(self.sock, memoryview(header)[5:])
            if header != expected:
                raise RuntimeError(f"GET of a row stored just now answered {bytes(header)!r}")
            _recv_exact(self.sock, out[i].view(torch.uint8).numpy().data)
            _recv_exact(self.sock, memoryview(crlf))
        done = time.perf_counter()
        if not torch.equal(out, rows):
            raise RuntimeError("the rows did not come back from Redis as sent")
        return None if evicted else (stored - started, done - stored)

    def measure(self, rows: torch.Tensor, repeats: int) -> tuple[float, float, float]:
        """Medians over ``repeats`` trips of the SETs' and GETs' seconds; Redis' CPU a trip."""
        self.once(rows)  # a first trip connects Redis' client buffers
        cpu = benchkit.redis_cpu_s(self.url)
        trips = [self.once(rows) for _ in range(repeats)]
        redis_s = (benchkit.redis_cpu_s(self.url) - cpu) / repeats
        laps = [lap for lap in trips if lap is not None]
        if not laps:
            raise RuntimeError("Redis evicted a row of every trip before it was read back")
        return (
            statistics.median(s for s, _ in laps),
            statistics.median(g for _, g in laps),
            redis_s,
        )
