"""What a loop's or a thread's state needs to know of the pool it talks to.

:class:`producer.client.PoolClient` owns the states (``producer.loop``, ``producer.submit``);
they see only this frozen description of their target, never the client, so the imports run
one way: client -> loop -> submit -> target.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from shared.keys import GROUP, Keys
from shared.redis_conn import AnyRedis
from shared.settings import Settings

QUEUE_STATE_S = 1.0
"""Longest wait for the queue state of a ``RequestTimeout``'s message: a Redis that does not
answer (frozen, or a host gone without a reset) must not hold the caller past its timeout."""


@dataclass(frozen=True)
class Target:
    """One model of one pool, as a producer's requests address it."""

    settings: Settings
    model: str
    priority: str
    """``high`` (interactive) or ``low`` (offline): the streams its requests go to."""
    client_id: str
    """Names the producer's reply lists."""
    tenant: str = ""
    """Whose requests these are (``producer.connect.resolve_tenant``); empty: no tenant."""
    clock_offset_ms: float = 0.0
    """Redis server time minus this host's time, measured at connect."""
    keys: Keys = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", Keys(self.settings.key_prefix))

    def redis_now_ms(self) -> float:
        return time.time() * 1000 + self.clock_offset_ms

    def read_result(self, shard: int, digest: str) -> list[Any]:
        """The command that reads a result and gives it its TTL (results are written without
        one until their first read: ``shared.scripts``)."""
        key = self.keys.result(self.model, shard, digest)
        return ["GETEX", key, "PX", self.settings.result_ttl_s * 1000]

    def stream_of(self, shard: int) -> str:
        return self.keys.stream(self.model, self.priority, shard, self.tenant)

    # -- diagnostics ----------------------------------------------------------------------
    async def queue_state(self, redis: AnyRedis) -> str:
        """One line on the model's queue for error messages (``RequestTimeout``)."""
        try:
            pipe = redis.pipeline(transaction=False)
            self._ask_queue_state(pipe)
            answers = await asyncio.wait_for(pipe.execute(raise_on_error=False), QUEUE_STATE_S)
            return self._queue_state_line(answers)
        except asyncio.TimeoutError:
            return f"queue state unavailable: Redis did not answer within {QUEUE_STATE_S:g}s"
        except Exception as e:
            return f"queue state unavailable: {e!r}"

    def queue_state_sync(self, redis: Any) -> str:
        """:meth:`queue_state` with a synchronous client (the blocking path's)."""
        try:
            pipe = redis.pipeline(transaction=False)
            self._ask_queue_state(pipe)
            return self._queue_state_line(pipe.execute(raise_on_error=False))
        except Exception as e:
            return f"queue state unavailable: {e!r}"

    def _streams(self) -> list[str]:
        """The model's streams this producer's requests may wait in: of no tenant, and of its
        own tenant's where it has one."""
        shards = self.settings.shards
        tenants = {s: [self.tenant] for s in range(shards)} if self.tenant else None
        return self.keys.streams(self.model, shards, tenants=tenants)

    def _ask_queue_state(self, pipe: Any) -> None:
        """Queue what :meth:`_queue_state_line` reads: live workers, then each stream's length
        and pending count."""
        pipe.zrangebyscore(self.keys.workers(self.model), int(self.redis_now_ms()), "+inf")
        for stream in self._streams():
            pipe.xlen(stream)
            pipe.xpending(stream, GROUP)

    def _queue_state_line(self, answers: list[Any]) -> str:
        if isinstance(answers[0], Exception):
            raise answers[0]
        totals = {"interactive": [0, 0], "offline": [0, 0]}
        for i, stream in enumerate(self._streams()):
            length, pending = answers[1 + 2 * i], answers[2 + 2 * i]
            if isinstance(length, Exception):
                raise length
            kind = "offline" if self.keys.parse_stream(stream).offline else "interactive"
            totals[kind][0] += int(length)
            if not isinstance(pending, Exception):  # no group yet: nothing pending
                totals[kind][1] += int(pending["pending"])
        return ", ".join(
            [f"{len(answers[0])} live worker(s)"]
            + [f"{k} queue {n} ({p} pending)" for k, (n, p) in totals.items()]
        )
