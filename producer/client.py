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
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from producer.background import KEEP
from producer.loop import LoopState
from producer.quota import QuotaGate
from producer.submit import Prepared, SyncState
from producer.target import Target
from shared.errors import LMPoolError
from shared.keys import Keys
from shared.settings import Settings

__all__ = ["PoolClient", "Prepared"]


class PoolClient:
    """Submits requests for one model and routes the replies back, in any loop or thread."""

    def __init__(
        self, settings: Settings, model: str, priority: str = "high", clock_offset_ms: float = 0.0
    ) -> None:
        self.target = Target(
            settings,
            model,
            priority,
            # a tenant's reply lists carry its name: its ACL user may write only those
            f"{settings.tenant}:{uuid.uuid4().hex}" if settings.tenant else uuid.uuid4().hex,
            tenant=settings.tenant,
            clock_offset_ms=clock_offset_ms,
        )
        """What each loop's and thread's state knows of the pool (never this client)."""
        self.quota = QuotaGate(self.target, settings.quota_wait)
        self._lock = threading.Lock()
        self._loops: dict[asyncio.AbstractEventLoop, LoopState] = {}
        self._threads = threading.local()
        self._sync_states: list[SyncState] = []
        self._count = 0
        self._closed = False

    @property
    def settings(self) -> Settings:
        return self.target.settings

    @property
    def model(self) -> str:
        return self.target.model

    @property
    def keys(self) -> Keys:
        return self.target.keys

    @property
    def client_id(self) -> str:
        return self.target.client_id

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
                state = LoopState(self.target, loop, self._count, self._drop)
                self._loops[loop] = state
            return state

    def _drop(self, state: LoopState) -> None:
        with self._lock:
            if self._loops.get(state.loop) is state:
                del self._loops[state.loop]

    def _sync_state(self) -> SyncState:
        if self._closed:
            raise LMPoolError("this RemoteLM is closed")
        hold: _Held | None = getattr(self._threads, "hold", None)
        if hold is None:
            hold = self._threads.hold = _Held(SyncState(self.target))
            with self._lock:
                self._sync_states.append(hold.state)
            # the thread's own storage goes when the thread ends (an executor's, at the end of
            # the asyncio.run that made it), and its client with it: not kept open until close
            # (this object by a weak reference: a thread's storage does not keep it alive)
            weakref.finalize(hold, _forget_sync, weakref.ref(self), hold.state)
        return hold.state

    async def request(self, prepared: Prepared, timeout_s: float) -> bytes | bytearray:
        """Encoded result of ``prepared``, submitting it unless already in flight here."""
        return await self._state().request(prepared, timeout_s)

    def request_sync(self, items: list[Prepared], timeout_s: float) -> dict[str, bytes]:
        """Encoded results by digest, blocking this thread (never an event loop's state)."""
        return self._sync_state().request_many(items, timeout_s)

    async def admit(self, prepared: list[Prepared], timeout_s: float) -> list[str]:
        """Leases of one call's requests under the tenant's quota (``producer.quota``), taken
        together before any is submitted; ``QuotaExceeded`` when refused."""
        return await self.quota.admit(self._state().redis, prepared, timeout_s)

    def release(self, leases: list[str]) -> None:
        """End a call's leases (from the loop that took them)."""
        if leases and not self._closed:
            self.quota.release(self._state().redis, leases)

    def admit_sync(self, prepared: list[Prepared], timeout_s: float) -> list[str]:
        return self.quota.admit_sync(self._sync_state().redis, prepared, timeout_s)

    def release_sync(self, leases: list[str]) -> None:
        if leases and not self._closed:
            self.quota.release_sync(self._sync_state().redis, leases)

    async def execute(self, commands: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Run ``(method, args)`` redis-py commands in one pipeline of this loop's client."""
        pipe = self._state().redis.pipeline(transaction=False)
        for method, args in commands:
            getattr(pipe, method)(*args)
        return list(await pipe.execute())

    def execute_sync(self, commands: list[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """:meth:`execute`, blocking, with this thread's client."""
        pipe = self._sync_state().bulk.pipeline(transaction=False)
        for method, args in commands:
            getattr(pipe, method)(*args)
        return list(pipe.execute())

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
        # first, in a thread that runs to its end even if an ending loop cancels this close
        await asyncio.to_thread(_close_all, syncs)
        for state in states:  # the tenant's quota gets back what this producer's calls held
            if state.loop is current and state.dead is None:
                with contextlib.suppress(Exception):  # else they end at their expiry
                    await self.quota.release_all(state.redis)
        if self.quota.held:  # blocking calls' (or other loops'): no client of this loop had them
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.quota.release_all_sync, self.settings.redis_url)
        for state in states:
            if state.loop is current:
                await state.end(reason)
            elif state.loop.is_running():
                fut = asyncio.run_coroutine_threadsafe(state.end(reason), state.loop)
                # waited for, never raised: that loop may end meanwhile and cancel the ending
                await asyncio.wait([asyncio.wrap_future(fut)], timeout=10)
            else:
                _end_when_it_runs(state, reason)

    def close_sync(self) -> None:
        """Close from code without a running loop (or schedule it in the running one)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            self._closed = True
            with self._lock:  # the blocking clients belong to no loop: closed now (a task
                syncs, self._sync_states = self._sync_states, []  # may never start)
            _close_soon(syncs)
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
                fut = asyncio.run_coroutine_threadsafe(state.end(reason), state.loop)
                with contextlib.suppress(Exception):
                    fut.result(10)
            else:
                _end_when_it_runs(state, reason)
        _close_all(syncs)
        if self.quota.held:  # the tenant's quota gets back what this producer's calls held
            with contextlib.suppress(Exception):  # else they end at their expiry
                self.quota.release_all_sync(self.settings.redis_url)


def _forget_sync(client: weakref.ref[PoolClient], state: SyncState) -> None:
    """A thread's blocking state, its thread ended: off its client's list, and closed."""
    owner = client()
    if owner is not None:
        with owner._lock:
            if state not in owner._sync_states:
                return  # closed by close()
            owner._sync_states.remove(state)
    _close_soon([state])


def _close_all(syncs: list[SyncState]) -> None:
    for sync in syncs:
        with contextlib.suppress(Exception):  # Redis may be gone: the sockets close all the same
            sync.close()


def _close_soon(syncs: list[SyncState]) -> None:
    """``_close_all`` in a thread of its own: each deletes its reply list first, a round trip
    that the thread closing them (an event loop's, a collector's) must not wait for."""
    if syncs:
        threading.Thread(target=_close_all, args=(syncs,), name="lmpool-close", daemon=True).start()


def _end_when_it_runs(state: LoopState, reason: str) -> None:
    """End a state whose loop is not running now (one driven by ``run_until_complete``): its
    tasks and connections belong to that loop, so the ending is its first task when it runs
    again (nothing to do for a closed loop: its tasks and connections went with it)."""

    def start() -> None:
        task = state.loop.create_task(state.end(reason))
        KEEP.add(task)
        task.add_done_callback(KEEP.discard)

    with contextlib.suppress(RuntimeError):  # closed
        state.loop.call_soon_threadsafe(start)


class _Held:
    """A thread's blocking state, in that thread's storage (``PoolClient._threads``)."""

    __slots__ = ("__weakref__", "state")

    def __init__(self, state: SyncState) -> None:
        self.state = state
