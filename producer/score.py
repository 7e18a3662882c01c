"""Offline batch scoring: a JSONL file of prompts through the pool, resumable after any kill.

Run as ``lmpool-score IN.jsonl OUT [options]`` or ``python -m producer.score IN.jsonl OUT``.

Input, one JSON object a line: ``ids`` (token ids) or ``text`` (tokenized with the pool's
tokenizer, ``lm.tokenizer.encode``), optional ``id`` (a string or integer; default the 1-based
line number), for ``--mode score`` a ``continuation`` (ids) or ``continuation_text``, for
``--mode sample`` an optional ``seed`` that overrides ``--seed``. Blank lines are ignored.

Modes and outputs (``OUT`` is always a JSONL file with one line per finished input line, in
completion order, each with the line's ``id``):

* ``logprobs --top-k K``: ``{"id", "top_ids", "top_logprobs"}``, the K most likely next tokens.
* ``logprobs`` (full vectors): ``OUT`` is an index ``{"id", "shard", "row"}`` and the vectors
  are ``.npy`` shards ``OUT.d/shard-00000.npy``..., each float32 ``[rows, vocab_size]``
  (``--shard-rows`` rows at most). Load everything in one line::

      ids, X = producer.score.load_logprobs("OUT")   # X[i] is the distribution of ids[i]

  or one shard with plain numpy: ``np.load("OUT.d/shard-00000.npy", mmap_mode="r")``.
* ``sample``: ``{"id", "tokens", "text"}`` (``--max-tokens``, ``--temperature``, ``--seed``).
* ``score``: ``{"id", "logprobs", "total"}``, log p of each continuation token and their sum.

JSONL outputs load with ``[json.loads(line) for line in open("OUT")]`` (or
``pandas.read_json("OUT", lines=True)``).

Resuming: a result is written (and flushed) only once complete, so re-running with the same
``OUT`` skips every line already there and never writes a line twice. A line torn by a kill is
detected and dropped (and rows of a shard that no index line names are cut off). Lines that
failed are listed in ``OUT.errors.jsonl`` with the error, the run exits with status 1, and the
next run retries them. A lock on ``OUT`` stops two runs from writing it at once.

Requests go with ``priority="low"``: workers serve them after interactive work. At most
``--concurrency`` requests are in flight. The same code runs as the arq job
``score_file`` (:mod:`worker.jobs`); :func:`enqueue_score_file` submits it and
:func:`read_job_progress` reads its progress.

This module is the scorer's public face (and ``python -m producer.score``); the code lives in
:mod:`producer.scoring`.
"""

from producer.scoring.cli import main
from producer.scoring.files import OutputError
from producer.scoring.job import ScoreFileArgs, enqueue_score_file, read_job_progress
from producer.scoring.options import ScoreOptions
from producer.scoring.run import ScoreStats, score_jsonl
from producer.scoring.shards import load_logprobs

__all__ = [
    "OutputError",
    "ScoreFileArgs",
    "ScoreOptions",
    "ScoreStats",
    "enqueue_score_file",
    "load_logprobs",
    "main",
    "read_job_progress",
    "score_jsonl",
]

if __name__ == "__main__":
    raise SystemExit(main())
