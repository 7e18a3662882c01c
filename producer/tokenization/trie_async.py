"""Auto-batching asyncio front of a character trie.

Many genlm-control particles ask for trie masses at the same moment, one weight vector each.
Computing them one by one wastes the parallel trie; this wrapper queues the concurrent
``weight_sum`` / ``weight_max`` calls and a background task answers everything queued so far
with one batched call per operation, as genlm-backend 0.3.1's ``AsyncTokenCharacterTrie`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from producer.tokenization.trie import TokenCharacterTrie, check_weight_count
from producer.tokenization.trie_parallel import ParallelTokenCharacterTrie

__all__ = ["AsyncTokenCharacterTrie"]

logger = logging.getLogger(__name__)

_Request = tuple[Any, "asyncio.Future[Any]", str]


class AsyncTokenCharacterTrie:
    """Batches concurrent weight requests to a :class:`TokenCharacterTrie` (``self.trie``), or
    to any trie with ``batch_weight_sum`` / ``batch_weight_max`` (genlm-backend's, say).

    The background task starts on the first request (or :meth:`start`) and is bound to the
    running event loop; a request from another loop restarts it there. Stop it with
    :meth:`cleanup` (awaits the cancellation) or :meth:`shutdown` (synchronous).
    """

    def __init__(self, trie: TokenCharacterTrie) -> None:
        self.trie = trie
        self._queue: asyncio.Queue[_Request] | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def from_vocab(
        cls, vocab: Sequence[Any], backend: str = "parallel", **kwargs: Any
    ) -> AsyncTokenCharacterTrie:
        """Build the trie of ``vocab`` and wrap it.

        Args:
            vocab: The vocabulary (normally the :class:`~producer.tokenization.vocab.Token` list of
                ``decode_vocab``).
            backend: ``"parallel"`` (torch, GPU when available) or ``"sequential"`` (numpy).
            **kwargs: Passed to the trie constructor (e.g. ``device`` for ``"parallel"``).

        Raises:
            ValueError: unknown backend.
        """
        trie: TokenCharacterTrie
        if backend == "sequential":
            trie = TokenCharacterTrie(decode=vocab, **kwargs)
        elif backend == "parallel":
            trie = ParallelTokenCharacterTrie(decode=vocab, **kwargs)
        else:
            raise ValueError(
                f"Unknown backend: {backend}. Must be one of ['sequential', 'parallel']"
            )
        return cls(trie)

    async def weight_sum(self, ws: Any) -> Any:
        """The trie's ``weight_sum(ws)``, computed in a batch with concurrent requests.

        Raises:
            ValueError: ``ws`` does not have one weight per vocabulary entry (raised here,
                before queueing, so a bad vector cannot fail the rest of its batch).
        """
        self._check_request(ws)
        return await (await self._queue_request(ws, "sum"))

    async def weight_max(self, ws: Any) -> Any:
        """The trie's ``weight_max(ws)``, batched like :meth:`weight_sum`."""
        self._check_request(ws)
        return await (await self._queue_request(ws, "max"))

    def _check_request(self, ws: Any) -> None:
        """Reject a vector that is not one weight per entry of the trie's ``decode``.

        Only ``decode`` is read, so any trie works, as with genlm-backend's wrapper (its own
        tries, subclasses...); one without ``decode`` is left to fail in its batch.
        """
        shape = getattr(ws, "shape", None)
        if shape is not None and len(shape) != 1:
            raise ValueError(f"Expected a 1-D weight vector, got shape {tuple(shape)}")
        decode = getattr(self.trie, "decode", None)
        if decode is not None:
            check_weight_count(len(decode), len(ws) if shape is None else int(shape[0]))

    async def _queue_request(self, request: Any, op: str) -> asyncio.Future[Any]:
        """Queue ``request`` for operation ``op``; returns the future of its result."""
        if not self._running_here():
            self.start()
        assert self._queue is not None
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self._queue.put((request, future, op))
        return future

    def _running_here(self) -> bool:
        """Whether the background task is alive on the running loop."""
        return (
            self._task is not None
            and not self._task.done()
            and self._task.get_loop() is asyncio.get_running_loop()
        )

    def start(self) -> None:
        """Start the background task on the running loop unless it already runs there."""
        if self._running_here():
            return
        if self._task is not None and not self._task.done():
            self.shutdown()  # left running on another (possibly closed) loop
        self._queue = asyncio.Queue()  # a queue belongs to the loop it is used on
        self._task = asyncio.create_task(self._background_loop())

    def _do_weight_sums(self, batch_weights: Sequence[Any]) -> Any:
        return self.trie.batch_weight_sum(batch_weights)

    def _do_weight_maxs(self, batch_weights: Sequence[Any]) -> Any:
        return self.trie.batch_weight_max(batch_weights)

    async def _background_loop(self) -> None:
        """Answer everything queued so far, one batched trie call per operation, forever.

        A failing batch fails the futures of that batch only; the loop keeps serving.
        """
        queue = self._queue
        assert queue is not None
        while True:
            groups: defaultdict[str, list[tuple[Any, asyncio.Future[Any]]]] = defaultdict(list)
            request, future, op = await queue.get()
            groups[op].append((request, future))
            while not queue.empty():
                request, future, op = queue.get_nowait()
                groups[op].append((request, future))
            for op, group in groups.items():
                self._answer(op, group)

    def _answer(self, op: str, group: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        requests = [request for request, _ in group]
        futures = [future for _, future in group]
        try:
            if op == "sum":
                logger.debug("processing %d sum requests", len(requests))
                results = self._do_weight_sums(requests)
            elif op == "max":
                logger.debug("processing %d max requests", len(requests))
                results = self._do_weight_maxs(requests)
            else:
                raise ValueError(f"Unknown operation: {op}")
        except Exception as e:
            for future in futures:
                if not future.done():
                    future.set_exception(e)
            return
        for future, result in zip(futures, results, strict=True):
            if not future.done():  # the caller may have been cancelled
                future.set_result(result)

    async def cleanup(self) -> None:
        """Cancel the background task and wait for it to end."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            if task.get_loop() is asyncio.get_running_loop():
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def shutdown(self) -> None:
        """Cancel the background task without waiting (safe from ``__del__``)."""
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(RuntimeError):  # its loop may be closed already
                task.cancel()

    def __del__(self) -> None:
        self.shutdown()
