"""``arq worker.WorkerSettings``: the process that runs a backend and serves its streams.

arq owns the process (signals, start-up, shutdown, offline jobs); the per-request path runs on
Redis streams in :mod:`worker.consumer`, started from ``on_startup``. Jobs travel as msgpack,
never pickle: anyone who can write to Redis must not be able to run code on a GPU node.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any
from urllib.parse import parse_qs, urlparse

import msgpack
from arq.connections import RedisSettings
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.keys import Keys
from shared.logs import setup_logging
from shared.settings import Settings
from worker.jobs import score_file

log = logging.getLogger("lmpool.worker")


def load_settings() -> Settings:
    """Settings from the environment, validated: a bad variable stops the worker at start-up."""
    return Settings.from_env()


async def startup(ctx: dict[str, Any]) -> None:
    from worker.backends import load_backend
    from worker.pool import PoolWorker

    settings = load_settings()
    setup_logging(settings.log_level, settings.log_format)
    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)
    backend = await asyncio.to_thread(load_backend, settings)
    pool = PoolWorker(settings, backend)
    await pool.start()
    ctx["lmpool"] = pool


async def shutdown(ctx: dict[str, Any]) -> None:
    pool = ctx.get("lmpool")
    if pool is not None:
        await pool.stop()


async def pool_info(ctx: dict[str, Any]) -> dict[str, Any]:
    """arq job: this worker's description and counters."""
    description: dict[str, Any] = ctx["lmpool"].describe()
    return description


_SETTINGS = load_settings()
_packb = functools.partial(msgpack.packb, use_bin_type=True)
_unpackb = functools.partial(msgpack.unpackb, raw=False, strict_map_key=False)


def redis_settings(url: str) -> RedisSettings:
    """arq's connection settings, retrying through short Redis outages instead of exiting."""
    settings = RedisSettings.from_dsn(url)
    query = parse_qs(urlparse(url).query)
    if "ssl_ca_certs" in query:  # rediss://...?ssl_ca_certs=/path/ca.pem, as redis-py reads it
        settings.ssl_ca_certs = query["ssl_ca_certs"][0]
    if "ssl_cert_reqs" in query:
        settings.ssl_cert_reqs = query["ssl_cert_reqs"][0]
    settings.retry_on_error = [RedisConnectionError, RedisTimeoutError]
    settings.retry = Retry(ExponentialBackoff(cap=2.0, base=0.1), retries=12)
    return settings


class WorkerSettings:
    """arq settings; every value comes from ``LMPOOL_*`` variables (see README)."""

    functions = [pool_info, score_file]
    on_startup = startup
    on_shutdown = shutdown
    redis_settings = redis_settings(_SETTINGS.redis_url)
    queue_name = Keys(_SETTINGS.key_prefix).arq_queue
    job_serializer = _packb
    job_deserializer = _unpackb
    max_jobs = 4
    job_timeout = 24 * 3600
    keep_result = 3600
    poll_delay = 0.5
