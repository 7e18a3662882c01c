"""Redis clients from a URL (AUTH, ACL users and TLS come from the URL itself)."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis


def connect_redis(url: str, **kwargs: Any) -> Redis:
    """A client for ``redis://``, ``rediss://`` (TLS) or ``unix://`` URLs, binary replies."""
    options: dict[str, Any] = {"health_check_interval": 30, "socket_keepalive": True}
    options.update(kwargs)
    return Redis.from_url(url, decode_responses=False, **options)
