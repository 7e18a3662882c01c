"""The producer's connection to the pool: submit requests, receive replies, time out clearly.

All requests made on one event-loop tick go to Redis in one pipeline of SUBMIT scripts. One
listener task per connection pops replies from the connection's own reply list with ``BLMPOP``
(many replies per round trip) and resolves the futures waiting on each digest. Identical
requests in flight share one future and one message.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis as sync_redis
from redis.asyncio import Redis

from shared import protocol, registry
from shared.errors import LMPoolError, ProtocolError, QueueFull, RequestTimeout
from shared.keys import GROUP, Keys
from shared.redis_conn import TRANSIENT, Backoff, connect_redis
from shared.scripts import SUBMIT_SCRIPT, execute
from shared.settings import Settings

log = logging.getLogger("lmpool.producer")
LISTEN_BLOCK_S = 1.0
REPLIES_PER_POP = 512


@dataclass
class Submission:
    digest: str
    message: bytes
    future: asyncio.Future[bytes]
    shard: int


class PoolClient:
    """Submits requests for one model and routes the replies back."""

    def __init__(self, settings: Settings, model: str, priority: str = "high") -> None:
        self.settings = settings
        self.model = model
        self.priority = priority
        self.keys = Keys(settings.key_prefix)
        self.client_id = uuid.uuid4().hex
        self.reply_key = self.keys.reply(self.client_id)
        self.redis: Redis = connect_redis(settings.redis_url)
        self._listen_redis: Redis = connect_redis(
            settings.redis_url, socket_timeout=LISTEN_BLOCK_S + 10
        )
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        self._messages: dict[str, tuple[bytes, int, float]] = {}
        """Message and last submission time of each pending digest, for re-sending."""
        self._waiting: dict[str, int] = {}
        self._queue: list[Submission] = []
        self._flush_task: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._resender: asyncio.Task[None] | None = None
        self._slots = asyncio.Semaphore(settings.max_in_flight)
        self._backoff = Backoff()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sync: SyncSubmitter | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen(), name="lmpool-listener")
            self._resender = asyncio.create_task(self._resend_loop(), name="lmpool-resend")

    # -- submit ---------------------------------------------------------------------------
    def stream_of(self, shard: int) -> str:
        return self.keys.stream(self.model, self.priority, shard)

    async def request(self, digest: str, message: bytes, timeout_s: float, shard: int = 0) -> bytes:
        """Encoded result for ``digest``, submitting ``message`` unless already in flight."""
        if self._closed:
            raise LMPoolError("this RemoteLM is closed")
        fut = self._pending.get(digest)
        if fut is None:
            await self._slots.acquire()
            fut = asyncio.get_running_loop().create_future()
            fut.add_done_callback(lambda _f: self._slots.release())
            self._pending[digest] = fut
            self._enqueue(Submission(digest, message, fut, shard))
        self._waiting[digest] = self._waiting.get(digest, 0) + 1
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except asyncio.TimeoutError:
            error = await self._timeout_error(timeout_s)
            self._give_up(digest, fut, error)
            raise error from None
        except asyncio.CancelledError:
            if self._waiting.get(digest) == 1:
                self._give_up(digest, fut, None)
            raise
        finally:
            left = self._waiting.get(digest, 1) - 1
            if left:
                self._waiting[digest] = left
            else:
                self._waiting.pop(digest, None)

    def _give_up(
        self, digest: str, fut: asyncio.Future[bytes], error: BaseException | None
    ) -> None:
        """Stop waiting for ``digest``: workers skip it if nobody else waits."""
        if self._pending.get(digest) is not fut or fut.done():
            return
        del self._pending[digest]
        self._messages.pop(digest, None)
        if error is None:
            fut.cancel()
        else:
            fut.set_exception(error)
            fut.exception()  # retrieved: sharers re-raise it themselves
        srem = self.redis.srem(self.keys.waiters(self.model, digest), self.reply_key)
        task = asyncio.ensure_future(srem)  # type: ignore[arg-type]
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def _enqueue(self, sub: Submission) -> None:
        self._messages[sub.digest] = (sub.message, sub.shard, time.monotonic())
        self._queue.append(sub)
        if self._flush_task is None:
            self._flush_task = asyncio.create_task(self._flush())

    async def _resend_loop(self) -> None:
        """Submit again what has waited ``resend_s``: a no-op unless Redis lost the message."""
        period = self.settings.resend_s
        while not self._closed:
            await asyncio.sleep(period / 4)
            now = time.monotonic()
            for digest, fut in list(self._pending.items()):
                message, shard, sent_at = self._messages.get(digest, (b"", 0, now))
                if message and now - sent_at >= period and not fut.done():
                    self._enqueue(Submission(digest, message, fut, shard))

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let every request of this tick join the pipeline
        batch, self._queue = self._queue, []
        self._flush_task = None
        batch = [sub for sub in batch if not sub.future.done()]
        if not batch:
            return
        ttl_ms = int(self.settings.timeout_s * 1000) + 5_000

        def submit_all(pipe: Any) -> None:
            for sub in batch:
                SUBMIT_SCRIPT.queue(
                    pipe,
                    submit_keys(self.keys, self.model, sub.digest, self.stream_of(sub.shard)),
                    [self.reply_key, sub.message, ttl_ms, ttl_ms, self.settings.max_queue],
                )

        try:
            answers = await execute(self.redis, submit_all, [SUBMIT_SCRIPT], raise_on_error=False)
        except TRANSIENT as e:
            # Redis unreachable: keep the requests; they go again until their own timeout.
            wait = self._backoff.step()
            log.warning("cannot submit to Redis (%r); retrying in %.2fs", e, wait)
            await asyncio.sleep(wait)
            for sub in batch:
                self._enqueue(sub)
            return
        self._backoff.reset()
        for sub, answer in zip(batch, answers, strict=True):
            if isinstance(answer, TRANSIENT):
                self._enqueue(sub)
            elif isinstance(answer, Exception):
                self._fail(sub.digest, sub.future, LMPoolError(f"submit failed: {answer!r}"))
            elif answer[0] == 1:
                self._resolve(sub.digest, sub.future, answer[1])
            elif answer[0] == 2:
                self._fail(
                    sub.digest,
                    sub.future,
                    QueueFull(
                        f"queue of model {self.model!r} holds LMPOOL_MAX_QUEUE="
                        f"{self.settings.max_queue} requests; retry later"
                    ),
                )

    def _resolve(self, digest: str, fut: asyncio.Future[bytes], result: bytes) -> None:
        if self._pending.get(digest) is fut:
            del self._pending[digest]
            self._messages.pop(digest, None)
        if not fut.done():
            fut.set_result(result)

    def _fail(self, digest: str, fut: asyncio.Future[bytes], exc: BaseException) -> None:
        if self._pending.get(digest) is fut:
            del self._pending[digest]
            self._messages.pop(digest, None)
        if not fut.done():
            fut.set_exception(exc)

    # -- replies --------------------------------------------------------------------------
    async def _listen(self) -> None:
        backoff = Backoff()
        while not self._closed:
            try:
                popped = await self._listen_redis.blmpop(  # type: ignore[misc]
                    LISTEN_BLOCK_S,
                    1,
                    self.reply_key,  # type: ignore[arg-type]
                    direction="LEFT",
                    count=REPLIES_PER_POP,
                )
                backoff.reset()
            except TRANSIENT as e:
                if self._closed:
                    return
                wait = backoff.step()
                log.warning("reply listener lost Redis (%r); reconnecting in %.2fs", e, wait)
                await asyncio.sleep(wait)
                continue
            if popped:
                for raw in popped[1]:
                    self._deliver(raw)

    def _deliver(self, raw: bytes) -> None:
        try:
            digest, outcome = protocol.decode_reply(raw)
        except ProtocolError:
            log.exception("undecodable reply ignored")
            return
        fut = self._pending.get(digest)
        if fut is None:
            return  # answered from the cache already, or given up on
        if isinstance(outcome, BaseException):
            self._fail(digest, fut, outcome)
        else:
            self._resolve(digest, fut, outcome)

    # -- diagnostics ----------------------------------------------------------------------
    async def queue_state(self) -> str:
        """One line on the model's queue for error messages."""
        try:
            workers = await registry.live_workers(self.redis, self.keys, self.model)
            totals = {"interactive": [0, 0], "offline": [0, 0]}
            for stream in self.keys.streams(self.model, self.settings.shards):
                kind = "offline" if stream.endswith(":low") else "interactive"
                totals[kind][0] += await self.redis.xlen(stream)
                try:
                    totals[kind][1] += int((await self.redis.xpending(stream, GROUP))["pending"])
                except Exception:
                    pass  # no group yet: nothing pending
            return ", ".join(
                [f"{len(workers)} live worker(s)"]
                + [f"{k} queue {n} ({p} pending)" for k, (n, p) in totals.items()]
            )
        except Exception as e:
            return f"queue state unavailable: {e!r}"

    async def _timeout_error(self, timeout_s: float) -> RequestTimeout:
        state = await self.queue_state()
        return RequestTimeout(
            f"no answer from model {self.model!r} within {timeout_s:g}s ({state})"
        )

    # -- sync path ------------------------------------------------------------------------
    def sync(self) -> SyncSubmitter:
        if self._sync is None:
            self._sync = SyncSubmitter(self)
        return self._sync

    async def clear_results(self) -> int:
        """UNLINK every cached result of this model, in batches."""
        deleted = 0
        batch: list[bytes] = []
        async for key in self.redis.scan_iter(match=self.keys.results(self.model), count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += await self.redis.unlink(*batch)
                batch.clear()
        if batch:
            deleted += await self.redis.unlink(*batch)
        return deleted

    # -- lifecycle ------------------------------------------------------------------------
    def reset(self) -> None:
        """Fail every request waiting on this connection (genlm's ``reset_async_queries``)."""
        for digest, fut in list(self._pending.items()):
            self._fail(digest, fut, LMPoolError("request abandoned by reset_async_queries()"))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not asyncio.get_running_loop():
            # connected under another event loop, now gone (asyncio.run(connect()) then sync
            # calls): its clients cannot be used here; tidy up with a blocking client
            self.sync().close()
            return
        pending = list(self._pending)
        self.reset()
        tasks = [t for t in (self._listener, self._resender, self._flush_task) if t is not None]
        for task in tasks:
            task.cancel()
        # a task blocked inside redis-py may swallow one cancel; do not wait on it forever
        await asyncio.wait(tasks, timeout=5) if tasks else None
        try:
            pipe = self.redis.pipeline(transaction=False)
            for digest in pending:
                pipe.srem(self.keys.waiters(self.model, digest), self.reply_key)
            pipe.delete(self.reply_key)
            await pipe.execute()
        except Exception:
            log.debug("cleanup after close failed", exc_info=True)
        await self.redis.aclose()
        await self._listen_redis.aclose()
        if self._sync is not None:
            self._sync.close()


def submit_keys(keys: Keys, model: str, digest: str, stream: str) -> list[str]:
    """The KEYS of the SUBMIT script, in its order."""
    return [
        keys.result(model, digest),
        keys.waiters(model, digest),
        keys.inflight(model, digest),
        stream,
        keys.stats(model),
    ]


class SyncSubmitter:
    """Blocking requests for callers without an event loop (or inside a running one).

    Uses its own synchronous Redis client and reply list, so it never touches the async
    client's event loop; calls are serialized by the caller's thread.
    """

    def __init__(self, client: PoolClient) -> None:
        self.client = client
        self.redis = sync_redis.Redis.from_url(client.settings.redis_url)
        self.reply_key = client.keys.reply(client.client_id + "-sync")

    def request_many(
        self, items: list[tuple[str, bytes, int]], timeout_s: float
    ) -> dict[str, bytes]:
        c = self.client
        ttl_ms = int(timeout_s * 1000) + 5_000
        SUBMIT_SCRIPT.load_sync(self.redis)  # cheap, and this path is not the hot one
        pipe = self.redis.pipeline(transaction=False)
        for digest, message, shard in items:
            SUBMIT_SCRIPT.queue(
                pipe,
                submit_keys(c.keys, c.model, digest, c.stream_of(shard)),
                [self.reply_key, message, ttl_ms, ttl_ms, c.settings.max_queue],
            )
        results: dict[str, bytes] = {}
        for (digest, _, _), answer in zip(items, pipe.execute(), strict=True):
            if answer[0] == 1:
                results[digest] = answer[1]
            elif answer[0] == 2:
                raise QueueFull(f"queue of model {c.model!r} is full; retry later")
        deadline = time.monotonic() + timeout_s
        wanted = {d for d, _, _ in items} - set(results)
        while wanted:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(f"no answer from model {c.model!r} within {timeout_s:g}s")
            popped = self.redis.blmpop(
                min(left, LISTEN_BLOCK_S),
                1,
                self.reply_key,  # type: ignore[arg-type]
                direction="LEFT",
                count=REPLIES_PER_POP,
            )
            for raw in popped[1] if popped else []:
                digest, outcome = protocol.decode_reply(raw)
                if digest not in wanted:
                    continue
                if isinstance(outcome, BaseException):
                    raise outcome
                results[digest] = outcome
                wanted.discard(digest)
        return results

    def close(self) -> None:
        try:
            self.redis.delete(self.reply_key, self.client.reply_key)
        finally:
            self.redis.close()
