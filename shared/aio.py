"""asyncio helpers shared by lmpool's loops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable
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


class OutageLog:
    """The log of one loop's Redis outage: a warning when its first call fails, at most one
    every ``every_s`` while the outage lasts, and one when Redis answers again (a loop that
    retried every heartbeat wrote a line each time: 5 a second at a 0.2 s heartbeat)."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log, self.what, self.every_s, self.clock = log, what, every_s, clock
        self.since: float | None = None
        """When the outage began (monotonic), None while Redis answers."""
        self._said = 0.0
        self.failures = 0

    def failed(self, error: BaseException, then: str = "retrying") -> None:
        now = self.clock()
        self.failures += 1
        if self.since is None:
            self.since, self._said, self.failures = now, now, 1
            self.log.warning("Redis unreachable %s (%r); %s", self.what, error, then)
        elif now - self._said >= self.every_s:
            self._said = now
            self.log.warning(
                "Redis still unreachable %s after %.0f s and %d tries (%r)",
                self.what, now - self.since, self.failures, error,
            )  # fmt: skip

    def answered(self) -> None:
        if self.since is not None:
            self.log.warning(
                "Redis answers %s again after %.1f s", self.what, self.clock() - self.since
            )
            self.since = None
