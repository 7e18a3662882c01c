"""``arq worker.WorkerSettings``: the process that runs a backend and serves its streams.

arq owns the process (signals, start-up, shutdown, offline jobs); the per-request path runs on
Redis streams in :mod:`worker.stream`, started from ``on_startup``. Jobs travel as msgpack,
never pickle: anyone who can write to Redis must not be able to run code on a GPU node.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from arq.connections import RedisSettings
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import heap
from shared.aio import OutageLog, cancelling
from shared.errors import SettingsError
from shared.keys import Keys
from shared.redis_conn import arq_redis_settings, is_cluster, is_cluster_async, masked_url
from shared.settings import Settings
from worker.jobs import pack_job, score_file, unpack_job
from worker.logs import setup_logging

log = logging.getLogger("lmpool.worker")
T = TypeVar("T")


def load_settings() -> Settings:
    """Settings from the environment, validated: a bad variable stops the worker at start-up."""
    return Settings.from_env()


async def startup(ctx: dict[str, Any]) -> None:
    try:
        await _start(ctx)
        ARQ_RETRY.serve(asyncio.current_task())  # arq runs its hooks in its main task
    except SettingsError as e:  # found once the servers or the model were looked at
        log.error("%s", e)
        raise SystemExit(2) from None
    except (RedisConnectionError, RedisTimeoutError) as e:  # arq's own Redis answered
        log.error("%s", unreachable("LMPOOL_REDIS_URL", _SETTINGS.redis_url, e))
        raise SystemExit(1) from None


async def _start(ctx: dict[str, Any]) -> None:
    from worker.backends import load_backend
    from worker.pool import PoolWorker
    from worker.stream.compute import in_compute_thread

    settings = load_settings()
    setup_logging(settings.log_level, settings.log_format)
    # A progress bar is no log line: transformers' ("Loading weights: 100%|...") came between
    # the log's lines, JSON ones too (tqdm's own bars: see worker/__init__.py)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        cluster = await is_cluster_async(settings.redis_url)
    except (RedisConnectionError, RedisTimeoutError):
        raise
    except RedisError as e:
        raise SettingsError(not_usable("LMPOOL_REDIS_URL", settings.redis_url, e)) from None
    if cluster and not settings.arq_redis_url:
        raise SettingsError(no_arq_redis(settings))
    if settings.arq_redis_url and await is_cluster_async(settings.arq_redis_url):
        raise SettingsError(arq_on_cluster(settings))
    if settings.torch_threads:
        import torch

        # OpenMP's thread count is per calling thread: set it where steps run (the compute
        # thread, and the event loop for steps too short to hand over)
        torch.set_num_threads(settings.torch_threads)
        await in_compute_thread(functools.partial(torch.set_num_threads, settings.torch_threads))
    try:
        backend = await in_compute_thread(functools.partial(load_backend, settings))
    except ImportError as e:
        if "pip install" in str(e):  # an engine's (or bitsandbytes') own hint: a setting's fault
            raise SettingsError(str(e)) from None
        raise
    pool = PoolWorker(settings, backend, cluster)
    if settings.keep_freed_memory:  # a step's rows reuse the pages the last one's touched
        heap.keep_freed_memory()
    # what start-up made (modules, the model, the backend) lives as long as the process: out
    # of the collector's full passes, which paused a serving worker 104-240 ms each
    log.debug("%d start-up objects frozen", heap.freeze_start_up_objects())
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


def no_arq_redis(settings: Settings) -> str:
    return (
        f"LMPOOL_REDIS_URL={masked_url(settings.redis_url)} is a Redis Cluster node, and arq's "
        "job queue cannot live on a cluster: set LMPOOL_ARQ_REDIS_URL to a plain Redis"
    )


def arq_on_cluster(settings: Settings) -> str:
    return (
        f"LMPOOL_ARQ_REDIS_URL={masked_url(settings.arq_redis_url)} is a Redis Cluster node: "
        "arq needs a plain Redis"
    )


def unreachable(variable: str, url: str, error: BaseException) -> str:
    """The line a worker ends with when Redis does not answer (its password masked)."""
    return f"cannot reach Redis at {variable}={masked_url(url)}: {error}"


def not_usable(variable: str, url: str, error: BaseException) -> str:
    """The line a worker ends with when the server at ``url`` answers, but not as a Redis it
    can use (a database it does not have, another protocol on that port, ACL refusals)."""
    return f"{variable}={masked_url(url)}: {error} (is this the pool's Redis?)"


def arq_url(settings: Settings) -> str:
    """Where arq's queue lives; checked here, at import, because arq talks to it before any
    start-up hook runs. A server that does not answer yet counts as no cluster (start-up asks
    again); one that answers as no usable Redis is a setting error."""
    variable = "LMPOOL_ARQ_REDIS_URL" if settings.arq_redis_url else "LMPOOL_REDIS_URL"
    url = settings.arq_redis_url or settings.redis_url
    try:
        cluster = is_cluster(url)
    except (RedisConnectionError, RedisTimeoutError, OSError):
        cluster = False
    except RedisError as e:  # it answered, not as a usable Redis: a setting's fault
        raise SettingsError(not_usable(variable, url, e)) from None
    if cluster and settings.arq_redis_url:
        raise SettingsError(arq_on_cluster(settings))
    if cluster:
        raise SettingsError(no_arq_redis(settings))
    return url


def _or_exit(check: Callable[[], T]) -> T:
    """``check()``, or the process ends with its setting error on one line (exit status 2):
    an operator reads which variable is wrong, not an import traceback through arq's CLI."""
    try:
        return check()
    except SettingsError as e:
        print(f"lmpool worker: {e}", file=sys.stderr)
        raise SystemExit(2) from None


_SETTINGS = _or_exit(load_settings)
if _SETTINGS.log_format == "json":  # arq's lines too: its CLI configures them after this import
    import arq.cli

    from worker.logs import arq_log_config

    arq.cli.default_log_config = arq_log_config


def _report_unreachable(
    kind: type[BaseException], error: BaseException, tb: TracebackType | None
) -> None:
    """``sys.excepthook``: when arq's worker could not reach its Redis (after its own
    retries), one line naming the URL instead of a traceback through arq and redis-py; exit
    status 1. Anything else goes to the hook this one replaced."""
    if isinstance(error, (RedisConnectionError, RedisTimeoutError)) and _through_arq(tb):
        variable = "LMPOOL_ARQ_REDIS_URL" if _SETTINGS.arq_redis_url else "LMPOOL_REDIS_URL"
        url = _SETTINGS.arq_redis_url or _SETTINGS.redis_url
        said = unreachable(variable, url, error)
        if ARQ_RETRY.serving:  # it served, then a stop found Redis gone
            said = f"stopped without unregistering: {said} (other workers take over what it held)"
        print(f"lmpool worker: {said}", file=sys.stderr)
        return
    _previous_hook(kind, error, tb)


def _through_arq(tb: TracebackType | None) -> bool:
    """Whether the exception came through arq's code (its CLI, its worker's connection)."""
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith("arq."):
            return True
        tb = tb.tb_next
    return False


_previous_hook = sys.excepthook
sys.excepthook = _report_unreachable


class ServingRetry(Retry):
    """How arq's connections retry; one object for all of them (redis-py copies a retry into
    each connection it opens: ``__deepcopy__`` hands out this one), in three phases:

    - start-up: ``retries`` attempts, a refused connection not retried: a worker whose Redis
      does not answer ends with one line (arq's own start-up attempts, then ``unreachable``);
    - serving (``serve``, once start-up is done): an outage, refused connections included, is
      waited out however long it lasts (a Redis restart loading its data), logged as the stream
      side's loops log theirs (``shared.aio.OutageLog``);
    - stopping (arq cancels its main task on SIGTERM or SIGINT, then deletes its health-check
      key before it calls ``on_shutdown``): at most ``STOP_RETRIES`` more attempts a call, so
      that a stop during an outage ends; what the worker held stays pending and is taken over
      by another worker.
    """

    STOP_RETRIES = 2

    def __init__(self, retries: int) -> None:
        super().__init__(ExponentialBackoff(cap=2.0, base=0.1), retries)
        self.serving = False
        self.outage = OutageLog(log, "for arq's connections")
        self.main: asyncio.Task[Any] | None = None
        """arq's main task: once it is cancelled or done, the worker is stopping."""

    def __deepcopy__(self, memo: dict[int, Any]) -> ServingRetry:
        return self

    def serve(self, main: asyncio.Task[Any] | None = None) -> None:
        self.serving, self.main = True, main
        self._supported_errors = (RedisConnectionError, RedisTimeoutError, OSError)  # type: ignore[assignment]

    async def call_with_retry(self, do: Callable[[], Any], fail: Callable[[Any], Any]) -> Any:
        if not self.serving:
            return await super().call_with_retry(do, fail)
        failures = 0
        while True:
            try:
                result = await do()
            except self._supported_errors as error:
                failures += 1
                await fail(error)
                if self._stopping() and failures > self.STOP_RETRIES:
                    raise
                if not self._stopping():
                    self.outage.failed(error, "retrying until it answers")
                await asyncio.sleep(self._backoff.compute(failures))
                continue
            self.outage.answered()
            return result

    def _stopping(self) -> bool:
        # from arq's main task, whether or not a retry was waiting when the stop came (one that
        # was not: arq's close then deletes its health key outside the main task, and that DEL
        # was retried until Redis answered, for good)
        main = self.main
        return main is not None and (main.done() or cancelling(main))


def redis_settings(url: str) -> RedisSettings:
    """arq's connection settings: short outages retried at start-up, any outage once serving
    (``ServingRetry``)."""
    settings: RedisSettings = arq_redis_settings(url)  # TLS options as redis-py reads them
    settings.retry_on_error = [RedisConnectionError, RedisTimeoutError]
    settings.retry = ServingRetry(retries=12)
    return settings


class WorkerSettings:
    """arq settings; every value comes from ``LMPOOL_*`` variables (see README)."""

    functions = [pool_info, score_file]
    on_startup = startup
    on_shutdown = shutdown
    redis_settings = redis_settings(_or_exit(lambda: arq_url(_SETTINGS)))
    queue_name = Keys(_SETTINGS.key_prefix).arq_queue
    job_serializer = pack_job
    job_deserializer = unpack_job
    max_jobs = 4
    job_timeout = 24 * 3600
    keep_result = 3600
    poll_delay = 0.5


ARQ_RETRY: ServingRetry = WorkerSettings.redis_settings.retry  # type: ignore[assignment]
