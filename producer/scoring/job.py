"""The arq job ``score_file``: its arguments, its body, enqueueing it and its progress hash.

Everything the enqueuer and the worker must agree on is defined here once: the job's name
(:data:`JOB_NAME`), its keyword arguments (:class:`ScoreFileArgs`), the msgpack serializer
(:data:`pack_job`, :data:`unpack_job`) and the progress hash (:data:`PROGRESS_FIELDS`,
:data:`JOB_STATES`). ``worker/jobs.py`` registers :func:`run_score_file` with arq; README's
"Offline scoring" lists the arguments and the progress fields (``tests/test_scoring_job.py``
checks that all of them agree).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import msgpack
from arq import create_pool

from producer.remote_lm import RemoteLM
from producer.scoring.files import errors_path
from producer.scoring.options import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SHARD_ROWS,
    ScoreOptions,
)
from producer.scoring.run import ScoreStats, score_jsonl
from shared.errors import LMPoolError
from shared.keys import Keys
from shared.redis_conn import arq_redis_settings, connect_redis
from shared.settings import Settings

if TYPE_CHECKING:
    from shared.redis_conn import AnyRedis

log = logging.getLogger("lmpool.worker")  # the job's body runs on the workers

JOB_NAME = "score_file"
"""The arq function's name (``worker.jobs.score_file``)."""
pack_job = functools.partial(msgpack.packb, use_bin_type=True)
"""The workers' job serializer: msgpack, never pickle (``WorkerSettings.job_serializer``)."""
unpack_job = functools.partial(msgpack.unpackb, raw=False, strict_map_key=False)
PROGRESS_PERIOD_S = 1.0
PROGRESS_TTL_S = 7 * 24 * 3600
JOB_STATES = ("starting", "running", "finished", "failed", "interrupted")
PROGRESS_FIELDS = (
    *ScoreStats().as_dict(),
    "input",
    "output",
    "errors",
    "state",
    "updated_at",
)
"""Fields of the progress hash ``Keys.job_progress(job_id)`` (all strings), and ``error`` when
the job failed or was interrupted. The job's arq result holds the same counters and paths."""


@dataclass(frozen=True)
class ScoreFileArgs:
    """The keyword arguments of ``score_file`` (after its two paths, input and output).

    Each is the ``lmpool-score`` option of the same name; None means that option's default.
    """

    mode: str = "logprobs"
    """``logprobs``, ``sample`` or ``score``."""
    top_k: int | None = None
    """``logprobs``: only the K most likely tokens; None: whole distributions (``.npy``)."""
    max_tokens: int | None = None
    """``sample``: tokens drawn at most (default ``DEFAULT_MAX_TOKENS``)."""
    temperature: float = 1.0
    """``sample``."""
    seed: int | None = None
    """``sample``: the seed of lines without their own ``seed``."""
    concurrency: int | None = None
    """Requests in flight (default ``DEFAULT_CONCURRENCY``)."""
    shard_rows: int | None = None
    """Rows per ``.npy`` shard (default ``DEFAULT_SHARD_ROWS``)."""
    model: str | None = None
    """The model name workers registered; None: the worker's own model."""
    timeout_s: float | None = None
    """Seconds per request; None: ``LMPOOL_TIMEOUT_S``."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> ScoreFileArgs:
        """The arguments of a call; ``TypeError`` naming the unknown ones."""
        unknown = set(kwargs) - set(cls.names())
        if unknown:
            raise TypeError(f"unknown score_file options {sorted(unknown)}; known: {cls.names()}")
        return cls(**kwargs)

    @classmethod
    def from_options(cls, options: ScoreOptions, **extra: Any) -> ScoreFileArgs:
        """The job that computes ``options`` (``extra``: ``model``, ``timeout_s``)."""
        return cls.from_kwargs(
            {**{f.name: getattr(options, f.name) for f in fields(ScoreOptions)}, **extra}
        )

    def score_options(self) -> ScoreOptions:
        """What to compute; ``ValueError`` when the arguments are invalid."""

        def given(value: int | None, default: int) -> int:
            return default if value is None else value

        return ScoreOptions(
            mode=self.mode,
            top_k=self.top_k,
            max_tokens=given(self.max_tokens, DEFAULT_MAX_TOKENS),
            temperature=self.temperature,
            seed=self.seed,
            concurrency=given(self.concurrency, DEFAULT_CONCURRENCY),
            shard_rows=given(self.shard_rows, DEFAULT_SHARD_ROWS),
        )

    def job_kwargs(self) -> dict[str, Any]:
        """What the job message carries: the arguments that differ from their default."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if getattr(self, f.name) != f.default
        }


# -- the worker side ------------------------------------------------------------------------------
class ProgressHash:
    """The job's progress hash, rewritten whole with a fresh expiry at each update."""

    def __init__(self, redis: AnyRedis, key: str, stats: ScoreStats, paths: dict[str, str]):
        self.redis = redis
        self.key = key
        self.stats = stats
        self.paths = paths

    async def write(self, state: str, **extra: str) -> None:
        fields = {
            **self.stats.as_dict(),
            **self.paths,
            **extra,
            "state": state,
            "updated_at": time.time(),
        }
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.key, mapping={k: str(v) for k, v in fields.items()})
        pipe.expire(self.key, PROGRESS_TTL_S)
        await pipe.execute()

    async def refresh(self) -> None:
        """State ``running`` every ``PROGRESS_PERIOD_S`` until cancelled; a failed write is
        logged, not fatal (the job goes on)."""
        while True:
            await asyncio.sleep(PROGRESS_PERIOD_S)
            try:
                await self.write("running")
            except Exception:
                log.warning("cannot record progress of %s", self.key, exc_info=True)


async def run_score_file(
    redis: AnyRedis,
    settings: Settings,
    job_id: str,
    input_path: str,
    output_path: str,
    args: ScoreFileArgs,
    default_model: str,
) -> dict[str, Any]:
    """The body of ``score_file`` on a worker: score ``input_path`` into ``output_path``
    (resumable, like ``lmpool-score``) through a ``RemoteLM`` on the worker's own Redis
    (``redis``, ``settings``) at ``priority="low"``, keeping the progress hash up to date.

    Returns the counters (``total``, ``done``, ``completed``, ``skipped``, ``failed``...) and
    the paths. Failed lines are in ``errors`` and retried by the next run; the job itself
    fails only when the output cannot be written or no worker serves the model.
    """
    options = args.score_options()
    stats = ScoreStats()
    paths = {"input": input_path, "output": output_path, "errors": str(errors_path(output_path))}
    progress = ProgressHash(redis, Keys(settings.key_prefix).job_progress(job_id), stats, paths)
    await progress.write("starting")
    ticker = asyncio.create_task(progress.refresh(), name="lmpool-job-progress")
    try:
        lm = await RemoteLM.connect(
            settings.redis_url,
            args.model or default_model,
            args.timeout_s,
            cache_size=0,
            priority="low",
            settings=settings,
        )
        try:
            await score_jsonl(lm, input_path, output_path, options, stats=stats)
        finally:
            await lm.close()
    except BaseException as e:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        state = "interrupted" if isinstance(e, asyncio.CancelledError) else "failed"
        await progress.write(state, error=f"{type(e).__name__}: {e}")
        raise
    ticker.cancel()
    await asyncio.gather(ticker, return_exceptions=True)
    await progress.write("finished")
    log.info("score_file %s -> %s: %s", input_path, output_path, stats.summary())
    return {**stats.as_dict(), **paths}


# -- the producer side ----------------------------------------------------------------------------
async def enqueue_score_file(
    redis_url: str | None,
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    key_prefix: str | None = None,
    job_id: str | None = None,
    **options: Any,
) -> str:
    """Enqueue the arq job ``score_file`` on the pool's queue; returns the job id.

    ``options`` are the fields of :class:`ScoreFileArgs`: ``mode``, ``top_k``, ``max_tokens``,
    ``temperature``, ``seed``, ``concurrency``, ``shard_rows``, ``model`` (default: the
    worker's own model), ``timeout_s``; they are checked here (``TypeError``, ``ValueError``).
    Paths are made absolute here: the worker must see the same filesystem.
    """
    args = ScoreFileArgs.from_kwargs(options)
    args.score_options()
    settings = Settings.from_env(redis_url=redis_url, key_prefix=key_prefix)
    queue = Keys(settings.key_prefix).arq_queue
    pool = await create_pool(
        arq_redis_settings(settings.redis_url),  # TLS options as redis-py reads them
        job_serializer=pack_job,
        job_deserializer=unpack_job,
        default_queue_name=queue,
    )
    try:
        job = await pool.enqueue_job(
            JOB_NAME,
            os.path.abspath(input_path),
            os.path.abspath(output_path),
            _job_id=job_id,
            _queue_name=queue,
            **args.job_kwargs(),
        )
    finally:
        await pool.aclose()
    if job is None:
        raise LMPoolError(f"an arq job with id {job_id!r} exists already")
    return job.job_id


async def read_job_progress(
    redis_url: str | None, job_id: str, key_prefix: str | None = None
) -> dict[str, str]:
    """The progress hash of a ``score_file`` job (empty when unknown or expired)."""
    settings = Settings.from_env(redis_url=redis_url, key_prefix=key_prefix)
    redis = connect_redis(settings.redis_url)
    try:
        raw = await redis.hgetall(Keys(settings.key_prefix).job_progress(job_id))  # type: ignore[misc]
    finally:
        await redis.aclose()
    return {k.decode(): v.decode() for k, v in raw.items()}
