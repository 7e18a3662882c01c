"""The producer's connection to the pool: submit requests, receive replies, time out clearly.

A :class:`PoolClient` serves every event loop and thread that calls it. Its state per event
loop (``producer.loop``: Redis clients, reply list, pending futures, listener task) is created
lazily in the calling loop and dropped when that loop ends: no asyncio object is ever shared
between loops. Blocking callers get a state per thread with a synchronous client
(``producer.submit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from producer.background import KEEP
from producer.loop import LoopState
from producer.submit import Prepared, SyncState
from shared import registry
from shared.errors import LMPoolError
from shared.keys import GROUP, Keys
from shared.redis_conn import AnyRedis
from shared.settings import Settings

__all__ = ["PoolClient", "Prepared"]


class PoolClient:
    """Submits requests for one model and routes the replies back, in any loop or thread."""

    def __init__(
        self, settings: Settings, model: str, priority: str = "high", clock_offset_ms: float = 0.0
    ) -> None:
        self.settings = settings
        self.model = model
        self.priority = priority
        self.keys = Keys(settings.key_prefix)
        self.client_id = uuid.uuid4().hex
        self.clock_offset_ms = clock_offset_ms
        """Redis server time minus this host's time, measured at connect."""
        self._lock = threading.Lock()
        self._loops: dict[asyncio.AbstractEventLoop, LoopState] = {}
        self._threads = threading.local()
        self._sync_states: list[SyncState] = []
        self._count = 0
        self._closed = False

    def redis_now_ms(self) -> float:
        return time.time() * 1000 + self.clock_offset_ms

    def stream_of(self, shard: int) -> str:
        return self.keys.stream(self.model, self.priority, shard)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- per loop, per thread ---------------------------------------------------------------
    def _state(self) -> LoopState:
        if self._closed:
            raise LMPoolError("this RemoteLM is closed")
        loop = asyncio.get_running_loop()
        with self._lock:
            state = self._loops.get(loop)
            if state is None:  # a new loop: forget loops closed without telling us
                for old in [lp for lp in self._loops if lp.is_closed()]:
                    del self._loops[old]
            if state is None or state.dead is not None:
                self._count += 1
                state = LoopState(self, loop, self._count)
                self._loops[loop] = state
            return state

    def _drop(self, state: LoopState) -> None:
        with self._lock:
            if self._loops.get(state.loop) is state:
                del self._loops[state.loop]

    def _sync_state(self) -> SyncState:
        if self._closed:
            raise LMPoolError("this RemoteLM is closed")
        state: SyncState | None = getattr(self._threads, "state", None)
        if state is None:
            state = self._threads.state = SyncState(self)
            with self._lock:
                self._sync_states.append(state)
        return state

    async def request(self, prepared: Prepared, timeout_s: float) -> bytes | bytearray:
        """Encoded result of ``prepared``, submitting it unless already in flight here."""
        return await self._state().request(prepared, timeout_s)

    def request_sync(self, items: list[Prepared], timeout_s: float) -> dict[str, bytes]:
        """Encoded results by digest, blocking this thread (never an event loop's state)."""
        return self._sync_state().request_many(items, timeout_s)

    async def execute(self, commands: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Run ``(method, args)`` redis-py commands in one pipeline of this loop's client."""
        pipe = self._state().redis.pipeline(transaction=False)
        for method, args in commands:
            getattr(pipe, method)(*args)
        return list(await pipe.execute())

    def execute_sync(self, commands: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """:meth:`execute`, blocking, with this thread's client."""
        pipe = self._sync_state().redis.pipeline(transaction=False)
        for method, args in commands:
            getattr(pipe, method)(*args)
        return list(pipe.execute())

    # -- diagnostics ----------------------------------------------------------------------
    async def queue_state(self, redis: AnyRedis) -> str:
        """One line on the model's queue for error messages (``RequestTimeout``)."""
        try:
            pipe = redis.pipeline(transaction=False)
            self._ask_queue_state(pipe)
            return self._queue_state_line(await pipe.execute(raise_on_error=False))
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

    def _ask_queue_state(self, pipe: Any) -> None:
        """Queue what :meth:`_queue_state_line` reads: live workers, then each stream's length
        and pending count."""
        pipe.zrangebyscore(self.keys.workers(self.model), registry.now_ms(), "+inf")
        for stream in self.keys.streams(self.model, self.settings.shards):
            pipe.xlen(stream)
            pipe.xpending(stream, GROUP)

    def _queue_state_line(self, answers: list[Any]) -> str:
        if isinstance(answers[0], Exception):
            raise answers[0]
        totals = {"interactive": [0, 0], "offline": [0, 0]}
        streams = self.keys.streams(self.model, self.settings.shards)
        for i, stream in enumerate(streams):
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

    async def clear_results(self) -> int:
        """UNLINK every cached result of this model, in batches."""
        redis = self._state().redis
        deleted = 0
        batch: list[bytes] = []
        async for key in redis.scan_iter(match=self.keys.results(self.model), count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += await redis.unlink(*batch)
                batch.clear()
        if batch:
            deleted += await redis.unlink(*batch)
        return deleted

    # -- lifecycle ------------------------------------------------------------------------
    def _on_each_loop(self, action: Callable[[LoopState], None]) -> None:
        """Run ``action`` on every live loop state, in its own loop's thread."""
        with self._lock:
            states = list(self._loops.values())
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        for state in states:
            if state.loop is current:
                action(state)
            elif not state.loop.is_closed():
                with contextlib.suppress(RuntimeError):  # closed meanwhile
                    state.loop.call_soon_threadsafe(action, state)

    def reset(self) -> None:
        """Fail every request waiting on this client (genlm's ``reset_async_queries``)."""
        error = LMPoolError("request abandoned by reset_async_queries()")
        self._on_each_loop(lambda st: st.fail_all(error))

    async def close(self) -> None:
        """Close every loop's and thread's state, from any loop."""
        self._closed = True
        reason = "this RemoteLM is closed"
        current = asyncio.get_running_loop()
        with self._lock:
            states, self._loops = list(self._loops.values()), {}
            syncs, self._sync_states = self._sync_states, []
        for state in states:
            if state.loop is current:
                await state.close(reason)
            elif state.loop.is_running():
                fut = asyncio.run_coroutine_threadsafe(state.close(reason), state.loop)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.wrap_future(fut), 10)
        for sync in syncs:
            await asyncio.to_thread(sync.close)

    def close_sync(self) -> None:
        """Close from code without a running loop (or schedule it in the running one)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self._closed = True
            task = loop.create_task(self.close())
            KEEP.add(task)
            task.add_done_callback(KEEP.discard)
            return
        self._closed = True
        reason = "this RemoteLM is closed"
        with self._lock:
            states, self._loops = list(self._loops.values()), {}
            syncs, self._sync_states = self._sync_states, []
        for state in states:
            if state.loop.is_running():
                fut = asyncio.run_coroutine_threadsafe(state.close(reason), state.loop)
                with contextlib.suppress(Exception):
                    fut.result(10)
        for sync in syncs:
            sync.close()
