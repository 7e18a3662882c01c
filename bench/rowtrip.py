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
    """A step's rows into Redis and back on one socket to the server at ``port``, timed."""

    def __init__(self, url: str, port: int) -> None:
        self.url = url
        self.trips = 0
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        self.sock.close()

    def once(self, rows: torch.Tensor) -> tuple[float, float]:
        """Seconds of the SETs (all acknowledged) and of the GETs (all received in place)."""
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
        header = bytearray(len(b"$%d\r\n" % size))
        crlf = bytearray(2)
        started = time.perf_counter()
        _send(self.sock, parts)
        _recv_exact(self.sock, memoryview(acks))
        stored = time.perf_counter()
        _send(self.sock, [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys])
        for i in range(n):
            _recv_exact(self.sock, memoryview(header))
            _recv_exact(self.sock, out[i].view(torch.uint8).numpy().data)
            _recv_exact(self.sock, memoryview(crlf))
        done = time.perf_counter()
        if acks != b"+OK\r\n" * n or not torch.equal(out, rows):
            raise RuntimeError("the rows did not come back from Redis as sent")
        return stored - started, done - stored

    def measure(self, rows: torch.Tensor, repeats: int) -> tuple[float, float, float]:
        """Medians over ``repeats`` trips of the SETs' and GETs' seconds; Redis' CPU a trip."""
        self.once(rows)  # a first trip connects Redis' client buffers
        cpu = benchkit.redis_cpu_s(self.url)
        laps = [self.once(rows) for _ in range(repeats)]
        redis_s = (benchkit.redis_cpu_s(self.url) - cpu) / repeats
        return (
            statistics.median(s for s, _ in laps),
            statistics.median(g for _, g in laps),
            redis_s,
        )
