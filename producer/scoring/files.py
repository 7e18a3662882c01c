"""The files of one output ``OUT``: where they are, and reading a JSONL one back.

``OUT`` (JSONL, one line per finished input line), ``OUT.errors.jsonl`` (the lines that failed),
``OUT.run.json`` (what its lines were computed with: the model, the mode and the settings that
decide a line's result) and, for full vectors, the ``.npy`` shards in ``OUT.d/``. Every JSONL
file is append-only and written a whole line at a time, so a kill can only leave a torn last
line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from shared.errors import LMPoolError

SHARD_DIR_SUFFIX = ".d"
ERRORS_SUFFIX = ".errors.jsonl"
RUN_SUFFIX = ".run.json"
T = TypeVar("T")


class OutputError(LMPoolError):
    """The output cannot be resumed: another mode or other settings, a shard that disagrees
    with its index, or another run writing it."""


def errors_path(output_path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output_path)}{ERRORS_SUFFIX}")


def run_path(output_path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output_path)}{RUN_SUFFIX}")


def shard_dir(output_path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output_path)}{SHARD_DIR_SUFFIX}")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete lines of an append-only JSONL file (a torn last line, without its newline, is
    left out)."""
    records, _ = scan_jsonl(path, lambda record: record)
    return records


def scan_jsonl(path: Path, keep: Callable[[dict[str, Any]], T]) -> tuple[list[T], int | None]:
    """``keep(record)`` of each complete line, read a line at a time (a resume of millions of
    lines holds what ``keep`` returns, not the lines; ``keep`` may refuse a record by raising),
    and where a torn last line begins (None: there is none).

    A kill cuts a line short of its newline; a last line without one that is whole JSON is
    checked by ``keep`` like the others (a line of this output whose newline was not written)
    and counted as torn; one ``keep`` refuses, or one that is no result, raises ``OutputError``:
    the file is not an output to repair (an input given as OUTPUT), and stays as it is.
    """
    if not path.exists():
        return [], None
    out: list[T] = []
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                try:
                    record = json.loads(raw)
                except ValueError:
                    return out, offset  # cut short by a kill
                keep(_result(record, path, n))
                return out, offset
            offset += len(raw)
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError:
                raise OutputError(f"{path}:{n} is not JSON; the output is damaged") from None
            out.append(keep(_result(record, path, n)))
    return out, None


def _result(record: Any, path: Path, n: int) -> dict[str, Any]:
    if not isinstance(record, dict) or "id" not in record:
        raise OutputError(f"{path}:{n} is not an lmpool-score result")
    return record
