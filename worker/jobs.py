"""Offline arq jobs run by the workers: the one place in ``worker/`` that imports ``producer/``.

``score_file`` is ``lmpool-score`` as a job: the same code (:mod:`producer.scoring`), with a
``RemoteLM`` on the worker's own Redis at ``priority="low"``, so the job's requests are served
by the whole pool after interactive work. Its arguments (``ScoreFileArgs``), body, progress
hash and enqueuer (``enqueue_score_file``) are defined once, in :mod:`producer.scoring.job`.
"""

from __future__ import annotations

from typing import Any

from producer.scoring.job import ScoreFileArgs, pack_job, run_score_file, unpack_job

__all__ = ["pack_job", "score_file", "unpack_job"]


async def score_file(
    ctx: dict[str, Any], input_path: str, output_path: str, **options: Any
) -> dict[str, Any]:
    """arq job: score ``input_path`` into ``output_path`` (resumable, like ``lmpool-score``).

    ``options`` are the fields of ``ScoreFileArgs`` (``mode``, ``top_k``, ...; an unknown one
    fails the job with ``TypeError``). Returns the counters and the paths.
    """
    pool = ctx["lmpool"]
    return await run_score_file(
        pool.redis,
        pool.settings,
        str(ctx["job_id"]),
        input_path,
        output_path,
        ScoreFileArgs.from_kwargs(options),
        default_model=pool.model,
    )
