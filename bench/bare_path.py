"""The fastest bare round trip this project can write: ``reply_paths``' path (a) on raw RESP.

The same requests (one XADD pipeline per event-loop tick), the same minimal worker
(``reply_paths.worker_main``: XREADGROUP 16, one RPUSH of the enveloped row each, XACK + XDEL,
one pipeline) and the same reply list popped with ``BLMPOP COUNT 512``; but the producer speaks
to Redis through ``shared.resp.RespConnection``, as lmpool's producer does for its hot reads:
each popped reply lands in a buffer of its own, and the row is handed over as a view into it
(no msgpack copy, no redis-py parsing). ``bench/overhead.py`` measures it beside path (a) on
redis-py and takes the faster of the two, pass by pass, as the anchor.
"""

from __future__ import annotations

import asyncio

from reply_paths import POP_COUNT, REQ_STREAM, PathClient

from shared.resp import RespConnection

TIMEOUT_S = 15.0


def split_envelope(raw: bytes | bytearray) -> tuple[str, memoryview]:
    """``(request id, row)`` of a ``msgpack`` ``[str, bin]`` envelope, the row uncopied."""
    view = memoryview(raw)
    if view[0] != 0x92:
        raise ValueError("not a two-item envelope")
    head = view[1]
    if 0xA0 <= head <= 0xBF:
        size, at = head & 0x1F, 2
    elif head == 0xD9:
        size, at = view[2], 3
    else:
        raise ValueError("request id too long")
    rid = bytes(view[at : at + size]).decode()
    at += size
    width = {0xC4: 1, 0xC5: 2, 0xC6: 4}[view[at]]
    length = int.from_bytes(view[at + 1 : at + 1 + width], "big")
    at += 1 + width
    return rid, view[at : at + length]


class RespPathClient(PathClient):
    """Path (a) with the producer's Redis traffic on two ``RespConnection``s (submissions,
    and the listener's pops)."""

    def __init__(self, url: str) -> None:
        super().__init__(url, "blmpop")
        self.submit_conn = RespConnection(url)
        self.listen_conn = RespConnection(url)

    async def flush(self) -> None:
        await asyncio.sleep(0)  # every request of this tick joins the pipeline
        batch, self.queue = self.queue, []
        self.flushing = False
        commands = [
            ["XADD", REQ_STREAM, "*", "id", rid, "to", self.reply_key, "how", b"list"]
            for rid in batch
        ]
        for reply in await self.submit_conn.execute(commands, TIMEOUT_S):
            if isinstance(reply, Exception):
                raise reply

    async def listen(self) -> None:
        pop = [["BLMPOP", 1, 1, self.reply_key, "LEFT", "COUNT", POP_COUNT]]
        while not self.closing:
            (popped,) = await self.listen_conn.execute(pop, TIMEOUT_S)
            if isinstance(popped, Exception):
                raise popped
            for raw in popped[1] if popped else []:
                rid, row = split_envelope(raw)
                fut = self.pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(row)  # type: ignore[arg-type]

    async def close(self) -> None:
        await super().close()
        await self.submit_conn.aclose()
        await self.listen_conn.aclose()
