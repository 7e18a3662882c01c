"""Offline arq jobs run by the workers.

``score_file`` is ``lmpool-score`` as a job: the same code (:mod:`producer.score`), with a
``RemoteLM`` on the worker's own Redis at ``priority="low"``, so the job's requests are served
by the whole pool after interactive work. Its progress is the hash
``Keys.job_progress(job_id)`` (fields ``state``, ``total``, ``done``, ``completed``,
``skipped``, ``failed``, ``rate``, ``elapsed_s``, ``updated_at``, ``output``, ``errors``),
refreshed every ``PROGRESS_PERIOD_S`` and expiring ``PROGRESS_TTL_S`` after the last update.
Enqueue it with :func:`producer.score.enqueue_score_file`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from shared.keys import Keys

log = logging.getLogger("lmpool.worker")
PROGRESS_PERIOD_S = 1.0
PROGRESS_TTL_S = 7 * 24 * 3600


async def score_file(
    ctx: dict[str, Any],
    input_path: str,
    output_path: str,
    mode: str = "logprobs",
    top_k: int | None = None,
    max_tokens: int | None = None,
    temperature: float = 1.0,
    seed: int | None = None,
    concurrency: int | None = None,
    shard_rows: int | None = None,
    model: str | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """arq job: score ``input_path`` into ``output_path`` (resumable, like ``lmpool-score``).

    Returns the counters (``total``, ``done``, ``completed``, ``skipped``, ``failed``...) and
    the paths. Failed lines are in ``errors`` and retried by the next run; the job itself
    fails only when the output cannot be written or no worker serves the model.
    """
    from producer.remote_lm import RemoteLM
    from producer.score import (
        DEFAULT_CONCURRENCY,
        DEFAULT_MAX_TOKENS,
        DEFAULT_SHARD_ROWS,
        ScoreOptions,
        ScoreStats,
        errors_path,
        score_jsonl,
    )

    pool = ctx["lmpool"]
    settings = pool.settings
    options = ScoreOptions(
        mode=mode,
        top_k=top_k,
        max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        temperature=temperature,
        seed=seed,
        concurrency=concurrency or DEFAULT_CONCURRENCY,
        shard_rows=shard_rows or DEFAULT_SHARD_ROWS,
    )
    key = Keys(settings.key_prefix).job_progress(str(ctx["job_id"]))
    redis = pool.redis
    stats = ScoreStats()
    paths = {"input": input_path, "output": output_path, "errors": str(errors_path(output_path))}

    async def report(state: str, **extra: Any) -> None:
        fields = {**stats.as_dict(), **paths, **extra, "state": state, "updated_at": time.time()}
        pipe = redis.pipeline(transaction=True)
        pipe.hset(key, mapping={k: str(v) for k, v in fields.items()})
        pipe.expire(key, PROGRESS_TTL_S)
        await pipe.execute()

    async def reporter() -> None:
        while True:
            await asyncio.sleep(PROGRESS_PERIOD_S)
            try:
                await report("running")
            except Exception:
                log.warning("cannot record progress of %s", key, exc_info=True)

    await report("starting")
    ticker = asyncio.create_task(reporter(), name="lmpool-job-progress")
    try:
        lm = await RemoteLM.connect(
            settings.redis_url,
            model or pool.model,
            timeout_s,
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
        await report(state, error=f"{type(e).__name__}: {e}")
        raise
    ticker.cancel()
    await asyncio.gather(ticker, return_exceptions=True)
    await report("finished")
    log.info("score_file %s -> %s: %s", input_path, output_path, stats.summary())
    return {**stats.as_dict(), **paths}
