"""Methods that genlm-backend makes synchronous but that need the network here: they block when
no event loop runs in the calling thread, and otherwise become a task of the running loop, or
run in a thread of its default executor (returned, so ``await`` works too) instead of blocking
it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("lmpool.producer")
T = TypeVar("T")
KEEP: set[asyncio.Task[Any]] = set()
"""Tasks started by synchronous methods, kept alive until they finish."""


def run_or_schedule(make: Callable[[], Coroutine[Any, Any, T]], blocking: Callable[[], T]) -> Any:
    """``blocking()`` without a running loop in this thread; else a task of ``make()``."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return blocking()
    task = loop.create_task(make())
    KEEP.add(task)

    def done(t: asyncio.Task[Any]) -> None:
        KEEP.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.warning("background request failed: %r", t.exception())

    task.add_done_callback(done)
    return task


def run_or_thread(blocking: Callable[[], T]) -> Any:
    """``blocking()`` without a running loop in this thread; else ``blocking()`` in a thread of
    the loop's default executor, its future returned. Unlike a task, it runs to its end even
    when nobody awaits it and the loop ends first (``asyncio.run`` waits for the executor's
    threads); a failure nobody awaits is logged."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return blocking()
    future = loop.run_in_executor(None, blocking)

    def done(f: asyncio.Future[Any]) -> None:
        if not f.cancelled() and f.exception() is not None:
            log.warning("background request failed: %r", f.exception())

    future.add_done_callback(done)
    return future


async def awaitable(value: Any) -> Any:
    return await value if isinstance(value, Awaitable) else value
