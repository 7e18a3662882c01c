"""Captured log-prob rows, fetched from the process where vLLM runs the model.

The capture logits processor (:mod:`.capture`) writes each ``logprobs`` and ``score``
request's full ``log_softmax`` row there; the rows come back through ``collective_rpc``
(vLLM's utility channel, served by the engine core between steps). While such works are in
the engine, one "every row so far" call is kept in flight, so that it is served right after
the running step and its rows arrive with that step's outputs; a row still missing then is
fetched by tag.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Container, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from worker.backends.base import EngineDead
from worker.backends.vllm.engine import EngineWatch


class RowFetcher:
    """Rows of finished ``logprobs`` and ``score`` requests, by tag (the request id);
    ``capture`` is the capture module, ``watch`` says whether the engine still lives. Used from
    the compute thread only."""

    def __init__(self, capture: Any, watch: EngineWatch) -> None:
        self._capture = capture
        self._watch = watch
        self._prefetch: tuple[Future[Any], float] | None = None
        self.ahead: dict[str, torch.Tensor] = {}
        """Rows fetched ahead of their works' outputs (:meth:`prefetch`)."""
        self.prefetches = 0
        self.transfer_s = 0.0
        """Time the compute thread spent fetching or waiting for captured rows."""
        self.transfers = 0
        self.transferred_rows = 0
        self.chunked = True
        """The engine may prefill a prompt over several steps (vLLM's chunked prefill, on
        unless its options turn it off): rows fetched ahead are checked against the store."""

    def prefetch(self, engine: Any, wanted: bool) -> None:
        """Ask, without waiting, for every row captured so far (``wanted``: such works
        are in the engine).

        vLLM's engine core serves utility calls between engine steps, so a fetch made once a
        step's outputs are in waits for the step that is running by then. Sent while a step
        runs, this call is served right after it: the rows of that step arrive with its
        outputs. One such call is in flight at a time, while such works are. It uses
        the client's utility channel the way ``collective_rpc`` does, without blocking (vLLM's
        sync client has no public non-blocking form); where that is not there (the engine core
        in this process), rows are fetched when their works finish.
        """
        if self._prefetch is not None:
            self.collect(wait=False)
        if self._prefetch is not None or not wanted:
            return
        core = engine.engine_core
        send = getattr(core, "_send_input", None)
        pending = getattr(core, "utility_results", None)
        if send is None or not isinstance(pending, dict):
            return
        from vllm.v1.engine import EngineCoreRequestType

        call_id = uuid.uuid1().int >> 64
        future: Future[Any] = Future()
        pending[call_id] = future
        args: tuple[Any, ...] = (self._capture.TAKE, None, ([], [], True), None)
        try:
            send(EngineCoreRequestType.UTILITY, (0, call_id, "collective_rpc", args))
        except Exception:
            pending.pop(call_id, None)
            return  # the engine is gone: the next step says so
        self._prefetch = (future, time.perf_counter())

    def collect(self, wait: bool) -> None:
        """The rows of the prefetch in flight into :attr:`ahead` (when it is done, or after
        waiting for it)."""
        if self._prefetch is None:
            return
        future, _ = self._prefetch
        if not wait and not future.done():
            return
        t0 = time.perf_counter()
        while True:
            try:
                replies = future.result(timeout=0.5)
                break
            except FutureTimeout:
                if self._watch.is_dead():
                    raise self._watch.gone() from None
            except Exception as e:
                self._prefetch = None
                if self._watch.is_dead() or isinstance(e, EngineDead):
                    raise self._watch.gone() from None
                raise self._watch.gone(e) from e
        self._prefetch = None
        for reply in replies or []:
            if reply and reply.get("found"):
                rows = self._capture.unpack(reply)
                self.ahead.update(rows)
                self.transferred_rows += len(rows)
                break
        self.transfers += 1
        self.transfer_s += time.perf_counter() - t0  # what the compute thread waited
        self.prefetches += 1

    def fetch(self, engine: Any, tags: list[str]) -> dict[str, torch.Tensor]:
        """The captured rows of ``tags`` (one ``collective_rpc``; rank 0 answers)."""
        t0 = time.perf_counter()
        try:
            replies = engine.collective_rpc(self._capture.TAKE, args=(tags, []))
        except Exception as e:
            if self._watch.is_dead() or isinstance(e, EngineDead):
                raise self._watch.gone() from None
            raise self._watch.gone(e) from e
        rows: dict[str, torch.Tensor] = {}
        for reply in replies:
            if reply and reply.get("found"):
                rows = self._capture.unpack(reply)
                break
        self.transfer_s += time.perf_counter() - t0
        self.transfers += 1
        self.transferred_rows += len(rows)
        return rows

    def take(
        self, engine: Any, tags: Sequence[str], running: Container[str]
    ) -> dict[str, torch.Tensor]:
        """The rows of finished requests ``tags`` that can be had: fetched ahead, in the
        prefetch in flight (waited for when a row is not in yet), or fetched by tag now. Rows
        fetched ahead for requests neither in ``tags`` nor ``running`` (which ended otherwise)
        are dropped."""
        rows = self.ahead
        if self.chunked:
            # A prompt prefilled over several steps has a row written at each; one fetched
            # ahead may be an early one. What the in-flight prefetch took comes in first; then
            # what the store still holds of these requests is newer than any of it.
            self.collect(wait=True)
            rows.update(self.fetch(engine, list(tags)))
        self.collect(wait=False)
        if any(tag not in rows for tag in tags):
            self.collect(wait=True)
        missing = [tag for tag in tags if tag not in rows]
        if missing:
            rows.update(self.fetch(engine, missing))
        found = {tag: rows.pop(tag) for tag in tags if tag in rows}
        for tag in [tag for tag in rows if tag not in running]:
            del rows[tag]
        return found


class RowCounter:
    """A counter of the backend's :class:`RowFetcher` (its ``rows``), read and set as the
    backend's own attribute (benches reset ``transfer_s`` and ``transfers`` between phases)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, backend: Any, owner: type | None = None) -> Any:
        return self if backend is None else getattr(backend.rows, self.name)

    def __set__(self, backend: Any, value: float) -> None:
        setattr(backend.rows, self.name, value)
