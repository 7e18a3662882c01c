"""The Redis connections of one event loop's state (``producer.loop``), opened in that loop.

- ``redis``: redis-py, for small commands, and SUBMIT calls where no ``shared.resp``
  connection serves them;
- ``listen``: redis-py with a socket timeout past the longest blocking pop, for the reply
  listener's ``BLMPOP``;
- on a single Redis without TLS, three ``shared.resp`` connections: one for the SUBMIT calls
  of each tick (packed several times cheaper than by redis-py), one for the one-round-trip
  pipeline of a lone request, one for reading results. The last two receive each row into a
  buffer of its own that becomes the caller's tensor (redis-py copies a reply five times);
  elsewhere (TLS, a cluster) redis-py serves all three.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from producer.submit import LISTEN_BLOCK_S, Prepared, Submitter
from shared.redis_conn import AnyRedis, connect_redis
from shared.resp import RespConnection
from shared.resp import supported as resp_supported
from shared.scripts import SUBMIT_SCRIPT, call_resp


class LoopConnections:
    def __init__(self, url: str, single: bool) -> None:
        self.redis: AnyRedis = connect_redis(url)
        self.listen: AnyRedis = connect_redis(url, socket_timeout=LISTEN_BLOCK_S + 10)
        direct = single and resp_supported(url)
        self.whole = RespConnection(url) if direct else None
        self.fetch = RespConnection(url) if direct else None
        self.submits = RespConnection(url) if direct else None

    async def submit(self, calls: list[tuple[list[Prepared], list[str], list[Any]]]) -> list[Any]:
        """Run SUBMIT ``calls`` (``Submitter.calls``): one answer (or error) per call."""
        if self.submits is None:
            return await Submitter.run(self.redis, calls)
        return await call_resp(
            self.submits, SUBMIT_SCRIPT, [(k, a) for _, k, a in calls], LISTEN_BLOCK_S + 10
        )

    async def run_whole(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """A lone request's pipeline (it blocks in a pop); replies with errors in place."""
        if self.whole is not None:
            return await self.whole.execute(commands, LISTEN_BLOCK_S + 10)
        pipe = self.listen.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))

    async def get(self, reads: list[list[Any]]) -> list[Any]:
        """The values that ``reads`` (``Target.read_result`` commands) read (None where gone),
        in one pipeline; raises an error reply."""
        if self.fetch is not None:
            values = await self.fetch.execute(reads, LISTEN_BLOCK_S + 10)
            for value in values:
                if isinstance(value, Exception):
                    raise value
            return values
        if len(reads) == 1:
            return [await self.redis.execute_command(*reads[0])]
        pipe = self.redis.pipeline(transaction=False)
        for command in reads:
            pipe.execute_command(*command)
        return list(await pipe.execute())

    async def leave_and_close(self, waiter_sets: list[str], reply_key: str) -> None:
        """A loop state's last step: take ``reply_key`` out of ``waiter_sets`` and delete it
        (best effort), then close every connection, also when the first part is cancelled:
        no socket is left open."""
        try:
            with contextlib.suppress(Exception):
                pipe = self.redis.pipeline(transaction=False)
                for waiters in waiter_sets:
                    pipe.srem(waiters, reply_key)
                pipe.delete(reply_key)
                await pipe.execute()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Close them all (best effort: Redis may be gone)."""
        for client in (self.redis, self.listen):
            with contextlib.suppress(Exception):
                await client.aclose()
        for conn in (self.whole, self.fetch, self.submits):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.aclose()
