"""asyncio helpers shared by lmpool's loops."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any

if sys.version_info >= (3, 11):

    async def wait_event(event: asyncio.Event, timeout_s: float) -> None:
        """Wait until ``event`` is set or ``timeout_s`` passed (no extra task, unlike
        ``asyncio.wait_for`` on Python 3.11)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await event.wait()

else:

    async def wait_event(event: asyncio.Event, timeout_s: float) -> None:
        """Wait until ``event`` is set or ``timeout_s`` passed."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)


def cancelling(task: asyncio.Task[Any] | None) -> bool:
    """Whether ``task`` was asked to cancel (Python >= 3.11 counts it even if swallowed)."""
    counter = getattr(task, "cancelling", None)
    return bool(counter()) if counter is not None else False
