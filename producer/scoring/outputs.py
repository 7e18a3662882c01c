"""Writing the output and resuming it: lock, repair after a kill, the ids already done."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

import numpy as np

from producer.scoring.files import OutputError, run_path, scan_jsonl, shard_dir
from producer.scoring.options import Key, ScoreOptions
from producer.scoring.shards import ShardStore


class Output:
    """The output of one run: locked, repaired, and the ids already done."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        options: ScoreOptions,
        vocab_size: int,
        model: str | None = None,
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        try:
            _lock(self.file, self.path)
            first: list[dict[str, Any]] = []

            def keep(record: dict[str, Any]) -> tuple[Key, Any, Any]:
                if options.signature not in record:
                    raise OutputError(
                        f"{self.path} holds results of another mode (a line without "
                        f"{options.signature!r}); pick another output or that mode"
                    )
                if not first:
                    first.append(record)
                return record["id"], record.get("shard"), record.get("row")

            done, torn_at = scan_jsonl(self.path, keep)
            if first and options.top_k is not None:
                k = min(options.top_k, vocab_size)
                if len(first[0]["top_ids"]) != k:
                    raise OutputError(f"{self.path} holds top-{len(first[0]['top_ids'])} lines")
            _keep_run_settings(self.path, {"model": model, **options.decisive}, bool(done))
            if torn_at is not None:  # only now: the file is known to be this output
                os.truncate(self.path, torn_at)
            self.done: set[Key] = {key for key, _, _ in done}
            self.shards = (
                ShardStore(
                    shard_dir(self.path),
                    vocab_size,
                    options.shard_rows,
                    [(shard, row) for _, shard, row in done],
                )
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


def _keep_run_settings(path: Path, settings: dict[str, Any], resuming: bool) -> None:
    """Record what ``path``'s lines are computed with; resuming with anything else (another
    model, ``--max-tokens``, ``--temperature``, ``--seed``, ``--top-k``) is refused, so that
    one output never mixes them. An output without a record (none written yet) gets one."""
    record = run_path(path)
    if resuming and record.exists():
        before = json.loads(record.read_text())
        changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
        if changed:
            said = ", ".join(f"{k} {old!r} there, {new!r} now" for k, (old, new) in changed.items())
            raise OutputError(
                f"{path} was computed with other settings ({said}); resume it with the same "
                "ones, or pick another output"
            )
        return
    tmp = record.with_name(record.name + ".tmp")
    tmp.write_text(json.dumps(settings, indent=1) + "\n")
    os.replace(tmp, record)


def _lock(f: IO[bytes], path: Path) -> None:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise OutputError(f"another lmpool-score run is writing {path}") from None
