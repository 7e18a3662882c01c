"""Finding the pool: settings from arguments and ``LMPOOL_*`` variables, waiting for a live
worker of the model, and its metadata (which carries everything a producer needs)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from redis.exceptions import ResponseError

from shared import registry
from shared.errors import NoWorker, SettingsError
from shared.keys import Keys, check_tenant
from shared.redis_conn import (
    connect_redis,
    connect_redis_sync,
    is_cluster_async,
    masked_url,
    reaching,
)
from shared.registry import ModelMeta
from shared.settings import Settings

log = logging.getLogger("lmpool.producer")
WARN_AFTER_S = 1.0
"""A connect still waiting for a worker after this long says so, once (a log warning)."""


def resolve_settings(
    settings: Settings | None,
    redis_url: str | None,
    model: str | None,
    timeout_s: float | None,
    connect_timeout_s: float | None,
    tenant: str | None = None,
    quota_wait: bool | None = None,
) -> tuple[Settings, str]:
    changes = {
        "redis_url": redis_url,
        "timeout_s": timeout_s,
        "connect_timeout_s": connect_timeout_s,
        "tenant": tenant,
        "quota_wait": quota_wait,
    }
    passed: dict[str, Any] = {k: v for k, v in changes.items() if v is not None}
    try:  # the arguments replace the environment's values before those are checked
        settings = settings.replace(**passed) if settings else Settings.from_env(**passed)
    except SettingsError as e:
        # the check names the variable; the value that failed was the argument
        for name, value in passed.items():
            var = f"LMPOOL_{name.upper()}"
            if var in str(e):
                shown = masked_url(value) if isinstance(value, str) else repr(value)
                raise SettingsError(
                    str(e).replace(var, f"{name} (the argument given: {shown})", 1)
                ) from None
        raise
    return settings, model or settings.served_model_name


def resolve_tenant(asked: str, acl_user: str | None) -> str:
    """The tenant of a producer that asked for ``asked`` (may be empty) and connected as ACL
    user ``acl_user`` (None: unknown, the server refused ``ACL WHOAMI``): the ACL user wins,
    except ``default`` (no ACLs in use); naming another tenant than one's ACL user is an error."""
    if acl_user in (None, "default"):
        return asked
    if asked and asked != acl_user:
        raise SettingsError(
            f"tenant {asked!r} asked for, but the producer connects as Redis ACL user "
            f"{acl_user!r}, and a producer's tenant is its ACL user: leave LMPOOL_TENANT empty "
            "or connect as that tenant's user"
        )
    try:
        return check_tenant(acl_user)
    except ValueError as e:
        raise SettingsError(
            f"Redis ACL user {acl_user!r} cannot name a tenant ({e}): rename the user"
        ) from None


async def acl_user(redis: Any) -> str | None:
    """The ACL user of ``redis``' connection, None when the server refuses to say."""
    try:
        name = await redis.acl_whoami()
    except ResponseError:
        return None
    return name.decode() if isinstance(name, bytes) else str(name)


def acl_user_sync(redis: Any) -> str | None:
    """:func:`acl_user`, blocking."""
    try:
        name = redis.acl_whoami()
    except ResponseError:
        return None
    return name.decode() if isinstance(name, bytes) else str(name)


async def wait_for_model(settings: Settings, model: str) -> tuple[ModelMeta, float, str]:
    """Metadata of ``model`` once a live worker serves it, the Redis clock's offset from
    this host's (ms) and the producer's tenant (:func:`resolve_tenant`); ``NoWorker`` after
    the timeout."""
    with reaching(settings.redis_url):
        return await _wait_for_model(settings, model)


async def _wait_for_model(settings: Settings, model: str) -> tuple[ModelMeta, float, str]:
    keys = Keys(settings.key_prefix)
    await is_cluster_async(settings.redis_url)  # asked once per URL, without blocking the loop
    redis = connect_redis(settings.redis_url)
    try:
        tenant = resolve_tenant(settings.tenant, await acl_user(redis))
        waiting = _Waiting(settings, model)
        while True:
            if await registry.live_workers(redis, keys, model):
                meta = await registry.read_meta(redis, keys, model)
                if meta is not None:
                    t0 = time.time()
                    return meta, _clock_offset(t0, *await redis.time()), tenant
            if waiting.long():
                waiting.tell(sorted(m.decode() for m in await redis.smembers(keys.models)))  # type: ignore[misc]
            await asyncio.sleep(0.1)
    finally:
        await redis.aclose()


def wait_for_model_sync(settings: Settings, model: str) -> tuple[ModelMeta, float, str]:
    """:func:`wait_for_model`, blocking."""
    with reaching(settings.redis_url):
        return _wait_for_model_sync(settings, model)


def _wait_for_model_sync(settings: Settings, model: str) -> tuple[ModelMeta, float, str]:
    keys = Keys(settings.key_prefix)
    redis = connect_redis_sync(settings.redis_url)
    try:
        tenant = resolve_tenant(settings.tenant, acl_user_sync(redis))
        waiting = _Waiting(settings, model)
        while True:
            seconds, micros = redis.time()  # heartbeats are on the server's clock
            alive = redis.zrangebyscore(
                keys.workers(model), seconds * 1000 + micros // 1000, "+inf"
            )
            raw: Any = redis.hgetall(keys.meta(model)) if alive else None
            if raw:
                t0 = time.time()
                return registry.parse_meta(raw), _clock_offset(t0, *redis.time()), tenant
            if waiting.long():
                waiting.tell(sorted(m.decode() for m in redis.smembers(keys.models)))
            time.sleep(0.1)
    finally:
        redis.close()


def _clock_offset(t0: float, seconds: int, micros: int) -> float:
    """The Redis clock's offset from this host's (ms), from a ``TIME`` asked at ``t0``
    and answered now (the middle of the round trip)."""
    return seconds * 1000 + micros / 1000 - (t0 + time.time()) * 500


class _Waiting:
    """A connect's wait for a live worker: it says once, after ``WARN_AFTER_S``, why it still
    waits, and raises ``NoWorker`` at ``LMPOOL_CONNECT_TIMEOUT_S``."""

    def __init__(self, settings: Settings, model: str) -> None:
        self.settings, self.model = settings, model
        self.started = time.monotonic()
        self.deadline = self.started + settings.connect_timeout_s
        self.warned = False

    def long(self) -> bool:
        """Whether the wait has lasted long enough to say why (or to give up)."""
        now = time.monotonic()
        return now >= self.deadline or (not self.warned and now >= self.started + WARN_AFTER_S)

    def tell(self, known: list[str]) -> None:
        """Give up, or say why it waits, naming the models a worker has served (``known``)."""
        if time.monotonic() >= self.deadline:
            raise _no_worker(self.settings, self.model, known)
        self.warned = True
        settings, model = self.settings, self.model
        where = masked_url(settings.redis_url)
        if model in known:
            why = f"no live worker of model {model!r} on {where} (one has served it before)"
        else:
            why = (
                f"no worker has served model {model!r} on {where}; models there: {known or 'none'}"
            )
        log.warning(
            "%s; waiting up to %gs (LMPOOL_CONNECT_TIMEOUT_S) for one",
            why,
            settings.connect_timeout_s,
        )


def _no_worker(settings: Settings, model: str, known: list[str]) -> NoWorker:
    return NoWorker(
        f"no live worker serves model {model!r} on {masked_url(settings.redis_url)} "
        f"after {settings.connect_timeout_s:g}s; models seen: {known or 'none'}. "
        f"Start one: LMPOOL_MODEL=... arq worker.WorkerSettings"
    )
