"""The run: every input line not yet in the output, through a ``RemoteLM``, at most
``concurrency`` requests in flight (fewer while the pool cannot answer that many within the
request timeout, ``producer.scoring.window``).

The ``RemoteLM`` is the caller's; ``lmpool-score`` and the arq job ``score_file`` open it with
``priority="low"`` and no local cache, so workers serve these requests after interactive work.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from producer.remote_lm import RemoteLM
from producer.scoring.files import errors_path
from producer.scoring.inputs import (
    Item,
    LineError,
    check_input,
    count_lines,
    iter_lines,
    make_item,
    read_line,
)
from producer.scoring.options import Key, ScoreOptions
from producer.scoring.outputs import Output
from producer.scoring.window import Window
from shared.errors import InvalidRequest, LMPoolError, RequestTimeout


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


def error_text(e: BaseException) -> str:
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
    check_input(input_path)
    output = await asyncio.to_thread(Output, output_path, options, lm.vocab_size, lm.model)
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
        window = Window(options.concurrency, lm.timeout_s)

        def fail(key: Key, lineno: int, e: BaseException) -> None:
            record = {"id": key, "line": lineno, "error": error_text(e)}
            errors.write(json.dumps(record).encode() + b"\n")
            errors.flush()
            stats.failed += 1
            if progress is not None:
                progress(stats)

        async def run(item: Item) -> None:
            try:
                tries = 0
                while True:
                    tries += 1
                    sent_at = time.monotonic()
                    try:
                        result = await compute(lm, item, options)
                        break
                    except RequestTimeout as e:  # a long queue, or a pool that does not answer
                        if window.timed_out(sent_at, tries):
                            continue
                        fail(item.key, item.line, window.why(e, sent_at, tries))
                        return
                    except (LMPoolError, ValueError, TypeError) as e:
                        fail(item.key, item.line, e)
                        return
                window.answered()
                if isinstance(result, np.ndarray):
                    output.write_vector(item.key, result)
                else:
                    output.write(result)
                stats.done += 1
                if progress is not None:
                    progress(stats)
            finally:
                window.release()

        def finished(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                fatal.append(task.exception())  # type: ignore[arg-type]

        seen: set[Key] = set()
        for lineno, raw in iter_lines(input_path):
            if lineno % 1024 == 0:
                await asyncio.sleep(0)  # skipping done lines never waits: let others run
            try:
                key, obj = read_line(raw, lineno)
            except LineError as e:  # named by its line number, which is no id: not in seen
                fail(e.key, lineno, e.error)
                continue
            if key in seen:
                fail(key, lineno, InvalidRequest(f"id {key!r} appears on more than one line"))
                continue
            seen.add(key)
            if key in output.done:
                stats.skipped += 1  # not even tokenized
                continue
            try:
                item = make_item(obj, key, lineno, options, lm.tokenizer)
            except LineError as e:
                fail(key, lineno, e.error)
                continue
            await window.acquire()
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
