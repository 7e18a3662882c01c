"""Full distributions on disk: ``.npy`` shards that stay loadable after every row.

``OUT.d/shard-00000.npy``, ... each float32 ``[rows, vocab_size]``, with at most ``shard_rows``
rows; ``OUT`` indexes them (``{"id", "shard", "row"}``). :func:`load_logprobs` reads them back.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import IO, Any

import numpy as np

from producer.scoring.files import OutputError, read_jsonl, shard_dir
from producer.scoring.options import Key

NPY_HEADER_BYTES = 128
"""Every shard's ``.npy`` header has this fixed size, so the row count can be rewritten."""


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

    def __init__(self, directory: Path, cols: int, shard_rows: int, index: list[tuple[Any, Any]]):
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

    def _repair(self, index: list[tuple[Any, Any]]) -> dict[int, int]:
        """Cut each shard to the rows its index names (``(shard, row)`` of each line);
        ``{shard number: rows}``."""
        wanted: dict[str, int] = {}
        for shard, row in index:
            if not isinstance(shard, str) or not isinstance(row, int):
                raise OutputError(f"an index line names no shard row: {shard!r}, {row!r}")
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


def load_logprobs(output_path: str | os.PathLike[str]) -> tuple[list[Key], np.ndarray]:
    """``(ids, X)`` of a full-vector output: ``X[i]`` (float32) is the distribution of ids[i]."""
    records = read_jsonl(Path(output_path))
    directory = shard_dir(output_path)
    by_shard: dict[str, tuple[list[int], list[int]]] = {}
    for position, record in enumerate(records):
        if "shard" not in record:
            raise OutputError(
                f"{output_path} holds no distributions (line {position + 1} names no shard: an "
                "output of --top-k, sample or score mode): read it as JSONL"
            )
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
