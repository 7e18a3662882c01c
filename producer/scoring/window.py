"""How many requests a run keeps in flight, and whether a line whose request timed out goes again.

A run's requests wait in the pool's queue behind its own others: with more in flight than the
pool answers within the request timeout, each waits past its timeout however alive the pool is
(3,000 full rows at 256 in flight against one worker on a CPU, 2 rows a second: 689 lines
failed). :class:`Window` lets ``concurrency`` requests in flight at first; once one times out,
at most half of what the pool answered within the timeout (a request then waits about half its
timeout), growing back by one per window's worth of answers; a pool that answered nothing
within the timeout leaves it as it is. A line whose request timed out
goes again while the pool answered other lines during its wait (a long queue, not a stuck
pool), :data:`MAX_TRIES` times at most.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from shared.errors import RequestTimeout

MAX_TRIES = 8
"""Most requests one line makes that time out while the pool answers other lines."""
BUCKETS = 32
"""Answers are counted in this many spans of the timeout (memory independent of the rate)."""


class Window:
    """At most :attr:`limit` requests in flight (``acquire`` / ``release``), one event loop."""

    def __init__(self, concurrency: int, timeout_s: float) -> None:
        self.most = concurrency
        self.limit = float(concurrency)
        self.timeout_s = timeout_s
        self.in_flight = 0
        self.freed = asyncio.Event()
        self.span = max(timeout_s / BUCKETS, 1e-3)
        self.counts: deque[list[float]] = deque()
        """``[start, answers]`` per span, the last timeout's worth."""
        self.last_answer = float("-inf")

    async def acquire(self) -> None:
        while self.in_flight >= max(1, int(self.limit)):
            self.freed.clear()
            await self.freed.wait()
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self.freed.set()

    def answered(self) -> None:
        """The pool answered one of the run's requests."""
        now = self.last_answer = time.monotonic()
        if self.counts and now < self.counts[-1][0] + self.span:
            self.counts[-1][1] += 1
        else:
            self.counts.append([now, 1])
        self.limit = min(float(self.most), self.limit + 1 / self.limit)

    def recent(self) -> int:
        """Answers within the last timeout."""
        start = time.monotonic() - self.timeout_s
        while self.counts and self.counts[0][0] + self.span < start:
            self.counts.popleft()
        return int(sum(n for _, n in self.counts))

    def timed_out(self, sent_at: float, tries: int) -> bool:
        """A request sent at ``sent_at`` (``time.monotonic()``), the line's ``tries``-th, timed
        out: the window narrows (not when the pool answered nothing: a narrower one would
        not help, and the lines would fail one at a time); returns whether the line goes again."""
        recent = self.recent()
        if recent:
            self.limit = max(1.0, min(self.limit, recent / 2))
        return self.last_answer > sent_at and tries < MAX_TRIES

    def why(self, error: RequestTimeout, sent_at: float, tries: int) -> RequestTimeout:
        """The error a line that timed out for good fails with: ``error``, and why it was not
        sent again."""
        if self.last_answer <= sent_at:
            said = "the pool answered no other line of this run meanwhile"
        else:
            said = f"{tries} tries, each timed out while the pool answered other lines"
        return RequestTimeout(f"{error}; {said}")
