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
from pathlib import Path
from typing import Any

from shared.errors import LMPoolError

SHARD_DIR_SUFFIX = ".d"
ERRORS_SUFFIX = ".errors.jsonl"
RUN_SUFFIX = ".run.json"


class OutputError(LMPoolError):
    """The output cannot be resumed: another mode or other settings, a shard that disagrees
    with its index, or another run writing it."""


def errors_path(output_path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output_path)}{ERRORS_SUFFIX}")


def run_path(output_path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output_path)}{RUN_SUFFIX}")


def shard_dir(output_path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(output_path)}{SHARD_DIR_SUFFIX}")


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
