"""The stream consumer: read, validate, dedupe, compute, write, acknowledge.

One reader task keeps a buffer of up to ``max_batch`` stream entries filled while the model
runs in a thread, so Redis I/O for the next batch overlaps the forward pass. A batch runs as
soon as the model is free; a partly filled one first waits ``max_wait_ms`` for company.
Entries are acknowledged (and deleted) only after their result is written: a crash leaves them
pending, and another worker reclaims them (see ``worker.reclaim``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from shared import protocol
from shared.errors import InvalidRequest, LMPoolError, ProtocolError, WireError, error_to_wire
from shared.keys import GROUP, Keys, request_digest
from shared.protocol import Request
from shared.redis_conn import TRANSIENT, Backoff
from shared.scripts import FINISH_SCRIPT, execute
from shared.settings import Settings
from worker.backends.base import Backend
from worker.leases import LeaseKeeper
from worker.metrics import Metrics

log = logging.getLogger("lmpool.worker")
BLOCK_MS = 1000
"""Longest blocking read: also the longest a stop waits for the reader."""
INTERACTIVE_RECENT_S = 5.0
"""Offline work runs in small batches for this long after the last interactive request."""
INTERACTIVE_GRACE_S = 0.005
"""After an interactive batch, offline work waits this long: a caller that sends its next
request as soon as it has an answer (an SMC loop) gets it in ahead of the offline queue."""
OFFLINE_SHARE_EVERY = 4
"""...except after this many interactive batches in a row: then one offline batch may run, so
a busy interactive caller never stops a batch job completely."""


@dataclass
class Entry:
    """One stream entry as read."""

    stream: str
    entry_id: str
    raw: bytes | None


@dataclass
class Job:
    """One distinct request (a digest) and every stream entry that asked for it."""

    digest: str
    request: Request
    entries: list[Entry]
    result: bytes | None = None
    error: WireError | None = None
    cached: bool = False
    nobody_waits: bool = False


@dataclass
class Stats:
    """Counters published in the heartbeat."""

    requests: int = 0
    batches: int = 0
    computed: int = 0
    cache_hits: int = 0
    skipped: int = 0
    errors: int = 0
    dead_letters: int = 0
    busy_s: float = 0.0
    recent: list[tuple[float, int]] = field(default_factory=list)

    def record_batch(self, n: int) -> None:
        now = time.monotonic()
        self.recent.append((now, n))
        while self.recent and self.recent[0][0] < now - 60:
            self.recent.pop(0)

    def per_second(self) -> float:
        """Requests per second over the last minute."""
        if not self.recent:
            return 0.0
        span = max(time.monotonic() - self.recent[0][0], 1.0)
        return sum(n for _, n in self.recent) / span


class Consumer:
    def __init__(
        self, redis: Redis, backend: Backend, settings: Settings, consumer_name: str
    ) -> None:
        self.redis = redis
        self.backend = backend
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.model = settings.served_model_name
        self.streams = self.keys.streams(self.model, settings.shards)
        self.leases: LeaseKeeper | None = None
        """Set by the pool worker; None means this consumer owns every shard."""
        self.name = consumer_name
        self.stats = Stats()
        self.metrics: Metrics | None = None
        self._buffer: list[Entry] = []
        self._reclaimable: list[tuple[str, str]] = []
        self._last_interactive = -1e9
        self._busy = False
        self._offline_after = 0.0
        self._held_back = 0
        """Interactive batches since offline work last ran (for its guaranteed share)."""
        self._have = asyncio.Event()
        self._room = asyncio.Event()
        self._stopping = asyncio.Event()
        self._reader_done = asyncio.Event()

    # -- lifecycle ----------------------------------------------------------------------
    async def ensure_groups(self) -> None:
        """Create the consumer group on each stream; idempotent."""
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    async def run(self) -> None:
        """Serve until ``stop()``; then finish and acknowledge what was read, and return."""
        await self.ensure_groups()
        reader = asyncio.create_task(self._read_loop(), name="lmpool-reader")
        try:
            await self._compute_loop()
        finally:
            self._stopping.set()
            await reader

    def stop(self) -> None:
        self._stopping.set()
        self._room.set()

    def add_reclaimable(self, stream: str, entry_ids: list[str]) -> None:
        """Queue entries of a dead consumer, to be claimed and run one at a time.

        One of them may be what killed that consumer. Each is claimed only just before it runs,
        alone: if it kills this worker too, only its own delivery count grows, so it reaches
        the dead-letter stream without dragging its innocent batch mates along.
        """
        queued = set(self._reclaimable)
        self._reclaimable.extend((stream, i) for i in entry_ids if (stream, i) not in queued)
        self._have.set()

    async def claim(self, stream: str, entry_ids: list[str]) -> list[Entry]:
        """Take entries over from whichever consumer holds them, if still idle long enough."""
        idle_ms = int(self.settings.claim_after_s * 1000)
        items = await self.redis.xclaim(
            stream, GROUP, self.name, min_idle_time=idle_ms, message_ids=list[Any](entry_ids)
        )
        return entries_of(stream, [(i, f) for i, f in items if i is not None])

    # -- read -----------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        backoff = Backoff()
        try:
            while not self._stopping.is_set():
                room = self.settings.max_batch - len(self._buffer)
                if room <= 0:
                    self._room.clear()
                    await self._room.wait()
                    continue
                try:
                    entries = await self._read(room)
                except TRANSIENT as e:
                    wait = backoff.step()
                    log.warning("Redis unreachable while reading (%r); retry in %.2fs", e, wait)
                    await asyncio.sleep(wait)
                    continue
                backoff.reset()
                if entries:
                    self._buffer.extend(entries)
                    self._have.set()
        except Exception:
            log.exception("stream reader failed")
            raise
        finally:
            self._reader_done.set()
            self._have.set()

    def _shard_streams(self) -> tuple[list[str], list[str]]:
        """Interactive streams of the shards this worker owns, and of the others."""
        shards = self.settings.shards
        owned = set(range(shards)) if self.leases is None else self.leases.owned
        mine = [self.keys.stream(self.model, "high", s) for s in sorted(owned)]
        others = [self.keys.stream(self.model, "high", s) for s in range(shards) if s not in owned]
        return mine, others

    def _offline_count(self, count: int) -> int:
        """How much offline work to take now. None while other entries wait (offline work is
        never read ahead of interactive work). While interactive requests came recently: none
        while the model is busy (an interactive request arriving meanwhile goes next) and small
        batches when it is idle, so that one arriving waits for a short batch at most."""
        now = time.monotonic()
        recent = now - self._last_interactive < INTERACTIVE_RECENT_S
        if self._buffer or (recent and self._busy) or now < self._offline_after:
            return 0
        return min(count, self.settings.offline_batch) if recent else count

    async def _read(self, count: int) -> list[Entry]:
        """Up to ``count`` new entries in this order: own shards, other shards whose owner is
        gone or lagging (stealing), offline work; blocks briefly when there is none."""
        mine, others = self._shard_streams()
        low = self.keys.stream(self.model, "low")
        offline = self._offline_count(count)
        try:
            stealable = await self._stealable(others)
            for streams, n in ((mine, count), (stealable, count), ([low], offline)):
                if streams and n:
                    reply = await self.redis.xreadgroup(
                        GROUP, self.name, dict.fromkeys(streams, ">"), count=n
                    )
                    if reply:
                        return parse_entries(reply)
            # Block on our own streams, no longer than a heartbeat (when leases may change);
            # with other shards around, wake up soon to look for work to take over.
            block_ms = min(BLOCK_MS, int(1000 * self.settings.heartbeat_s))
            if others:
                block_ms = min(block_ms, int(2 * self.settings.steal_after_ms))
            grace_ms = (self._offline_after - time.monotonic()) * 1000
            if grace_ms > 0:  # hold offline work back: the next interactive request is near
                block_ms = min(block_ms, int(grace_ms) + 1)
            block_ms = max(block_ms, 1)
            if self._buffer or (self._busy and not offline):
                # the model is busy or has work waiting: look again as soon as that changes
                # (offline work may then be read), rather than block on interactive streams
                self._room.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._room.wait(), block_ms / 1000)
                return []
            streams = [*mine, low] if offline else mine
            if not streams:
                await asyncio.sleep(block_ms / 1000)
                return []
            reply = await self.redis.xreadgroup(
                GROUP,
                self.name,
                dict.fromkeys(streams, ">"),
                count=min(count, offline) if offline else count,
                block=block_ms,
            )
            return parse_entries(reply)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await self.ensure_groups()  # the stream was deleted under us (FLUSHDB, DEL)
            return []

    async def _stealable(self, streams: list[str]) -> list[str]:
        """Those of ``streams`` with undelivered entries that nobody owns, or whose oldest
        undelivered entry waited ``steal_after_ms``: their owner is dead or busy."""
        if not streams:
            return []
        pipe = self.redis.pipeline(transaction=False)
        pipe.time()
        for stream in streams:
            shard = int(stream.rsplit(":", 1)[1])
            pipe.exists(self.keys.lease(self.model, shard))
            pipe.xinfo_groups(stream)
        replies = await pipe.execute(raise_on_error=False)
        if any(isinstance(r, TRANSIENT) for r in replies):
            raise next(r for r in replies if isinstance(r, TRANSIENT))
        if isinstance(replies[0], Exception):
            return []
        seconds, micros = replies[0]
        now_ms = seconds * 1000 + micros // 1000
        lagging: list[tuple[str, bytes]] = []
        out: list[str] = []
        for i, stream in enumerate(streams):
            owned, groups = replies[1 + 2 * i], replies[2 + 2 * i]
            if isinstance(owned, Exception) or isinstance(groups, Exception):
                continue  # a stream not created yet, say: nothing to take
            group = next((g for g in groups or [] if _s(g.get("name")) == GROUP), None)
            if group is None or not group.get("lag"):
                continue
            if not owned:
                out.append(stream)
            else:
                lagging.append((stream, group["last-delivered-id"]))
        if lagging:
            pipe = self.redis.pipeline(transaction=False)
            for stream, last in lagging:
                pipe.xrange(stream, min=b"(" + _b(last), count=1)
            for (stream, _), first in zip(lagging, await pipe.execute(), strict=True):
                if (
                    first
                    and now_ms - int(_s(first[0][0]).split("-")[0]) >= self.settings.steal_after_ms
                ):
                    out.append(stream)
        return out

    # -- compute ------------------------------------------------------------------------
    async def _compute_loop(self) -> None:
        while True:
            if self._reclaimable:
                await asyncio.shield(self._process_reclaimed(*self._reclaimable.pop(0)))
                continue
            if not self._buffer:
                if self._reader_done.is_set():
                    return
                self._have.clear()
                await self._have.wait()
                continue
            if len(self._buffer) < self.settings.max_batch and self.settings.max_wait_ms:
                await asyncio.sleep(self.settings.max_wait_ms / 1000)
            # interactive entries first (sort is stable: arrival order within each kind)
            self._buffer.sort(key=lambda e: e.stream.endswith(":low"))
            batch = self._buffer[: self.settings.max_batch]
            del self._buffer[: self.settings.max_batch]
            if any(not e.stream.endswith(":low") for e in batch):
                self._last_interactive = time.monotonic()
            self._room.set()
            self._busy = True
            try:
                await asyncio.shield(self.process(batch))
            finally:
                self._busy = False
                if all(e.stream.endswith(":low") for e in batch):
                    self._held_back = 0
                elif self._held_back < OFFLINE_SHARE_EVERY:
                    self._held_back += 1
                    self._offline_after = time.monotonic() + INTERACTIVE_GRACE_S
                else:  # offline work's guaranteed share: no grace this time
                    self._offline_after = 0.0
                self._room.set()  # wake the reader: the model is free

    async def _process_reclaimed(self, stream: str, entry_id: str) -> None:
        claimed: list[Entry] = []

        async def claim_it() -> None:
            claimed[:] = await self.claim(stream, [entry_id])

        if await self._until_done(claim_it) and claimed:
            log.warning("reclaimed %s %s from a dead consumer", stream, entry_id)
            await self.process(claimed)

    async def process(self, entries: list[Entry]) -> None:
        """Answer one batch of entries and acknowledge them."""
        started = time.monotonic()
        jobs, dead = self._decode(entries)
        if not await self._until_done(lambda: self._triage(jobs)):
            return
        todo = [j for j in jobs if j.result is None and j.error is None and not j.nobody_waits]
        if todo:
            await asyncio.to_thread(self._compute, todo)
        if not await self._until_done(lambda: self._write(jobs, dead)):
            return
        elapsed = time.monotonic() - started
        self.stats.batches += 1
        self.stats.requests += len(entries)
        self.stats.busy_s += elapsed
        self.stats.record_batch(len(entries))
        if self.metrics is not None:
            self.metrics.observe_batch([e.entry_id for e in entries], elapsed, outcomes(jobs, dead))
        if log.isEnabledFor(logging.DEBUG):
            answered = {j.digest: outcome_of(j) for j in jobs}
            log.debug(
                "batch of %d entries, %d distinct, %d computed in %.1f ms: %s",
                len(entries),
                len(jobs),
                len(todo),
                1000 * elapsed,
                " ".join(f"{d[:12]}={o}" for d, o in answered.items()),
                extra={"worker": self.name, "requests": answered, "seconds": elapsed},
            )

    async def _until_done(self, step: Callable[[], Awaitable[None]]) -> bool:
        """Run a Redis step until it succeeds, riding out outages; False if stopped meanwhile.

        Giving up leaves the entries pending: another worker reclaims them later.
        """
        backoff = Backoff()
        while True:
            try:
                await step()
                return True
            except TRANSIENT as e:
                if self._stopping.is_set() and self._reader_done.is_set():
                    log.error("Redis unreachable at shutdown (%r): entries stay pending", e)
                    return False
                wait = backoff.step()
                log.warning("Redis unreachable (%r); retry in %.2fs", e, wait)
                await asyncio.sleep(wait)

    def _decode(self, entries: list[Entry]) -> tuple[list[Job], list[tuple[Entry, str]]]:
        """Group entries by digest; undecodable ones go to the dead-letter list with a reason."""
        jobs: dict[str, Job] = {}
        dead: list[tuple[Entry, str]] = []
        for entry in entries:
            try:
                if entry.raw is None:
                    raise ProtocolError("stream entry has no message field")
                req = protocol.decode_request(entry.raw, self.settings.max_message_bytes)
            except ProtocolError as e:
                dead.append((entry, str(e)))
                continue
            job = jobs.get(req["digest"])
            if job is not None:
                job.entries.append(entry)
                continue
            job = jobs[req["digest"]] = Job(req["digest"], req, [entry])
            try:
                self._validate(req)
            except LMPoolError as e:
                job.error = error_to_wire(e)
        return list(jobs.values()), dead

    def _validate(self, req: Request) -> None:
        kind, params = req["kind"], req["params"]
        if kind not in protocol.KINDS:
            raise InvalidRequest(f"unknown request kind {kind!r}")
        self.backend.check_prompt(req["ids"], req["lora"], self.settings.max_prompt_tokens)
        if kind == "sample":
            check_sample_params(params, self.backend.info.vocab_size)
        elif kind == "score":
            cont = params.get("cont")
            if not isinstance(cont, list) or not cont:
                raise InvalidRequest("score needs a non-empty continuation")
            self.backend.check_prompt(
                req["ids"] + cont, req["lora"], self.settings.max_prompt_tokens
            )
        elif params:
            raise InvalidRequest(f"{kind} takes no parameters, got {sorted(params)}")
        expected = request_digest(
            self.backend.info.fingerprint,
            kind,
            req["ids"],
            req["lora"],
            protocol.canonical_params(kind, params),
        )
        if expected != req["digest"]:
            raise InvalidRequest(
                "request digest does not match its content for this worker's model "
                f"(fingerprint {self.backend.info.fingerprint}): the producer sees other model "
                "metadata; reconnect it"
            )

    async def _triage(self, jobs: list[Job]) -> None:
        """One round trip: which results already exist, and does anyone still wait?"""
        live = [j for j in jobs if j.error is None]
        if not live:
            return
        pipe = self.redis.pipeline(transaction=False)
        for job in live:
            pipe.get(self.keys.result(self.model, job.digest))
            pipe.scard(self.keys.waiters(self.model, job.digest))
        answers = await pipe.execute()
        for i, job in enumerate(live):
            cached, waiting = answers[2 * i], answers[2 * i + 1]
            if cached is not None:
                job.result, job.cached = cached, True
                self.stats.cache_hits += 1
            elif not waiting:
                job.nobody_waits = True  # every asker timed out or cancelled
                self.stats.skipped += 1

    def _compute(self, jobs: list[Job]) -> None:
        """Runs in a worker thread: one forward pass per (kind, adapter) group."""
        groups: dict[tuple[str, str | None], list[Job]] = defaultdict(list)
        for job in jobs:
            groups[(job.request["kind"], job.request["lora"])].append(job)
        for (kind, lora), group in groups.items():
            if kind == "logprobs":
                self._compute_logprobs(group, lora)
            else:
                for job in group:
                    self._run_one(job)
        self.stats.computed += len(jobs)

    def _compute_logprobs(self, group: list[Job], lora: str | None) -> None:
        try:
            rows = self.backend.logprobs([j.request["ids"] for j in group], lora)
        except Exception:
            if len(group) == 1:
                self._run_one(group[0])
                return
            log.warning("batch of %d failed; retrying one by one", len(group), exc_info=True)
            for job in group:
                self._run_one(job)
            return
        for job, row in zip(group, rows, strict=True):
            job.result = protocol.encode_result(row)

    def _run_one(self, job: Job) -> None:
        req = job.request
        params: dict[str, Any] = req["params"]
        try:
            if req["kind"] == "logprobs":
                out = self.backend.logprobs([req["ids"]], req["lora"])[0]
            elif req["kind"] == "cache_kv":
                import torch

                pin = getattr(self.backend, "pin_prefix", None)
                pinned = bool(pin(req["ids"], req["lora"])) if callable(pin) else False
                out = torch.tensor([int(pinned)], dtype=torch.int64)
            elif req["kind"] == "sample":
                import torch

                tokens = self.backend.sample(
                    req["ids"],
                    params["max_tokens"],
                    params["eos"],
                    params["temperature"],
                    params.get("seed"),
                    req["lora"],
                )
                out = torch.tensor(tokens, dtype=torch.int64)
            else:
                out = self.backend.score(req["ids"], params["cont"], req["lora"]).float()
            job.result = protocol.encode_result(out)
        except Exception as e:
            log.warning(
                "request %s failed: %r",
                job.digest,
                e,
                extra={"digest": job.digest, "worker": self.name},
            )
            job.error = error_to_wire(e)
            self.stats.errors += 1

    async def _write(self, jobs: list[Job], dead: list[tuple[Entry, str]]) -> None:
        """Two pipelines: SET each result then FINISH it (which hands back its waiters); then
        the replies, dead letters, and XACK + XDEL of every entry."""
        ttl_ms = self.settings.result_ttl_s * 1000

        def results_then_finish(pipe: Any) -> None:
            for job in jobs:
                # a cache_kv answer describes this worker's state, not the model: not shared
                shared = job.request["kind"] != "cache_kv" and not job.nobody_waits
                if job.result is not None and job.error is None and shared:
                    pipe.set(self.keys.result(self.model, job.digest), job.result, px=ttl_ms)
                FINISH_SCRIPT.queue(
                    pipe,
                    [
                        self.keys.waiters(self.model, job.digest),
                        self.keys.inflight(self.model, job.digest),
                    ],
                    [],
                )

        outcome = await execute(self.redis, results_then_finish, [FINISH_SCRIPT])
        waiters = [w for w in outcome if isinstance(w, list)]
        pipe = self.redis.pipeline(transaction=False)
        for job, lists in zip(jobs, waiters, strict=True):
            if not lists or job.nobody_waits:
                continue
            if job.error is not None:
                reply = protocol.encode_reply(job.digest, error=job.error)
            else:
                assert job.result is not None
                reply = protocol.encode_reply(job.digest, job.result)
            for reply_list in lists:
                pipe.rpush(reply_list, reply)
                pipe.pexpire(reply_list, ttl_ms)
        for entry, reason in dead:
            self._dead_letter(pipe, entry, reason)
        self._ack(pipe, [e for j in jobs for e in j.entries] + [e for e, _ in dead])
        await pipe.execute()

    def _dead_letter(self, pipe: Any, entry: Entry, reason: str) -> None:
        log.warning("dead-lettering %s %s: %s", entry.stream, entry.entry_id, reason)
        self.stats.dead_letters += 1
        pipe.xadd(
            self.keys.dead(self.model),
            {
                "stream": entry.stream,
                "id": entry.entry_id,
                "reason": reason,
                "m": entry.raw or b"",
                "worker": self.name,
            },
            maxlen=10_000,
            approximate=True,
        )

    @staticmethod
    def _ack(pipe: Any, entries: list[Entry]) -> None:
        by_stream: dict[str, list[str]] = defaultdict(list)
        for e in entries:
            by_stream[e.stream].append(e.entry_id)
        for stream, ids in by_stream.items():
            pipe.xack(stream, GROUP, *ids)
            pipe.xdel(stream, *ids)


def outcome_of(job: Job) -> str:
    if job.nobody_waits:
        return "skipped"
    if job.error is not None:
        return "error"
    return "cache_hit" if job.cached else "computed"


def outcomes(jobs: list[Job], dead: list[tuple[Entry, str]]) -> dict[str, int]:
    """Counts per outcome for the metrics (extra entries of one digest are duplicates)."""
    counts = dict.fromkeys(("computed", "cache_hit", "skipped", "error"), 0)
    for job in jobs:
        counts[outcome_of(job)] += 1
    counts["dead_letter"] = len(dead)
    counts["duplicate"] = sum(len(j.entries) - 1 for j in jobs if j.entries)
    return counts


def check_sample_params(params: dict[str, Any], vocab_size: int) -> None:
    max_tokens, eos = params.get("max_tokens"), params.get("eos")
    temperature, seed = params.get("temperature"), params.get("seed")
    if type(max_tokens) is not int or not 0 <= max_tokens <= 1_000_000:
        raise InvalidRequest(f"max_tokens must be a non-negative int, got {max_tokens!r}")
    if not isinstance(eos, list) or not all(type(t) is int for t in eos):
        raise InvalidRequest("eos_token_ids must be a list of ints")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise InvalidRequest(f"temperature must be > 0, got {temperature!r}")
    if seed is not None and type(seed) is not int:
        raise InvalidRequest(f"seed must be an int or None, got {seed!r}")
    if set(params) - {"max_tokens", "eos", "temperature", "seed"}:
        raise InvalidRequest(f"unknown sample parameters {sorted(params)}")


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _b(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def parse_entries(reply: Any) -> list[Entry]:
    """Entries from an XREADGROUP / XCLAIM reply (deleted entries come back without fields)."""
    out: list[Entry] = []
    for stream, items in reply or []:
        name = stream.decode() if isinstance(stream, bytes) else stream
        out.extend(entries_of(name, items))
    return out


def entries_of(stream: str, items: Any) -> list[Entry]:
    out = []
    for entry_id, fields in items:
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        out.append(Entry(stream, eid, (fields or {}).get(protocol.MESSAGE_FIELD)))
    return out
