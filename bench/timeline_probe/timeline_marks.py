"""Timestamps (``time.time_ns``, one clock for every process on the host) of wrapped calls."""

from __future__ import annotations

import atexit
import functools
import inspect
import time
from typing import Any

EVENTS: list[tuple[int, str]] = []
_path: str | None = None


def mark(name: str) -> None:
    EVENTS.append((time.time_ns(), name))
    if _path is not None and len(EVENTS) >= 1000:
        flush()


def flush() -> None:
    if _path is None:
        return
    with open(_path, "a") as f:
        f.writelines(f"{t} {n}\n" for t, n in EVENTS)
    EVENTS.clear()


def to_file(path: str) -> None:
    """Write the marks to ``path`` (in batches, and at exit)."""
    global _path
    _path = path
    atexit.register(flush)


def wrap(owner: Any, attr: str, name: str) -> None:
    """Mark ``name >`` when ``owner.attr`` is called and ``name <`` when it returns."""
    fn = getattr(owner, attr)
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            mark(name + " >")
            try:
                return await fn(*args, **kwargs)
            finally:
                mark(name + " <")

        setattr(owner, attr, wrapped_async)
    else:

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            mark(name + " >")
            try:
                return fn(*args, **kwargs)
            finally:
                mark(name + " <")

        setattr(owner, attr, wrapped)
