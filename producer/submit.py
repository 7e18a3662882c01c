"""What the event-loop and blocking paths share: a request ready to send, the SUBMIT calls
that send it (one per shard), reading their answers; and the blocking path itself.

A blocking caller (no running loop, or a ``*_sync`` method) gets a :class:`SyncState` per
thread: its own synchronous client and reply list, so it never touches an event loop.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, OutOfMemoryError
from redis.retry import Retry as SyncRetry

from producer.target import Target
from shared import protocol
from shared.errors import Expired, LMPoolError, QueueFull, RedisFull, RequestTimeout
from shared.redis_conn import (
    TRANSIENT,
    AnyRedis,
    Backoff,
    connect_redis_sync,
    is_cluster,
    moving_slot,
)
from shared.scripts import SUBMIT_SCRIPT, execute, run_script, submit_call

LISTEN_BLOCK_S = 1.0
"""Longest blocking pop of replies (also how soon a closed listener notices)."""
REPLIES_PER_POP = 512
SYNC_SOCKET_TIMEOUT_S = LISTEN_BLOCK_S + 1.0
"""The blocking path's socket timeouts (a pop blocks ``LISTEN_BLOCK_S`` at most)."""
log = logging.getLogger("lmpool.producer")
OUTCOMES = ("wait", "fetch", "full")
"""What SUBMIT's codes 0, 1, 2 mean for a request: joined, cached, refused (queued: an id)."""


@dataclass(eq=False)
class Prepared:
    """A request ready to submit: its digest, shard, and the message fields."""

    digest: str
    shard: int
    request: protocol.Request
    entry: str = ""
    """The id of the stream entry this producer's last SUBMIT of it added: a re-submission asks
    SUBMIT to add it again only if that one's worker died; 'j' when it joined another asker's
    entry (whose id it does not know): only if the stream is gone (see ``shared.scripts``)."""

    def message(self, deadline_ms: int) -> bytes:
        self.request["deadline_ms"] = deadline_ms
        return protocol.encode_request(self.request)

    def force(self, again: bool) -> str:
        """SUBMIT's force argument: a first submission, or a re-submission (``again``)."""
        return (self.entry or "1") if again else "0"

    def outcome(self, code: Any) -> str:
        """What SUBMIT's answer for this request means (:data:`OUTCOMES`); an entry id (it was
        queued) is kept for a later re-submission."""
        if isinstance(code, int):
            if code == 0 and not self.entry:  # joined another's entry (not its own again)
                self.entry = "j"
            return OUTCOMES[code]
        self.entry = code.decode() if isinstance(code, bytes) else str(code)
        return "wait"


class Submitter:
    """What the async and blocking paths share: the SUBMIT calls and reading their answers."""

    def __init__(self, target: Target, reply_key: str) -> None:
        self.target = target
        self.reply_key = reply_key
        self.whole_ok = not is_cluster(target.settings.redis_url)
        """Whether :meth:`whole_commands` may be used: a cluster refuses SUBMIT's push to the
        reply list (a key of another slot)."""

    def calls(
        self, items: list[tuple[Prepared, int, bool]], marker: bytes = b""
    ) -> list[tuple[list[Prepared], list[str], list[Any]]]:
        """One SUBMIT call per shard for ``(prepared, deadline_ms, force)`` items:
        ``(requests, keys, args)``; ``marker`` goes onto the reply list when a request was
        neither queued nor joined (see :meth:`whole_commands`)."""
        c = self.target
        s = c.settings
        ttl_ms = int(s.timeout_s * 1000) + 5_000
        groups: dict[int, list[tuple[Prepared, int, bool]]] = defaultdict(list)
        for item in items:
            groups[item[0].shard].append(item)
        out = []
        for shard, group in groups.items():
            keys, args = submit_call(
                c.keys,
                c.model,
                shard,
                c.stream_of(shard),
                [
                    (p.digest, p.force(force), p.message(deadline_ms))
                    for p, deadline_ms, force in group
                ],
                reply=self.reply_key,
                wait_ms=ttl_ms,
                max_queue=s.max_queue,
                stale_ms=int(s.held_stale_s * 1000),
                marker=marker,
                tenant=c.tenant,
            )
            out.append(([p for p, _, _ in group], keys, args))
        return out

    def queue_full(self) -> QueueFull:
        """The error of a request SUBMIT refused: the model's queue is at its limit."""
        c = self.target
        return QueueFull(
            f"queue of model {c.model!r} holds LMPOOL_MAX_QUEUE={c.settings.max_queue} "
            "requests; retry later"
        )

    def submit_error(self, error: BaseException) -> LMPoolError:
        """The error of a SUBMIT call that failed: ``RedisFull`` when Redis refused it for
        want of memory (nothing of it was done: a script refused at its first write)."""
        if isinstance(error, OutOfMemoryError):
            return RedisFull(
                f"Redis is full: it refused to queue a request for model {self.target.model!r} "
                "(its used memory is above maxmemory and its maxmemory-policy finds nothing to "
                "evict). Raise maxmemory, or let Redis evict cached results with "
                f"maxmemory-policy volatile-lru (README, 'Redis memory'). Redis said: {error}"
            )
        return LMPoolError(f"submit failed: {error!r}")

    def whole_commands(
        self, prepared: Prepared, deadline_ms: int, force: bool, block_s: float
    ) -> list[list[Any]]:
        """A lone request in one round trip (a single Redis only), as one pipeline's commands:
        SUBMIT, then a blocking pop of this reply list, then a GET of the result.

        Redis runs a client's commands in order and holds the GET until the pop returns: when
        the worker's FINISH pushes the reply, the result is already SET, and the GET sends it
        back with the reply, instead of a round trip after it. SUBMIT pushes a marker of its
        own when it neither queued nor joined the request (the result exists, or the queue is
        full), so that the pop never waits for a reply that will not come; EVAL, not EVALSHA,
        for the same reason: a NOSCRIPT would leave the pop waiting. :meth:`whole_outcome`
        reads the three answers."""
        c = self.target
        marker = protocol.encode_reply(prepared.digest)
        ((_, keys, args),) = self.calls([(prepared, deadline_ms, force)], marker)
        return [
            SUBMIT_SCRIPT.eval_command(keys, args),
            ["BLMPOP", block_s, 1, self.reply_key, "LEFT", "COUNT", REPLIES_PER_POP],
            c.read_result(prepared.shard, prepared.digest),
        ]

    @staticmethod
    def whole_outcome(
        prepared: Prepared, answers: list[Any]
    ) -> tuple[Any, list[bytes], bytes | bytearray | None]:
        """``(outcome, replies, value)`` of :meth:`whole_commands`' answers: the SUBMIT outcome
        as :meth:`outcomes` gives it, the replies popped (for any request of this list), and
        the result's value if it existed once the pop returned."""
        codes, popped, value = answers
        outcome = codes if isinstance(codes, Exception) else prepared.outcome(codes[0])
        replies = [] if popped is None or isinstance(popped, Exception) else popped[1]
        return outcome, replies, value if isinstance(value, (bytes, bytearray)) else None

    @staticmethod
    async def run(
        redis: AnyRedis, calls: list[tuple[list[Prepared], list[str], list[Any]]]
    ) -> list[Any]:
        """Run SUBMIT ``calls`` (of :meth:`calls`); one answer (or error) per call."""
        if len(calls) == 1:  # the usual case: no pipeline object needed
            _, keys, args = calls[0]
            return [await run_script(redis, SUBMIT_SCRIPT, keys, args)]

        def build(pipe: Any) -> None:
            for _, keys, args in calls:
                SUBMIT_SCRIPT.queue(pipe, keys, args)

        return list(await execute(redis, build, [SUBMIT_SCRIPT], raise_on_error=False))

    @staticmethod
    def outcomes(
        calls: list[tuple[list[Prepared], list[str], list[Any]]], answers: list[Any]
    ) -> Iterable[tuple[Prepared, Any]]:
        """``(prepared, outcome)``: ``"fetch"`` (the result exists: read it), ``"wait"``,
        ``"full"``, or the error of its call."""
        for (group, _, _), codes in zip(calls, answers, strict=True):
            for j, p in enumerate(group):
                if isinstance(codes, Exception):
                    yield p, codes
                else:
                    yield p, p.outcome(codes[j])


class SyncState:
    """Blocking requests for one thread: its own synchronous client and reply list."""

    def __init__(self, target: Target) -> None:
        self.target = target
        url = target.settings.redis_url
        self.redis = connect_redis_sync(
            url,
            socket_timeout=SYNC_SOCKET_TIMEOUT_S,
            socket_connect_timeout=SYNC_SOCKET_TIMEOUT_S,
            retry=SyncRetry(NoBackoff(), 0),  # request_many retries, within the call's timeout
        )
        """The requests' client: a Redis that stops answering fails a command within
        ``SYNC_SOCKET_TIMEOUT_S``, so that a blocking call ends near its own timeout."""
        self.bulk = connect_redis_sync(url)
        """For the rest (an adapter's upload may take longer than the requests' timeout)."""
        self.submitter = Submitter(
            target, target.keys.reply(f"{target.client_id}-t{uuid.uuid4().hex[:8]}")
        )

    def _leave(self, gone: list[Prepared]) -> None:
        """Stop waiting for these (workers skip a digest nobody waits for), best effort."""
        c = self.target
        with contextlib.suppress(Exception):
            pipe = self.redis.pipeline(transaction=False)
            for p in gone:
                pipe.srem(c.keys.waiters(c.model, p.shard, p.digest), self.submitter.reply_key)
            pipe.execute()

    def request_many(self, items: list[Prepared], timeout_s: float) -> dict[str, bytes]:
        """Encoded results by digest. Redis unreachable (a restart, a blip), the requests are
        submitted again once it answers, as on the async path, until their timeout."""
        deadline = time.monotonic() + timeout_s
        wanted = {p.digest: p for p in items}
        results: dict[str, bytes] = {}
        todo, force = list(wanted.values()), False  # to submit next; force: a re-submission
        sent_at = time.monotonic()
        lost: Exception | None = None  # why Redis did not answer, while it does not
        backoff = Backoff()
        while len(results) < len(wanted):
            waiting = [p for d, p in wanted.items() if d not in results]
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise self._timed_out(waiting, timeout_s, lost)
            if not todo and now - sent_at >= self.target.settings.resend_s:
                # as the async path's housekeeping does: a reply list, waiter set or stream
                # entry lost (evicted by a full Redis, a failover) is asked for again
                todo, force = waiting, True
            try:
                if todo:  # the first submission, or again (a result gone before it was read)
                    if len(wanted) == 1 and not force and self.submitter.whole_ok:
                        todo = self._submit_whole(todo[0], left, results)
                    else:
                        todo = self._submit(todo, left, results, force=force)
                    force, sent_at = True, time.monotonic()
                else:
                    todo = self._pop(left, wanted, results)
            except TRANSIENT as e:
                if lost is None:
                    log.warning("blocking call lost Redis (%r); trying again", e)
                lost = e
                # once Redis answers: queued again unless still queued (a restart with its data)
                todo, force = waiting, False
                time.sleep(min(backoff.step(), max(deadline - time.monotonic(), 0)))
                continue
            lost = None
            backoff.reset()
        return results

    def _pop(
        self, left: float, wanted: dict[str, Prepared], results: dict[str, bytes]
    ) -> list[Prepared]:
        """Wait for replies (at most ``left``, and a re-submission's period); returns the
        requests to submit again."""
        popped = self.redis.blmpop(
            min(left, LISTEN_BLOCK_S, max(self.target.settings.resend_s, 0.01)),
            1,
            self.submitter.reply_key,
            direction="LEFT",
            count=REPLIES_PER_POP,
        )
        return self._take(popped[1] if popped else [], wanted, results)

    def _timed_out(
        self, waiting: list[Prepared], timeout_s: float, lost: Exception | None
    ) -> RequestTimeout:
        c = self.target
        said = f"no answer from model {c.model!r} within {timeout_s:g}s"
        if lost is not None:  # no round trip more to a Redis that does not answer
            return RequestTimeout(f"{said} (Redis unreachable: {lost!r})")
        self._leave(waiting)
        return RequestTimeout(f"{said} ({c.queue_state_sync(self.redis)})")

    def _take(
        self, replies: list[bytes], wanted: dict[str, Prepared], results: dict[str, bytes]
    ) -> list[Prepared]:
        """Put what ``replies`` answer into ``results`` (reading what they name from the
        cache); returns the requests to submit again; raises an error a reply carries."""
        fetch, again = [], []
        for raw in replies:
            digest, outcome = protocol.decode_reply(raw)
            if digest not in wanted or digest in results:
                continue
            if isinstance(outcome, Expired):
                again.append(wanted[digest])  # an earlier asker's deadline: ours is later
            elif isinstance(outcome, BaseException):
                raise outcome
            elif outcome is None:
                fetch.append(digest)
            else:
                results[digest] = outcome
        return again + self._fetch(fetch, wanted, results)

    def _submit_whole(
        self, p: Prepared, timeout_s: float, results: dict[str, bytes]
    ) -> list[Prepared]:
        """One request in one round trip (``Submitter.whole_commands``): into ``results`` when
        answered within the pop's block; returns it when it is to be submitted again."""
        c = self.target
        deadline_ms = int(c.redis_now_ms() + 1000 * timeout_s)
        pipe = self.redis.pipeline(transaction=False)
        block_s = min(timeout_s, LISTEN_BLOCK_S)
        for command in self.submitter.whole_commands(p, deadline_ms, False, block_s):
            pipe.execute_command(*command)
        outcome, replies, value = Submitter.whole_outcome(p, pipe.execute(raise_on_error=False))
        self._raise_refused(outcome)
        if value is not None:
            results[p.digest] = bytes(value)  # redis-py's: bytes already, not copied
            return []
        return self._take(replies, {p.digest: p}, results)

    def _submit(
        self,
        items: list[Prepared],
        timeout_s: float,
        results: dict[str, bytes],
        force: bool = False,
    ) -> list[Prepared]:
        """Submit ``items``; results already cached go straight into ``results``. Returns those
        whose result was gone by the time it was read (to submit again)."""
        c = self.target
        deadline_ms = int(c.redis_now_ms() + 1000 * timeout_s)
        calls = self.submitter.calls([(p, deadline_ms, force) for p in items])
        for attempt in (1, 2):
            pipe = self.redis.pipeline(transaction=False)
            for _, keys, args in calls:
                SUBMIT_SCRIPT.queue(pipe, keys, args)
            answers = pipe.execute(raise_on_error=False)
            if attempt == 1 and any(isinstance(a, NoScriptError) for a in answers):
                SUBMIT_SCRIPT.load_sync(self.redis)
                continue
            break
        fetch = []
        for p, outcome in Submitter.outcomes(calls, answers):
            if outcome == "fetch":
                fetch.append(p.digest)
            else:
                self._raise_refused(outcome)
        return self._fetch(fetch, {p.digest: p for p in items}, results)

    def _raise_refused(self, outcome: Any) -> None:
        """Raise what a SUBMIT outcome other than queued, joined or cached means: a full queue,
        a call that failed. A transient failure (a failover, a slot moving: the pipeline hands
        back redis-py's ``ClusterError('TTL exhausted.')``, Redis' "non local key" refusal) is
        raised as it is, for :meth:`request_many` to wait out, as the async path does."""
        if outcome == "full":
            raise self.submitter.queue_full()
        if isinstance(outcome, Exception):
            outcome = moving_slot(outcome)
            if isinstance(outcome, TRANSIENT):
                raise outcome
            raise self.submitter.submit_error(outcome)

    def _fetch(
        self, digests: list[str], wanted: dict[str, Prepared], results: dict[str, bytes]
    ) -> list[Prepared]:
        """Read the results of ``digests`` into ``results``; returns those that are gone
        (evicted, or lost in a failover, since they were written)."""
        if not digests:
            return []
        c = self.target
        pipe = self.redis.pipeline(transaction=False)
        for d in digests:
            pipe.execute_command(*c.read_result(wanted[d].shard, d))
        gone = []
        for digest, value in zip(digests, pipe.execute(), strict=True):
            if value is None:
                gone.append(wanted[digest])
            else:
                results[digest] = value
        return gone

    def close(self) -> None:
        try:
            self.redis.delete(self.submitter.reply_key)
        finally:
            self.redis.close()
            self.bulk.close()
