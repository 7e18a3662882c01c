"""Writing answers: results into the shared cache, replies to the waiting producers, acks.

One pipeline per flush (on a ``shared.resp`` connection of its own, on a single Redis without
TLS): ``ZADD`` the new results' digests to their shard's due set, ``SET`` each new result
(without a TTL until its first read or its due time, see ``shared.scripts``) and one FINISH
call per shard (which takes each digest's waiter set and, on a single Redis, pushes the
replies), for each megabyte or so of results in turn (``finish_groups``: early replies are
fetched while later results arrive), the dead letters, then ``XACK`` + ``XDEL`` of every entry
answered. Entries are acknowledged only in the pipeline that wrote their answers, so a crash
before it leaves them pending for another worker to reclaim; a crash after FINISH but before a
cluster's second pipeline (the replies, which live in other slots) leaves the results in the
cache, where the producers' re-submission finds them. Flushes run one at a time in the
background, each taking whatever finished while the previous one ran, so compute never waits
for Redis.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import OutOfMemoryError

from shared import protocol
from shared.aio import OutageLog
from shared.keys import GROUP, Keys
from shared.protocol import wire_bytes, wire_len
from shared.redis_conn import TRANSIENT, AnyRedis, Backoff
from shared.resp import RespConnection
from shared.resp import supported as resp_supported
from shared.scripts import (
    FINISH_SCRIPT,
    SWEEP_SCRIPT,
    execute,
    execute_resp,
    finish_call,
    run_script,
)
from shared.settings import Settings
from worker.stream.batcher import Job

log = logging.getLogger("lmpool.worker")
DEAD_LETTER_KEEP_BYTES = 4096
"""A dead letter keeps at most this much of its message (plus the message's full size)."""
WRITE_TIMEOUT_S = 15.0
"""A write pipeline unanswered this long is on a dead connection (as ``connect_redis``'s
socket timeout): dropped, and the write retried on a new one."""
FINISH_EVERY_BYTES = 1 << 20
"""Results written before the FINISH that answers them (see ``finish_groups``)."""
UNREAD_KEEP_MS = 30_000
"""An unread result keeps no TTL this long (or the result TTL, if shorter): its askers read it
within milliseconds, or after ``LMPOOL_RESEND_S`` (15 s by default) when their reply was
lost."""
SWEEP_TAKE = 1000
"""Digests one SWEEP call takes at most (Lua's ``unpack`` has a limit)."""
DEAD_LETTERS_KEPT = 10_000
"""Entries the dead-letter stream keeps (approximately), so its memory stays bounded."""


class Writer:
    def __init__(
        self,
        redis: AnyRedis,
        settings: Settings,
        consumer_name: str,
        cluster: bool = False,
        on_written: Callable[[list[Job]], None] | None = None,
    ) -> None:
        self.redis = redis
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.model = settings.served_model_name
        self.name = consumer_name
        self.cluster = cluster
        """Replies go in a second pipeline (their lists live in other slots)."""
        self.on_written = on_written
        self.conn = (
            RespConnection(settings.redis_url)
            if not cluster and resp_supported(settings.redis_url)
            else None
        )
        """Where writes go on a single Redis (``shared.resp``: no per-command parsing, timers
        or copies of redis-py's pipeline); TLS and clusters keep redis-py."""
        self._queue: list[Job] = []
        self._writing: list[Job] = []
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.now_ms: Callable[[], float] = lambda: 0.0
        """Now on the Redis server's clock (the consumer's)."""

    # -- background flushing --------------------------------------------------------------
    def add(self, jobs: list[Job]) -> None:
        self._queue.extend(jobs)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._flush_all())

    def queued(self) -> list[Job]:
        """Jobs waiting to be written, or being written."""
        return [*self._queue, *self._writing]

    async def drain(self, stopping: bool = False) -> None:
        """Wait until everything added so far is written (or given up at shutdown)."""
        self._stopping = self._stopping or stopping
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def aclose(self) -> None:
        if self.conn is not None:
            await self.conn.aclose()

    def _is_stopping(self) -> bool:
        return self._stopping

    async def _flush_all(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            self._writing = batch
            try:
                write = functools.partial(self.write, batch, {})  # one ``taken`` for all tries
                written = await until_done(write, self._is_stopping)
            except OutOfMemoryError as e:
                # Redis full: the SETs were refused, but FINISH ran (its first write, a DEL, is
                # never refused) and the entries were acknowledged: the askers, told to read
                # results that are not there, ask again, and get RedisFull while Redis is full.
                log.error("Redis is full (%s): %d results not stored; their askers ask again",
                          e, len(batch))  # fmt: skip
                written = False
            except Exception:
                # Refused (not unreachable: that is retried). The entries are let go: no longer
                # renewed, they are queued again by their producers or taken over by a worker.
                entries = sum(len(j.entries) for j in batch)
                log.exception("writing %d answers (%d entries) failed; left pending", len(batch),
                              entries)  # fmt: skip
                written = False
            self._writing = []
            if written and self.on_written is not None:
                self.on_written(batch)

    # -- one write ------------------------------------------------------------------------
    async def write(self, jobs: list[Job], taken: dict[int, set[Any]] | None = None) -> None:
        """Write ``jobs``' answers. On a cluster ``taken`` (job index -> the reply lists its
        FINISH took) is kept by the caller across tries: a try that fails after a FINISH ran
        (another shard's node refused a command, a NOSCRIPT rerun) took those waiter sets, and
        the next try's FINISH finds none, so their replies are pushed from here."""
        taken = {} if taken is None else taken
        ttl_ms = self.settings.result_ttl_s * 1000
        due = int(self.now_ms()) + min(ttl_ms, UNREAD_KEEP_MS)  # on the Redis clock
        replies = [self._reply(job) for job in jobs]
        groups = finish_groups(jobs)
        dead = any(job.dead is not None for job in jobs)
        finishes: list[tuple[list[int], int]] = []
        """(indices of its jobs, its place in the pipeline) of each FINISH call."""

        def build(pipe: Any) -> None:
            finishes.clear()
            for group in groups:
                by_shard: dict[int, list[int]] = defaultdict(list)
                new = [jobs[i] for i in group if jobs[i].shared and jobs[i].outcome == "computed"]
                unread: dict[int, list[Any]] = defaultdict(list)
                for job in new:
                    unread[job.shard] += [due, f"r:{job.digest}"]
                for shard, members in unread.items():  # first: a SET is never left untracked
                    pipe.execute_command("ZADD", self.keys.due(self.model, shard), *members)
                for job in new:
                    assert job.result is not None
                    # in parts on our own connection (sent uncopied), joined for redis-py
                    value = job.result if self.conn is not None else wire_bytes(job.result)
                    pipe.set(self.keys.result(self.model, job.shard, job.digest), value)
                for i in group:
                    job = jobs[i]
                    if job.digest:
                        by_shard[job.shard].append(i)
                for shard, members in by_shard.items():
                    answers = [(jobs[i].digest, replies[i]) for i in members]
                    call = finish_call(
                        self.keys, self.model, shard, not self.cluster, ttl_ms, answers
                    )
                    finishes.append((members, len(pipe)))
                    if dead:  # by source: no NOSCRIPT, whose re-run would add the letters twice
                        pipe.execute_command(*FINISH_SCRIPT.eval_command(*call))
                    else:
                        FINISH_SCRIPT.queue(pipe, *call)
            for job in jobs:
                if job.dead is not None:
                    for entry in job.entries:
                        self._dead_letter(pipe, entry.stream, entry.entry_id, entry.raw, job.dead)
            self._ack(pipe, jobs)

        if self.conn is not None:
            await execute_resp(self.conn, build, [FINISH_SCRIPT], WRITE_TIMEOUT_S)
            return

        def keep(results: list[Any]) -> None:
            for members, at in finishes:
                lists = results[at] if at < len(results) else None
                if isinstance(lists, list):  # this FINISH ran: its waiter sets are gone
                    for i, waiting in zip(members, lists, strict=True):
                        taken.setdefault(i, set()).update(waiting)

        if not self.cluster:
            await execute(self.redis, build, [FINISH_SCRIPT])
            return
        outcome = await execute(self.redis, build, [FINISH_SCRIPT], False, keep)
        errors = [r for r in outcome if isinstance(r, Exception)]
        if errors:
            raise errors[0]  # the next try pushes what this one's FINISH calls took
        pipe = self.redis.pipeline(transaction=False)
        for i, waiting in taken.items():
            for reply_list in waiting:
                pipe.rpush(reply_list, replies[i])
                pipe.pexpire(reply_list, ttl_ms)
        await pipe.execute()

    async def sweep(self, shards: int) -> int:
        """Give their TTL to the unread results that are due and delete the due waiter sets,
        in every shard (``SWEEP``); returns how many."""
        ttl_ms = self.settings.result_ttl_s * 1000
        taken = 0
        for shard in range(shards):
            prefixes = self.keys.digest_prefixes(self.model, shard)
            while True:
                n = int(
                    await run_script(
                        self.redis,
                        SWEEP_SCRIPT,
                        [self.keys.due(self.model, shard)],
                        [*prefixes, ttl_ms, SWEEP_TAKE],
                    )
                )
                taken += n
                if n < SWEEP_TAKE:
                    break
        return taken

    @staticmethod
    def _reply(job: Job) -> bytes:
        return protocol.encode_reply(job.digest, job.result, job.error)

    def _dead_letter(
        self, pipe: Any, stream: str, entry_id: str, raw: bytes | None, reason: str
    ) -> None:
        log.warning("dead-lettering %s %s: %s", stream, entry_id, reason)
        message = raw or b""
        pipe.xadd(
            self.keys.dead(self.model),
            {
                "stream": stream,
                "id": entry_id,
                "reason": reason,
                "m": message[:DEAD_LETTER_KEEP_BYTES],
                "size": len(message),
                "worker": self.name,
            },
            maxlen=DEAD_LETTERS_KEPT,
            approximate=True,
        )

    @staticmethod
    def _ack(pipe: Any, jobs: list[Job]) -> None:
        by_stream: dict[str, list[str]] = defaultdict(list)
        for job in jobs:
            for e in job.entries:
                by_stream[e.stream].append(e.entry_id)
        for stream, ids in by_stream.items():
            pipe.xack(stream, GROUP, *ids)
            pipe.xdel(stream, *ids)


def finish_groups(jobs: list[Job]) -> list[list[int]]:
    """Indices of ``jobs`` in groups of about ``FINISH_EVERY_BYTES`` of results: each group's
    results are followed by its own FINISH in the pipeline, so Redis pushes their replies as
    soon as it has read them, and their askers fetch them while later results still arrive
    (64 full rows are 12.5 MB: one FINISH at the end kept every asker waiting for all)."""
    groups: list[list[int]] = [[]]
    size = 0
    for i, job in enumerate(jobs):
        if size >= FINISH_EVERY_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += wire_len(job.result) if job.result is not None else 0
    return groups


async def until_done(step: Callable[[], Awaitable[None]], give_up: Callable[[], bool]) -> bool:
    """Run a Redis step until it succeeds, riding out outages; False if ``give_up()`` says so
    while Redis is unreachable (the entries then stay pending: another worker reclaims them)."""
    backoff, outage = Backoff(), OutageLog(log, "to write answers")
    while True:
        try:
            await step()
            outage.answered()
            return True
        except TRANSIENT as e:
            if give_up():
                log.error("Redis unreachable at shutdown (%r): entries stay pending", e)
                return False
            wait = backoff.step()
            outage.failed(e)
            await asyncio.sleep(wait)
