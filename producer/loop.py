"""One event loop's share of a :class:`producer.client.PoolClient`: created in that loop by its
first request, used only from it, dropped when the loop ends. Every request made on one event-loop
tick goes to Redis in one SUBMIT script call per shard (a pipeline when they span shards); a result
that already exists is read with GET. One listener task pops replies from the loop's own reply list
with ``BLMPOP`` (many per round trip); a reply without an inline result names a digest whose result
the listener then reads with ``GET`` (one pipeline per batch of replies). Identical requests in
flight share one submission. A housekeeping task, ten times a second, fails what passed its
deadline and re-submits what waited ``LMPOOL_RESEND_S`` (a no-op unless Redis lost the message): no
timer per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from producer.connections import LoopConnections
from producer.submit import LISTEN_BLOCK_S, REPLIES_PER_POP, Prepared, Submitter
from producer.target import Target
from shared import protocol
from shared.aio import cancelling, wait_event
from shared.errors import Expired, LMPoolError, ProtocolError, RequestTimeout
from shared.redis_conn import TRANSIENT, Backoff

log = logging.getLogger("lmpool.producer")
HOUSEKEEPING_S = 0.1
"""How often deadlines and re-submissions are checked (a request times out this late at most)."""


@dataclass(eq=False)
class Pending:
    """One digest this loop waits for, and every caller waiting on it."""

    prepared: Prepared
    deadline: float
    """Loop time after which the last of its callers gives up."""
    timeout_s: float
    futures: list[asyncio.Future[bytes | bytearray]] = field(default_factory=list)
    sent_at: float = 0.0
    force: bool = False
    """Its next submission adds the message even if the digest is marked in flight."""


class LoopState:
    """Everything one event loop needs: created in that loop, used only from it."""

    def __init__(
        self,
        target: Target,
        loop: asyncio.AbstractEventLoop,
        index: int,
        on_end: Callable[[LoopState], None],
    ) -> None:
        self.target = target
        self.on_end = on_end
        """Called once this state can serve no more (its owner then forgets it)."""
        self.loop = loop
        s = target.settings
        self.submitter = Submitter(target, target.keys.reply(f"{target.client_id}-{index}"))
        self.conns = LoopConnections(s.redis_url, self.submitter.whole_ok)
        self.redis = self.conns.redis
        self.pending: dict[str, Pending] = {}
        self.queue: list[Pending] = []
        self.flush_scheduled = False
        self.slots = asyncio.Semaphore(s.max_in_flight)
        self.closing = False
        self.dead: str | None = None
        """Why this state can no longer serve (set when its loop ends or it is closed)."""
        self.backoff = Backoff()
        self.wake = asyncio.Event()
        """Set when the listener may have replies to wait for (it pops only then)."""
        self.listening = False
        """The listener is popping replies (or about to): a lone request goes the usual way."""
        self.whole: Pending | None = None
        """The request now sent whole (SUBMIT, pop and GET in one round trip), if any."""
        self.listener = loop.create_task(self._listen(), name="lmpool-listener")
        self.keeper = loop.create_task(self._housekeep(), name="lmpool-resend")
        self.listener.add_done_callback(self._listener_done)
        self.background: set[asyncio.Task[Any]] = set()

    @property
    def reply_key(self) -> str:
        return self.submitter.reply_key

    # -- requests ---------------------------------------------------------------------------
    async def request(self, prepared: Prepared, timeout_s: float) -> bytes | bytearray:
        if self.dead is not None:
            raise LMPoolError(self.dead)
        loop = self.loop
        p = self.pending.get(prepared.digest)
        if p is None:
            await self.slots.acquire()
            if self.dead is not None:
                self.slots.release()
                raise LMPoolError(self.dead)
            p = self.pending.get(prepared.digest)
            if p is None:
                p = Pending(prepared, loop.time() + timeout_s, timeout_s)
                self.pending[prepared.digest] = p
                self._enqueue(p)
            else:
                self.slots.release()
        if loop.time() + timeout_s > p.deadline:
            p.deadline, p.timeout_s = loop.time() + timeout_s, timeout_s
        fut: asyncio.Future[bytes | bytearray] = loop.create_future()
        p.futures.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut in p.futures:
                p.futures.remove(fut)
            if not p.futures and self.pending.get(p.prepared.digest) is p:
                self._forget(p)
                if not self.closing:
                    self._spawn(self._leave(p.prepared))
            raise

    def _expire(self, p: Pending) -> None:
        if self.pending.get(p.prepared.digest) is not p:
            return
        self._forget(p)
        self._spawn(self._time_out(p))

    async def _time_out(self, p: Pending) -> None:
        said = f"no answer from model {self.target.model!r} within {p.timeout_s:g}s"
        error = RequestTimeout(said)
        try:
            error = RequestTimeout(f"{said} ({await self.target.queue_state(self.redis)})")
        finally:  # also when the state ends meanwhile (a close): its askers are told
            self._settle(p, error=error)
        await self._leave(p.prepared)

    async def _leave(self, prepared: Prepared) -> None:
        """Stop waiting for a digest (workers skip one nobody waits for), unless asked again.
        Asked again while the SREM is on its way, its SUBMIT (on another connection) may reach
        Redis first and join the set the SREM then leaves: it is submitted once more."""
        if prepared.digest in self.pending:
            return
        c = self.target
        with contextlib.suppress(Exception):
            key = c.keys.waiters(c.model, prepared.shard, prepared.digest)
            await self.redis.srem(key, self.reply_key)  # type: ignore[misc]
        again = self.pending.get(prepared.digest)
        if again is not None and again not in self.queue and not self.closing:
            self._enqueue(again)

    def _forget(self, p: Pending) -> None:
        if self.pending.get(p.prepared.digest) is p:
            del self.pending[p.prepared.digest]
            self.slots.release()

    def _settle(
        self,
        p: Pending,
        result: bytes | bytearray | None = None,
        error: BaseException | None = None,
    ) -> None:
        self._forget(p)
        for fut in p.futures:
            if fut.done():
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)  # type: ignore[arg-type]
        p.futures.clear()

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # -- submitting -----------------------------------------------------------------------
    def _enqueue(self, p: Pending, force: bool = False) -> None:
        p.sent_at = self.loop.time()
        p.force = p.force or force
        self.queue.append(p)
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self._spawn(self._flush())

    def _deadline_ms(self, p: Pending) -> int:
        return int(self.target.redis_now_ms() + 1000 * (p.deadline - self.loop.time()))

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let every request of this tick join the pipeline
        batch = [p for p in self.queue if self.pending.get(p.prepared.digest) is p]
        self.queue = []
        self.flush_scheduled = False
        if not batch:
            return
        if (
            len(batch) == 1
            and len(self.pending) == 1
            and self.whole is None
            and not self.listening
            and self.submitter.whole_ok
        ):
            await self._send_whole(batch[0])
            return
        by_digest = {p.prepared.digest: p for p in batch}
        items = [(p.prepared, self._deadline_ms(p), p.force) for p in batch]
        for p in batch:
            p.force = False
        calls = self.submitter.calls(items)
        try:
            answers = await self.conns.submit(calls)
        except TRANSIENT as e:
            await self._unreachable(batch, e, False)
            return
        except Exception as e:  # never leave a caller waiting for a submission that failed
            self._failed(batch, e)
            return
        # Only now does the listener pop: a reply cannot come before its request is queued,
        # and a listener that dies (NOPERM) must not end this state in mid-submission.
        self.wake.set()
        fetch, again = [], []  # again: (request, error) answered LOADING (a restart loading)
        for prepared, outcome in Submitter.outcomes(calls, answers):
            p = by_digest[prepared.digest]
            if self.pending.get(prepared.digest) is not p:
                continue
            if outcome == "fetch":
                fetch.append(prepared.digest)
            elif isinstance(outcome, TRANSIENT):
                again.append((p, outcome))
            else:
                self._refused(p, outcome)
        if fetch:
            await self._fetch(fetch)
        if again:  # after a pause, as when Redis is unreachable (not at once, again and again)
            await self._unreachable([p for p, _ in again], again[0][1], False)
        else:
            self.backoff.reset()

    async def _unreachable(self, batch: list[Pending], error: Exception, force: bool) -> None:
        """Redis unreachable: keep the requests; they go again until their own deadline."""
        wait = self.backoff.step()
        log.warning("cannot submit to Redis (%r); retrying in %.2fs", error, wait)
        await asyncio.sleep(wait)
        for p in batch:
            self._enqueue(p, force)

    def _failed(self, batch: list[Pending], error: Exception) -> None:
        log.exception("submitting %d request(s) failed", len(batch))
        for p in batch:
            self._settle(p, error=self.submitter.submit_error(error))

    def _refused(self, p: Pending, outcome: Any, force: bool = False) -> None:
        """Act on a SUBMIT outcome other than queued, joined or cached (a full queue, a failure)."""
        if outcome == "full":
            self._settle(p, error=self.submitter.queue_full())
        elif isinstance(outcome, TRANSIENT):  # again after a pause (LOADING: not at once)
            self._spawn(self._unreachable([p], outcome, force))
        elif isinstance(outcome, Exception):
            self._settle(p, error=self.submitter.submit_error(outcome))

    async def _send_whole(self, p: Pending) -> None:
        """A request alone in this loop: SUBMIT, the pop of its reply and the GET of its result
        in one pipeline (``Submitter.whole_commands``), the result received into a buffer of its
        own (``shared.resp``). The listener does not pop meanwhile; it takes over if the request
        still waits when the pop returns."""
        self.whole = p
        force, p.force = p.force, False
        deadline_ms = self._deadline_ms(p)
        commands = self.submitter.whole_commands(p.prepared, deadline_ms, force, LISTEN_BLOCK_S)
        try:
            answers = await self.conns.run_whole(commands)
        except TRANSIENT as e:
            self.whole = None
            await self._unreachable([p], e, force)
            return
        except Exception as e:  # never leave a caller waiting for a submission that failed
            self._failed([p], e)
            return
        finally:
            self.whole = None
        self.backoff.reset()
        outcome, replies, value = Submitter.whole_outcome(p.prepared, answers)
        digest = p.prepared.digest
        if self.pending.get(digest) is p:
            if outcome not in ("wait", "fetch"):
                self._refused(p, outcome, force)
            elif value is not None:
                self._settle(p, value)
        fetch = self._deliver(replies)
        if self.pending.get(digest) is p and p not in self.queue:
            self.wake.set()  # unanswered when the pop returned: the listener waits for it
        if fetch:
            await self._fetch(fetch)

    async def _fetch(self, digests: list[str]) -> None:
        """Read the results of ``digests`` and hand them over; one gone since is submitted again."""
        c = self.target
        wanted = [self.pending[d] for d in digests if d in self.pending]
        if not wanted:
            return
        reads = [c.read_result(p.prepared.shard, p.prepared.digest) for p in wanted]
        try:
            values = await self.conns.get(reads)
        except TRANSIENT:
            for p in wanted:
                self._enqueue(p)
            return
        for p, value in zip(wanted, values, strict=True):
            if self.pending.get(p.prepared.digest) is not p:
                continue
            if value is None:
                self._enqueue(p, force=True)  # lost in a failover, or expired: compute again
            else:
                self._settle(p, value)

    async def _housekeep(self) -> None:
        """Time out what passed its deadline; re-submit what waited ``resend_s`` (see above)."""
        resend_s = self.target.settings.resend_s
        while not self.closing:
            await asyncio.sleep(HOUSEKEEPING_S)
            now = self.loop.time()
            queued = {id(p) for p in self.queue}
            for p in list(self.pending.values()):
                if now >= p.deadline:
                    self._expire(p)
                elif (
                    p.futures
                    and now - p.sent_at >= resend_s
                    and id(p) not in queued
                    and p is not self.whole  # its SUBMIT's answer (the entry id) is on its way
                ):
                    self._enqueue(p, force=True)

    # -- replies --------------------------------------------------------------------------
    async def _listen(self) -> None:
        backoff = Backoff()
        me = asyncio.current_task()
        try:
            while not self.closing:
                if cancelling(me):
                    # redis-py (asyncio.wait_for on Python 3.11) can swallow a cancel: the
                    # loop ending under us must still end this task
                    raise asyncio.CancelledError
                if not self._awaited():
                    self.listening = False
                    self.wake.clear()
                    await wait_event(self.wake, LISTEN_BLOCK_S)
                    continue
                self.listening = True
                try:
                    popped = await self.conns.listen.blmpop(  # type: ignore[misc]
                        LISTEN_BLOCK_S,
                        1,
                        self.reply_key,  # type: ignore[arg-type]
                        direction="LEFT",
                        count=REPLIES_PER_POP,
                    )
                    backoff.reset()
                except TRANSIENT as e:
                    if self.closing:
                        return
                    wait = backoff.step()
                    log.warning("reply listener lost Redis (%r); reconnecting in %.2fs", e, wait)
                    await asyncio.sleep(wait)
                    continue
                if popped:
                    fetch = self._deliver(popped[1])
                    if fetch:
                        await self._fetch(fetch)
        except asyncio.CancelledError:
            if not self.closing:  # the loop is ending (asyncio.run returns): let go of it all
                await self.end("the event loop this request ran in ended", cancel=True)
            raise

    def _awaited(self) -> bool:
        """A reply is awaited that no whole request's own pop is waiting for."""
        mine = self.whole is not None and self.pending.get(self.whole.prepared.digest) is self.whole
        return len(self.pending) > int(mine)

    def _deliver(self, raws: list[bytes]) -> list[str]:
        """Settle what the replies answer; returns the digests whose results are to be read."""
        fetch = []
        for raw in raws:
            try:
                digest, outcome = protocol.decode_reply(raw)
            except ProtocolError:
                log.exception("undecodable reply ignored")
                continue
            p = self.pending.get(digest)
            if p is None:
                continue  # answered from the cache already, or given up on
            if outcome is None:
                fetch.append(digest)
            elif isinstance(outcome, Expired) and self.loop.time() < p.deadline:
                self._enqueue(p, force=True)  # dropped on an earlier asker's deadline
            elif isinstance(outcome, Expired):  # its own: told as a timeout, the queue's state
                self._expire(p)
            elif isinstance(outcome, BaseException):
                self._settle(p, error=outcome)
            else:
                self._settle(p, outcome)
        return fetch

    def _listener_done(self, task: asyncio.Task[None]) -> None:
        """A listener that died (a non-transient error: NOPERM under ACLs, say) ends this
        state as a close does."""
        if task.cancelled() or self.closing:
            return
        reason = f"the reply listener stopped: {task.exception()!r}"
        log.error("%s; failing this loop's requests", reason)
        # dead at once: nothing new is accepted meanwhile, the owner makes a new state for the
        # next request, and end() forgets this one
        self.dead = reason
        self._spawn(self.end(reason))

    # -- lifecycle ------------------------------------------------------------------------
    def fail_all(self, error: BaseException) -> None:
        for p in list(self.pending.values()):
            self._settle(p, error=error)

    async def end(self, reason: str, cancel: bool = False) -> None:
        """The one ending of this state, whichever way it comes (a close, the loop ending, the
        listener's death): nothing new is accepted, the waiters fail with ``reason`` (or are
        cancelled, ``cancel``), the tasks stop, this loop's reply list leaves Redis and its
        connections close. Runs once."""
        if self.closing:
            return
        self.closing = True
        self.dead = reason
        self.on_end(self)
        pending = list(self.pending.values())
        if cancel:
            for p in pending:
                self._forget(p)
                for fut in p.futures:
                    fut.cancel()
        else:
            self.fail_all(LMPoolError(reason))
        current = asyncio.current_task()
        tasks = [self.listener, self.keeper, *self.background]
        tasks = [t for t in tasks if t is not current and not t.done()]
        for task in tasks:
            task.cancel()
        c = self.target
        waiting = [c.keys.waiters(c.model, p.prepared.shard, p.prepared.digest) for p in pending]
        try:
            if tasks:  # a task blocked inside redis-py may swallow one cancel: do not wait forever
                await asyncio.wait(tasks, timeout=5)
        finally:  # also when this loop ends and cancels the ending meanwhile (asyncio.run)
            await self.conns.leave_and_close(waiting, self.reply_key)
