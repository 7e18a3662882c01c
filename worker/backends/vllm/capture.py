"""Full-vocabulary log-prob rows out of vLLM: a logits processor and the store it writes to.

This module is imported by vLLM in the process that runs the model (the engine core's model
executor: a child process of the worker unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), by
qualified name, through two public engine arguments:

- ``logits_processors=[LogprobsCapture]``: sees each step's raw float32 logits,
  ``[requests in the step, V]``; for every request whose ``SamplingParams.extra_args`` carries a
  capture tag (``CAPTURE_KEY``) it writes ``log_softmax`` of its row to this module's store. A
  prompt prefilled over several steps is written at each of them; the last write, at the step
  that completes the prompt, is the one kept. It changes no logits.
- ``worker_extension_cls=CaptureExtension``: vLLM mixes it into its worker class, so that the
  backend can call ``collective_rpc("lmpool_take_rows", args=(tags, drop))`` and get the rows
  back across the process boundary, on vLLM's own channel (ZMQ + msgpack between this
  process and the engine core; vLLM's message queue between the engine core and its model
  worker): by tag, or every row captured so far. Rows travel as one float32 byte string with
  its shape and tags, plain msgpack types.

``SamplingParams(logprobs=-1)`` would give the same numbers, but vLLM turns every one of the V
values into a Python object per request: far too slow for a vocabulary-sized row.

vLLM has two model runners with two processor interfaces (V1: ``vllm.v1.sample.logits_processor``;
V2, the default on GPU: ``vllm.v1.worker.gpu.sample.logits_processor``); the capture class
implements both.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from vllm.v1.sample.logits_processor import LogitsProcessor as _V1Processor
from vllm.v1.sample.logits_processor import MoveDirectionality

try:
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as _V2Processor
except ImportError:  # pragma: no cover - vLLM without the V2 model runner
    _V2Processor = object

CAPTURE_KEY = "lmpool_capture"
"""``SamplingParams.extra_args`` key whose value tags a request whose row is captured."""
PROCESSOR = f"{__name__}:LogprobsCapture"
"""The processor's qualified name, as ``logits_processors=`` takes it."""
EXTENSION = f"{__name__}.CaptureExtension"
"""The worker extension's qualified name, as ``worker_extension_cls=`` takes it."""
TAKE = "lmpool_take_rows"
"""The extension method the backend calls through ``collective_rpc``."""
PROBE = "lmpool_capture_probe"

_lock = threading.Lock()
_rows: dict[str, torch.Tensor] = {}
"""Captured log-prob rows by tag, written by the processor, taken by the backend."""
_built = 0
"""Capture processors vLLM has built in this process."""


def store(tags: list[str], block: torch.Tensor) -> None:
    with _lock:
        for j, tag in enumerate(tags):
            _rows[tag] = block[j]


def take(tags: list[str], drop: Sequence[str] = ()) -> list[torch.Tensor | None]:
    """The rows of ``tags`` (None where none was captured), removed from the store; the rows
    of ``drop`` (aborted requests) are discarded."""
    with _lock:
        for tag in drop:
            _rows.pop(tag, None)
        return [_rows.pop(tag, None) for tag in tags]


def take_all() -> tuple[list[str], list[torch.Tensor | None]]:
    """Every row in the store, removed from it."""
    with _lock:
        tags = list(_rows)
        rows: list[torch.Tensor | None] = [_rows.pop(tag) for tag in tags]
        return tags, rows


def pack(tags: list[str], rows: list[torch.Tensor | None]) -> dict[str, Any]:
    """Rows as plain msgpack types: ``found`` (the tags that had a row, in order), ``shape``
    and ``data`` (float32 bytes, C order)."""
    found = [tag for tag, row in zip(tags, rows, strict=True) if row is not None]
    present = [row for row in rows if row is not None]
    if not present:
        return {"found": [], "shape": [0, 0], "data": b""}
    block = torch.stack(present).float().cpu().contiguous()
    return {"found": found, "shape": list(block.shape), "data": block.numpy().tobytes()}


def unpack(packed: dict[str, Any]) -> dict[str, torch.Tensor]:
    """:func:`pack`'s rows by tag (one copy out of the message buffer)."""
    found = list(packed.get("found") or [])
    if not found:
        return {}
    n, v = (int(x) for x in packed["shape"])
    array = np.frombuffer(packed["data"], dtype=np.float32).reshape(n, v)
    block = torch.from_numpy(array.copy())
    return dict(zip(found, block, strict=True))


def _tag_of(params: Any) -> str | None:
    extra = getattr(params, "extra_args", None)
    tag = extra.get(CAPTURE_KEY) if extra else None
    return tag if isinstance(tag, str) else None


class LogprobsCapture(_V1Processor, _V2Processor):
    """Writes ``log_softmax`` of the rows of tagged requests to the module's store.

    Changes no logits. V1 runner: ``update_state`` tracks persistent-batch index -> tag and
    ``apply(logits)`` gets one row per request of the step, in that order. V2 runner:
    ``add_request`` tracks request slot -> tag and ``apply(logits, ctx)`` maps rows to slots
    through ``ctx``.
    """

    def __init__(self, vllm_config: Any, *args: Any) -> None:
        global _built
        self._tags: dict[int, str] = {}
        with _lock:
            _built += 1

    # -- V1 interface --------------------------------------------------------------------
    def is_argmax_invariant(self) -> bool:
        # False puts it with the processors vLLM always applies, before penalties and
        # temperature, even for greedy requests.
        return False

    def update_state(self, batch_update: Any) -> None:
        if batch_update is None:
            return
        tags = self._tags
        for index in batch_update.removed:
            tags.pop(index, None)
        for index, params, _, _ in batch_update.added:
            tag = _tag_of(params)
            if tag is None:
                tags.pop(index, None)
            else:
                tags[index] = tag
        for a, b, direction in batch_update.moved:
            tag_a, tag_b = tags.pop(a, None), tags.pop(b, None)
            if tag_a is not None:
                tags[b] = tag_a
            if tag_b is not None and direction == MoveDirectionality.SWAP:
                tags[a] = tag_b

    # -- V2 interface --------------------------------------------------------------------
    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        tag = _tag_of(sampling_params)
        if tag is None:
            self._tags.pop(req_idx, None)
            return False
        self._tags[req_idx] = tag
        return True

    def apply_staged_writes(self) -> None:
        pass

    # -- both ----------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        if not self._tags:
            return logits
        n = logits.shape[0]
        if ctx is None:
            pairs = [(row, tag) for row, tag in self._tags.items() if row < n]
        else:
            slots = ctx.idx_mapping_np
            if len(slots) != n:  # several rows per request (speculative decoding)
                slots = ctx.expanded_idx_mapping.cpu().numpy()
            # A request's rows are consecutive: the last one is written last.
            pairs = [
                (row, tag)
                for row, slot in enumerate(slots.tolist())
                if (tag := self._tags.get(slot)) is not None
            ]
        if pairs:
            index = torch.tensor([row for row, _ in pairs], device=logits.device)
            block = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
            store([tag for _, tag in pairs], block)
        return logits


class CaptureExtension:
    """Methods vLLM adds to its worker class (``worker_extension_cls``), called through
    ``collective_rpc``: they run in the process where :class:`LogprobsCapture` writes."""

    def lmpool_take_rows(
        self, tags: list[str], drop: list[str], everything: bool = False
    ) -> dict[str, Any]:
        """The rows of ``tags`` (or, with ``everything``, every row captured so far), packed;
        only tensor-parallel rank 0 answers (every rank captures the same rows)."""
        if everything:
            take(drop=drop, tags=[])
            tags, rows = take_all()
        else:
            rows = take(tags, drop)
        if int(getattr(self, "rank", 0)) != 0:
            return pack([], [])
        return pack(tags, rows)

    def lmpool_capture_probe(self) -> dict[str, int]:
        """This process's id and how many capture processors vLLM built in it."""
        with _lock:
            return {"pid": os.getpid(), "processors": _built, "stored": len(_rows)}
