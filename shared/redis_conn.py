"""Redis clients from a URL (AUTH, ACL users and TLS come from the URL itself).

Commands are retried a few times with exponential backoff on connection errors, which rides
out a brief network blip or a Redis restart; longer outages are handled by the loops that use
the client (they back off and keep going). Every command lmpool sends is safe to repeat.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
"""Errors that mean "Redis is unreachable right now", as opposed to a refused command."""


def connect_redis(url: str, **kwargs: Any) -> Redis:
    """A client for ``redis://``, ``rediss://`` (TLS) or ``unix://`` URLs, binary replies."""
    options: dict[str, Any] = {
        "health_check_interval": 30,
        "socket_keepalive": True,
        "socket_connect_timeout": 5,
        # No command of lmpool blocks for more than a few seconds: a read that takes longer is a
        # dead connection (a server restarted under us), to be dropped and retried.
        "socket_timeout": 15,
        "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=4),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }
    options.update(kwargs)
    return Redis.from_url(url, decode_responses=False, **options)


class Backoff:
    """Growing pauses between attempts while Redis is unreachable."""

    def __init__(self, first_s: float = 0.05, cap_s: float = 2.0) -> None:
        self.first_s, self.cap_s = first_s, cap_s
        self.next_s = first_s

    def reset(self) -> None:
        self.next_s = self.first_s

    def step(self) -> float:
        wait, self.next_s = self.next_s, min(self.next_s * 2, self.cap_s)
        return wait
