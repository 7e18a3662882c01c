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
``score_file`` (:mod:`worker.jobs`); :func:`enqueue_score_file` submits it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeAlias

import msgpack
import numpy as np
import torch

from producer.remote_lm import RemoteLM
from shared.errors import InvalidRequest, LMPoolError

Key: TypeAlias = int | str
MODES = ("logprobs", "sample", "score")
DEFAULT_CONCURRENCY = 256
DEFAULT_SHARD_ROWS = 1024
DEFAULT_MAX_TOKENS = 32
SHARD_DIR_SUFFIX = ".d"
ERRORS_SUFFIX = ".errors.jsonl"
NPY_HEADER_BYTES = 128
"""Every shard's ``.npy`` header has this fixed size, so the row count can be rewritten."""


class OutputError(LMPoolError):
    """The output cannot be resumed: another mode, a shard that disagrees with its index, or
    another run writing it."""


# -- options and counters ---------------------------------------------------------------------
@dataclass(frozen=True)
class ScoreOptions:
    """What to compute for every line (the CLI flags and the arq job's keyword arguments)."""

    mode: str = "logprobs"
    top_k: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    seed: int | None = None
    concurrency: int = DEFAULT_CONCURRENCY
    shard_rows: int = DEFAULT_SHARD_ROWS

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        if self.top_k is not None and (self.mode != "logprobs" or self.top_k < 1):
            raise ValueError("top_k needs mode 'logprobs' and must be >= 1")
        if self.max_tokens < 1 or self.concurrency < 1 or self.shard_rows < 1:
            raise ValueError("max_tokens, concurrency and shard_rows must be >= 1")
        if not self.temperature > 0:
            raise ValueError("temperature must be > 0")

    @property
    def full_vectors(self) -> bool:
        """Whole next-token distributions, stored in ``.npy`` shards."""
        return self.mode == "logprobs" and self.top_k is None

    @property
    def signature(self) -> str:
        """The field every output line of this mode has (checked when resuming)."""
        if self.full_vectors:
            return "shard"
        return {"logprobs": "top_ids", "sample": "tokens", "score": "logprobs"}[self.mode]


@dataclass
class ScoreStats:
    """Counters of one run; ``done`` counts lines finished by this run only."""

    total: int = 0
    """Non-blank lines in the input."""
    skipped: int = 0
    """Lines found in the output already (done by an earlier run)."""
    done: int = 0
    failed: int = 0
    known_done: int = 0
    """Lines in the output when the run started."""
    started: float = field(default_factory=time.monotonic)

    @property
    def rate(self) -> float:
        """Lines finished per second by this run."""
        return self.done / max(time.monotonic() - self.started, 1e-9)

    @property
    def finished(self) -> int:
        """Lines that have a result in the output now."""
        return self.skipped + self.done

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "done": self.finished,
            "completed": self.done,
            "skipped": self.skipped,
            "failed": self.failed,
            "rate": round(self.rate, 3),
            "elapsed_s": round(time.monotonic() - self.started, 3),
        }

    def summary(self) -> str:
        return (
            f"{self.total} lines: {self.done} done, {self.skipped} skipped (already done), "
            f"{self.failed} failed"
        )


def errors_path(output_path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output_path)}{ERRORS_SUFFIX}")


def shard_dir(output_path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output_path)}{SHARD_DIR_SUFFIX}")


# -- input ------------------------------------------------------------------------------------
@dataclass
class Item:
    """One input line, ready to request."""

    key: Key
    line: int
    prompt: list[int]
    continuation: list[int] | None = None
    seed: int | None = None


class LineError(Exception):
    """An input line that cannot be requested; ``key`` names it in the errors file."""

    def __init__(self, key: Key, error: BaseException) -> None:
        super().__init__(str(error))
        self.key = key
        self.error = error


def iter_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes]]:
    """``(1-based line number, raw line)`` for every non-blank line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                yield lineno, raw


def count_lines(path: str | os.PathLike[str]) -> int:
    return sum(1 for _ in iter_lines(path))


def line_key(obj: Any, lineno: int) -> Key:
    """The line's ``id``, or its line number."""
    if not isinstance(obj, dict) or "id" not in obj:
        return lineno
    key = obj["id"]
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise LineError(lineno, InvalidRequest(f"id must be a string or an integer, not {key!r}"))
    return key


def _token_ids(obj: dict[str, Any], ids_field: str, text_field: str, tokenizer: Any) -> list[int]:
    if ids_field in obj:
        ids = obj[ids_field]
        if not isinstance(ids, list):
            raise InvalidRequest(f"{ids_field!r} must be a list of token ids")
        return ids
    if text_field in obj:
        text = obj[text_field]
        if not isinstance(text, str):
            raise InvalidRequest(f"{text_field!r} must be a string")
        return list(tokenizer.encode(text))
    raise InvalidRequest(f"line has neither {ids_field!r} nor {text_field!r}")


def read_line(raw: bytes, lineno: int) -> tuple[Key, Any]:
    """``(key, parsed JSON)`` of one input line; ``LineError`` (named by the line number) when
    it is not JSON or its ``id`` is unusable."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise LineError(lineno, InvalidRequest(f"line {lineno} is not JSON: {e}")) from None
    return line_key(obj, lineno), obj


def make_item(obj: Any, key: Key, lineno: int, options: ScoreOptions, tokenizer: Any) -> Item:
    """The request of one parsed line; ``LineError`` when it has none."""
    try:
        if not isinstance(obj, dict):
            raise InvalidRequest(f"line {lineno} is not a JSON object")
        item = Item(key, lineno, _token_ids(obj, "ids", "text", tokenizer))
        if options.mode == "score":
            item.continuation = _token_ids(obj, "continuation", "continuation_text", tokenizer)
        if options.mode == "sample":
            seed = obj.get("seed", options.seed)
            if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
                raise InvalidRequest(f"seed must be an integer, not {seed!r}")
            item.seed = seed
        return item
    except InvalidRequest as e:
        raise LineError(key, e) from None


def parse_line(raw: bytes, lineno: int, options: ScoreOptions, tokenizer: Any) -> Item:
    """The request of one input line; ``LineError`` when it has none."""
    key, obj = read_line(raw, lineno)
    return make_item(obj, key, lineno, options, tokenizer)


# -- output -----------------------------------------------------------------------------------
def read_jsonl(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """Complete lines of an append-only JSONL file; a torn last line (no newline) is ignored,
    and with ``repair`` cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data) and repair:
        os.truncate(path, end)
    records = []
    for n, raw in enumerate(data[:end].splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            raise OutputError(f"{path}:{n} is not JSON; the output is damaged") from None
        if not isinstance(record, dict) or "id" not in record:
            raise OutputError(f"{path}:{n} is not an lmpool-score result")
        records.append(record)
    return records


def _npy_header(rows: int, cols: int) -> bytes:
    """A ``.npy`` version 1.0 header of exactly ``NPY_HEADER_BYTES`` for float32 [rows, cols]."""
    text = f"{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}"
    text = text.ljust(NPY_HEADER_BYTES - 11) + "\n"
    header = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")
    assert len(header) == NPY_HEADER_BYTES, "shard header overflow"
    return header


def _write_all(f: IO[bytes], data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = f.write(view)
        view = view[n or 0 :]


class ShardStore:
    """Appends float32 rows to ``.npy`` shards that stay loadable after every row.

    Each row is written after the previous ones, then the header's row count is rewritten;
    the index line naming the row is written only after that, so every indexed row is whole.
    """

    def __init__(self, directory: Path, cols: int, shard_rows: int, index: list[dict[str, Any]]):
        self.dir = directory
        self.cols = cols
        self.shard_rows = shard_rows
        self.row_bytes = 4 * cols
        self.dir.mkdir(parents=True, exist_ok=True)
        numbers = self._repair(index)
        last = max(numbers, default=-1)
        self.number = last if last >= 0 and numbers[last] < shard_rows else last + 1
        self.rows = numbers.get(self.number, 0)
        self.file: IO[bytes] | None = None

    @staticmethod
    def name(number: int) -> str:
        return f"shard-{number:05d}.npy"

    def _repair(self, index: list[dict[str, Any]]) -> dict[int, int]:
        """Cut each shard to the rows its index names; ``{shard number: rows}``."""
        wanted: dict[str, int] = {}
        for record in index:
            shard, row = record.get("shard"), record.get("row")
            if not isinstance(shard, str) or not isinstance(row, int):
                raise OutputError(f"index line {record!r} names no shard row")
            wanted[shard] = max(wanted.get(shard, 0), row + 1)
        numbers: dict[int, int] = {}
        for path in sorted(self.dir.glob("shard-*.npy")):
            rows = wanted.pop(path.name, 0)
            if rows == 0:
                path.unlink()  # created, but no row of it was recorded
                continue
            with open(path, "r+b", buffering=0) as f:
                head = f.read(NPY_HEADER_BYTES)
                f.seek(0)
                try:
                    if np.lib.format.read_magic(f) != (1, 0):
                        raise ValueError("not a version 1.0 header")
                    shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                except ValueError:
                    shape, dtype = (), None
                if f.tell() != NPY_HEADER_BYTES or dtype != np.dtype("<f4") or len(shape) != 2:
                    raise OutputError(f"{path} is not a shard written by lmpool-score")
                if shape[1] != self.cols:
                    raise OutputError(
                        f"{path} has rows of {shape[1]} values; the model's vocabulary has "
                        f"{self.cols}: the output belongs to another model"
                    )
                have = (os.fstat(f.fileno()).st_size - NPY_HEADER_BYTES) // self.row_bytes
                if have < rows:
                    raise OutputError(f"{path} has {have} rows; its index names {rows}")
                f.truncate(NPY_HEADER_BYTES + rows * self.row_bytes)
                if head != _npy_header(rows, self.cols):
                    f.seek(0)
                    _write_all(f, _npy_header(rows, self.cols))
            numbers[int(path.stem.split("-")[1])] = rows
        if wanted:
            raise OutputError(f"shards {sorted(wanted)} named by the index are missing")
        return numbers

    def append(self, row: np.ndarray) -> tuple[str, int]:
        """Write one row; returns ``(shard file name, row number)`` once it is on disk."""
        data = np.ascontiguousarray(row, dtype="<f4")
        if data.shape != (self.cols,):
            raise ValueError(f"row of shape {data.shape}, expected ({self.cols},)")
        if self.rows >= self.shard_rows:
            self._close_file()
            self.number += 1
            self.rows = 0
        if self.file is None:
            path = self.dir / self.name(self.number)
            if not path.exists():
                path.write_bytes(_npy_header(0, self.cols))
            self.file = open(path, "r+b", buffering=0)  # noqa: SIM115 - kept open across rows
        f = self.file
        f.seek(NPY_HEADER_BYTES + self.rows * self.row_bytes)
        _write_all(f, data.tobytes())
        f.seek(0)
        _write_all(f, _npy_header(self.rows + 1, self.cols))
        self.rows += 1
        return self.name(self.number), self.rows - 1

    def _close_file(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def close(self) -> None:
        self._close_file()


class Output:
    """The output of one run: locked, repaired, and the ids already done."""

    def __init__(self, path: str | os.PathLike[str], options: ScoreOptions, vocab_size: int):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        try:
            _lock(self.file, self.path)
            records = read_jsonl(self.path, repair=True)
            for record in records:
                if options.signature not in record:
                    raise OutputError(
                        f"{self.path} holds results of another mode (a line without "
                        f"{options.signature!r}); pick another output or that mode"
                    )
            if records and options.top_k is not None:
                k = min(options.top_k, vocab_size)
                if len(records[0]["top_ids"]) != k:
                    raise OutputError(f"{self.path} holds top-{len(records[0]['top_ids'])} lines")
            self.done: set[Key] = {r["id"] for r in records}
            self.shards = (
                ShardStore(shard_dir(self.path), vocab_size, options.shard_rows, records)
                if options.full_vectors
                else None
            )
        except BaseException:
            self.file.close()
            raise

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
        self.file.write(line)
        self.file.flush()

    def write_vector(self, key: Key, row: np.ndarray) -> None:
        assert self.shards is not None
        shard, index = self.shards.append(row)
        self.write({"id": key, "shard": shard, "row": index})

    def close(self) -> None:
        if self.shards is not None:
            self.shards.close()
        self.file.close()


def _lock(f: IO[bytes], path: Path) -> None:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OutputError(f"another lmpool-score run is writing {path}") from None


def load_logprobs(output_path: str | os.PathLike[str]) -> tuple[list[Key], np.ndarray]:
    """``(ids, X)`` of a full-vector output: ``X[i]`` (float32) is the distribution of ids[i]."""
    records = read_jsonl(Path(output_path))
    directory = shard_dir(output_path)
    by_shard: dict[str, tuple[list[int], list[int]]] = {}
    for position, record in enumerate(records):
        positions, rows = by_shard.setdefault(record["shard"], ([], []))
        positions.append(position)
        rows.append(record["row"])
    out: np.ndarray | None = None
    for shard, (positions, rows) in by_shard.items():
        data = np.load(directory / shard, mmap_mode="r")
        if out is None:
            out = np.empty((len(records), data.shape[1]), dtype=np.float32)
        out[positions] = data[rows]
    return [r["id"] for r in records], out if out is not None else np.empty((0, 0), np.float32)


# -- the run ----------------------------------------------------------------------------------
async def compute(lm: RemoteLM, item: Item, options: ScoreOptions) -> dict[str, Any] | np.ndarray:
    """The result of one line: a JSON record, or a full distribution (float32 array)."""
    if options.mode == "logprobs":
        row = await lm.next_token_logprobs(item.prompt)
        if options.top_k is None:
            return row.to(torch.float32).numpy()
        values, ids = torch.topk(row.to(torch.float32), min(options.top_k, row.shape[0]))
        return {"id": item.key, "top_ids": ids.tolist(), "top_logprobs": values.tolist()}
    if options.mode == "sample":
        tokens = await lm.sample(
            item.prompt,
            options.max_tokens,
            lm.eos_token_ids,
            temperature=options.temperature,
            seed=item.seed,
        )
        return {"id": item.key, "tokens": tokens, "text": lm.tokenizer.decode(tokens)}
    assert item.continuation is not None
    if not item.continuation:
        raise InvalidRequest("empty continuation")
    scores = (await lm.score(item.prompt, item.continuation)).to(torch.float32)
    return {"id": item.key, "logprobs": scores.tolist(), "total": float(scores.sum())}


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


async def score_jsonl(
    lm: RemoteLM,
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    options: ScoreOptions | None = None,
    progress: Callable[[ScoreStats], None] | None = None,
    stats: ScoreStats | None = None,
) -> ScoreStats:
    """Score every line of ``input_path`` not yet in ``output_path``; returns the counters.

    ``progress`` is called after each line this run finishes or fails; ``stats`` (updated as
    the run goes) may be passed in to watch it from elsewhere. Failed lines go to
    ``OUT.errors.jsonl`` (removed when none failed). Errors of the output itself (disk full,
    another mode) raise.
    """
    options = options or ScoreOptions()
    stats = stats if stats is not None else ScoreStats()
    # Reading back a long output or counting a long input would stall the event loop (in a
    # worker: its heartbeat), so both run in a thread.
    output = await asyncio.to_thread(Output, output_path, options, lm.vocab_size)
    err_path = errors_path(output_path)
    try:
        errors = open(err_path, "wb")  # noqa: SIM115 - closed below
    except BaseException:
        output.close()
        raise
    tasks: set[asyncio.Task[None]] = set()
    fatal: list[BaseException] = []
    try:
        stats.total = await asyncio.to_thread(count_lines, input_path)
        stats.known_done = len(output.done)
        stats.started = time.monotonic()
        slots = asyncio.Semaphore(options.concurrency)

        def fail(key: Key, lineno: int, e: BaseException) -> None:
            record = {"id": key, "line": lineno, "error": _error_text(e)}
            errors.write(json.dumps(record).encode() + b"\n")
            errors.flush()
            stats.failed += 1
            if progress is not None:
                progress(stats)

        async def run(item: Item) -> None:
            try:
                try:
                    result = await compute(lm, item, options)
                except (LMPoolError, ValueError, TypeError) as e:
                    fail(item.key, item.line, e)
                    return
                if isinstance(result, np.ndarray):
                    output.write_vector(item.key, result)
                else:
                    output.write(result)
                stats.done += 1
                if progress is not None:
                    progress(stats)
            finally:
                slots.release()

        def finished(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                fatal.append(task.exception())  # type: ignore[arg-type]

        seen: set[Key] = set()
        for lineno, raw in iter_lines(input_path):
            if lineno % 1024 == 0:
                await asyncio.sleep(0)  # skipping done lines never waits: let others run
            problem: BaseException | None = None
            try:
                key, obj = read_line(raw, lineno)
            except LineError as e:
                key, obj, problem = e.key, None, e.error
            if key in seen:
                fail(key, lineno, InvalidRequest(f"id {key!r} appears on more than one line"))
                continue
            seen.add(key)
            if key in output.done:
                stats.skipped += 1  # not even tokenized
                continue
            try:
                if problem is not None:
                    raise LineError(key, problem)
                item = make_item(obj, key, lineno, options, lm.tokenizer)
            except LineError as e:
                fail(key, lineno, e.error)
                continue
            await slots.acquire()
            if fatal:
                break
            task = asyncio.create_task(run(item))
            tasks.add(task)
            task.add_done_callback(finished)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if fatal:
            raise fatal[0]
        return stats
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        output.close()
        errors.close()
        if stats.failed == 0:
            err_path.unlink(missing_ok=True)


# -- arq ----------------------------------------------------------------------------------------
# The worker's own job serializer (worker/app.py): msgpack, never pickle.
_packb = functools.partial(msgpack.packb, use_bin_type=True)
_unpackb = functools.partial(msgpack.unpackb, raw=False, strict_map_key=False)
JOB_OPTIONS = (
    "mode",
    "top_k",
    "max_tokens",
    "temperature",
    "seed",
    "concurrency",
    "shard_rows",
    "model",
    "timeout_s",
)


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

    ``options`` are ``score_file``'s: ``mode``, ``top_k``, ``max_tokens``, ``temperature``,
    ``seed``, ``concurrency``, ``shard_rows``, ``model`` (default: the worker's own model),
    ``timeout_s``. Paths are made absolute here: the worker must see the same filesystem.
    """
    from arq import create_pool
    from arq.connections import RedisSettings

    from shared.keys import Keys
    from shared.settings import Settings

    unknown = set(options) - set(JOB_OPTIONS)
    if unknown:
        raise TypeError(f"unknown score_file options {sorted(unknown)}; known: {JOB_OPTIONS}")
    ScoreOptions(**{k: v for k, v in options.items() if k not in ("model", "timeout_s")})
    settings = Settings.from_env(redis_url=redis_url, key_prefix=key_prefix)
    queue = Keys(settings.key_prefix).arq_queue
    pool = await create_pool(
        RedisSettings.from_dsn(settings.redis_url),
        job_serializer=_packb,
        job_deserializer=_unpackb,
        default_queue_name=queue,
    )
    try:
        job = await pool.enqueue_job(
            "score_file",
            os.path.abspath(input_path),
            os.path.abspath(output_path),
            _job_id=job_id,
            _queue_name=queue,
            **options,
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
    from shared.keys import Keys
    from shared.redis_conn import connect_redis
    from shared.settings import Settings

    settings = Settings.from_env(redis_url=redis_url, key_prefix=key_prefix)
    redis = connect_redis(settings.redis_url)
    try:
        raw = await redis.hgetall(Keys(settings.key_prefix).job_progress(job_id))  # type: ignore[misc]
    finally:
        await redis.aclose()
    return {k.decode(): v.decode() for k, v in raw.items()}


# -- command line -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmpool-score",
        description="Score a JSONL file of prompts through the lmpool workers (resumable).",
        epilog="Formats, loading and resuming: python -c 'import producer.score; "
        "help(producer.score)' or README 'Offline scoring'.",
    )
    p.add_argument("input", nargs="?", help="JSONL prompts: ids or text, optional id")
    p.add_argument("output", nargs="?", help="JSONL results (index of OUT.d/ shards for vectors)")
    p.add_argument("--mode", choices=MODES, default="logprobs")
    p.add_argument("--top-k", type=int, help="logprobs: keep only the K most likely tokens")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="sample")
    p.add_argument("--temperature", type=float, default=1.0, help="sample")
    p.add_argument("--seed", type=int, help="sample: seed (a line's own 'seed' wins)")
    p.add_argument(
        "--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="requests in flight"
    )
    p.add_argument("--shard-rows", type=int, default=DEFAULT_SHARD_ROWS, help="rows per .npy")
    p.add_argument("--redis-url", help="default LMPOOL_REDIS_URL")
    p.add_argument("--model", help="model name the workers registered; default from LMPOOL_*")
    p.add_argument("--timeout-s", type=float, help="seconds per request; default LMPOOL_TIMEOUT_S")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--enqueue", action="store_true", help="run it as the arq job score_file; print its id"
    )
    p.add_argument("--job-status", metavar="JOB_ID", help="print a score_file job's progress")
    return p


def options_from_args(args: argparse.Namespace) -> ScoreOptions:
    return ScoreOptions(
        mode=args.mode,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        concurrency=args.concurrency,
        shard_rows=args.shard_rows,
    )


async def _run_cli(args: argparse.Namespace, options: ScoreOptions) -> ScoreStats:
    from tqdm import tqdm

    lm = await RemoteLM.connect(
        args.redis_url, args.model, args.timeout_s, cache_size=0, priority="low"
    )
    stats = ScoreStats()
    bar: Any = None
    last_failed = 0

    def progress(s: ScoreStats) -> None:
        nonlocal bar, last_failed
        if bar is None:
            tty = sys.stderr.isatty()
            bar = tqdm(
                total=s.total,
                initial=min(s.known_done, s.total),
                unit="line",
                dynamic_ncols=True,
                mininterval=0.1 if tty else 5.0,
                file=sys.stderr,
            )
        bar.update(1)
        if s.failed != last_failed:
            last_failed = s.failed
            bar.set_postfix(failed=s.failed, refresh=False)

    try:
        await score_jsonl(
            lm, args.input, args.output, options, None if args.no_progress else progress, stats
        )
    finally:
        if bar is not None:
            bar.close()
        await lm.close()
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.job_status:
        info = asyncio.run(read_job_progress(args.redis_url, args.job_status))
        print(json.dumps(info or {"job": args.job_status, "state": "unknown"}, indent=1))
        return 0 if info else 1
    if args.input is None or args.output is None:
        parser.error("INPUT and OUTPUT are needed")
    try:
        options = options_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    if args.enqueue:
        extra = {"model": args.model, "timeout_s": args.timeout_s}
        job = asyncio.run(
            enqueue_score_file(
                args.redis_url,
                args.input,
                args.output,
                **{k: getattr(options, k) for k in JOB_OPTIONS if hasattr(options, k)},
                **{k: v for k, v in extra.items() if v is not None},
            )
        )
        print(job)
        return 0
    try:
        stats = asyncio.run(_run_cli(args, options))
    except KeyboardInterrupt:
        print("interrupted; run again with the same output to resume", file=sys.stderr)
        return 130
    except (LMPoolError, OSError) as e:
        print(f"lmpool-score: {_error_text(e)}", file=sys.stderr)
        return 2
    print(stats.summary())
    if stats.failed:
        print(f"failed lines and their errors: {errors_path(args.output)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
