"""Methods that genlm-backend makes synchronous but that need the network here: they block when
no event loop runs in the calling thread, and otherwise become a task of the running loop
(returned, so ``await`` works too) instead of blocking it."""

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


async def nothing() -> None:
    return None


async def awaitable(value: Any) -> Any:
    return await value if isinstance(value, Awaitable) else value
