"""One worker's request path, wired: reader -> batcher -> compute -> writer.

The reader task keeps up to two steps' worth of jobs queued ahead of the model (so a step's
successor is ready when it ends) and no more (so priorities and skips are decided late); with
tenants, two steps' worth per tenant (so one tenant's flood leaves room for another's request). The
compute loop steps the backend; the writer stores and acknowledges in the background.
``stop()`` stops reading; ``run()`` then finishes every job in hand, writes and acknowledges
it, and returns. An engine that dies (``EngineDead``) ends ``run()`` with that error at once,
leaving its entries pending for other workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from shared.aio import OutageLog
from shared.errors import DeadLettered
from shared.redis_conn import TRANSIENT, AnyRedis, Backoff
from shared.registry import is_runtime_adapter
from shared.settings import Settings
from worker.adapters import AdapterLoader
from worker.backends.base import Backend, Work
from worker.leases import LeaseKeeper
from worker.metrics import Metrics
from worker.stream.batcher import Batcher, Job, valid_digest
from worker.stream.compute import Compute
from worker.stream.reader import Entry, Reader
from worker.stream.writer import Writer, until_done

log = logging.getLogger("lmpool.worker")
AHEAD_STEPS = 2
"""Jobs queued or running, in units of ``max_batch``, before the reader waits."""


TENANT_FIELDS = ("requests", "computed", "prompt_tokens", "cache_hits", "wait_s", "compute_s")
"""Per-tenant counters: entries answered, distinct requests computed and their prompt tokens,
cache hits (found by the worker), seconds entries waited in their streams before this worker
read them, and seconds of backend steps (each step's time shared equally by its rows)."""
RATE_WINDOW_S = 60.0
"""The window of a worker's published request rate."""
NO_TENANT = "-"
"""How requests with no tenant are counted."""


@dataclass
class Stats:
    """Counters published in the heartbeat."""

    requests: int = 0
    batches: int = 0
    computed: int = 0
    cache_hits: int = 0
    skipped: int = 0
    errors: int = 0
    expired: int = 0
    """Of ``errors``: answered ``Expired`` (their askers had given up before they ran)."""
    dead_letters: int = 0
    busy_s: float = 0.0
    recent: list[tuple[float, int]] = field(default_factory=list)
    """(monotonic time, requests) of each recorded step of the last ``RATE_WINDOW_S``."""
    started: float = field(default_factory=time.monotonic)
    tenants: dict[str, dict[str, float]] = field(default_factory=dict)
    """Tenant (``NO_TENANT`` for none) -> ``TENANT_FIELDS`` counters."""

    def tenant(self, name: str) -> dict[str, float]:
        key = name or NO_TENANT
        known = self.tenants.get(key)
        if known is None:
            known = self.tenants[key] = dict.fromkeys(TENANT_FIELDS, 0.0)
        return known

    def record(self, jobs: list[Job]) -> None:
        n = sum(len(j.entries) for j in jobs)
        self.requests += n
        for job in jobs:
            # a job merges every entry that asked for its digest: each entry is one request
            # of its own tenant; the computation is counted once, for the first entry's
            for entry in job.entries:
                counters = self.tenant(entry.tenant)
                counters["requests"] += 1
                counters["wait_s"] += entry.waited_s  # with its answer: wait_s / requests holds
            if job.entries:
                first = self.tenant(job.tenant)
                if job.outcome == "computed":
                    first["computed"] += 1
                    first["prompt_tokens"] += len(job.work.ids) if job.work is not None else 0
                elif job.outcome == "cache_hit":
                    first["cache_hits"] += 1
            if job.outcome == "cache_hit":
                self.cache_hits += 1
            elif job.outcome == "skipped":
                self.skipped += 1
            elif job.outcome == "dead_letter":
                self.dead_letters += 1
            elif job.outcome in ("error", "expired"):
                self.errors += 1
                self.expired += job.outcome == "expired"
        now = time.monotonic()
        self.recent.append((now, n))
        self._forget_old(now)

    def per_second(self, now: float | None = None) -> float:
        """Requests per second over the last minute (``RATE_WINDOW_S``; since the start when
        that is shorter, and at least a second): 0 for a worker idle that long."""
        now = time.monotonic() if now is None else now
        self._forget_old(now)
        span = max(min(now - self.started, RATE_WINDOW_S), 1.0)
        return sum(n for _, n in self.recent) / span

    def _forget_old(self, now: float) -> None:
        edge = now - RATE_WINDOW_S
        while self.recent and self.recent[0][0] < edge:
            self.recent.pop(0)


class Consumer:
    def __init__(
        self,
        redis: AnyRedis,
        backend: Backend,
        settings: Settings,
        consumer_name: str,
        cluster: bool = False,
    ) -> None:
        self.redis = redis
        self.backend = backend
        self.settings = settings
        self.name = consumer_name
        self.stats = Stats()
        self.metrics: Metrics | None = None
        self.clock_offset_ms = 0.0
        """Redis server time minus this host's (ms): deadlines and entry ages are on its clock."""
        self.reader = Reader(redis, settings, consumer_name)
        self.reader.cluster = cluster
        self.reader.now_ms = self.now_ms
        self.batcher = Batcher(backend, settings)
        self.writer = Writer(redis, settings, consumer_name, cluster, self._written)
        self.writer.now_ms = self.now_ms
        self.compute = Compute(
            backend, settings, self.writer.add, self._stepped, self.now_ms, self._triage
        )
        self.compute.wake_reader = self.reader.room.set
        self.adapters = AdapterLoader(redis, backend, settings, self.compute.call)
        self._reclaimable: list[tuple[str, str, int]] = []
        """(stream, entry id, deliveries when queued) of each entry to take over."""
        self._stopping = asyncio.Event()
        self._reader_done = asyncio.Event()

    @property
    def leases(self) -> LeaseKeeper | None:
        return self.reader.leases

    @leases.setter
    def leases(self, keeper: LeaseKeeper | None) -> None:
        self.reader.leases = keeper

    @property
    def streams(self) -> list[str]:
        return self.reader.streams

    def now_ms(self) -> float:
        """Now on the Redis server's clock."""
        return time.time() * 1000 + self.clock_offset_ms

    # -- lifecycle ----------------------------------------------------------------------
    async def ensure_groups(self) -> None:
        await self.reader.ensure_groups()

    async def run(self) -> None:
        """Serve until ``stop()``; then finish and acknowledge what was read, and return."""
        await self.ensure_groups()
        reader = asyncio.create_task(self._read_loop(), name="lmpool-reader")
        try:
            await self.compute.run_until(self._reader_done.is_set, self._run_reclaimed)
        except BaseException:
            self.stop()
            reader.cancel()
            raise
        await reader
        await self.writer.drain(stopping=True)
        await self.compute.settled()
        await self.writer.aclose()

    def stop(self) -> None:
        self._stopping.set()
        self.reader.room.set()
        self.compute.have.set()

    def add_reclaimable(
        self, stream: str, entry_ids: list[str], delivered: dict[str, int] | None = None
    ) -> list[str]:
        """Queue entries of a dead consumer, to be claimed and run one at a time (``delivered``:
        how often each was delivered so far); returns the ids not queued before."""
        queued = {(s, i) for s, i, _ in self._reclaimable}
        new = [i for i in entry_ids if (stream, i) not in queued]
        self._reclaimable.extend((stream, i, (delivered or {}).get(i, 0)) for i in new)
        self.compute.have.set()
        return new

    # -- reading --------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        backoff, outage = Backoff(), OutageLog(log, "while reading")
        try:
            while not self._stopping.is_set():
                self.reader.room.clear()  # before looking, so a change after it wakes us
                room, caps = self._room()
                if room <= 0:
                    await self.reader.room.wait()
                    continue
                try:
                    entries = await self.reader.read(room, self.compute, caps)
                    if entries:
                        await self._take(entries)
                except TRANSIENT as e:
                    wait = backoff.step()
                    outage.failed(e)
                    await asyncio.sleep(wait)
                    continue
                backoff.reset()
                outage.answered()
        except Exception:
            log.exception("stream reader failed")
            raise
        finally:
            self._reader_done.set()
            self.compute.have.set()

    def _room(self) -> tuple[int, dict[str, int] | None]:
        """How many entries the reader may take now, and with tenants, how many each tenant
        may (``AHEAD_STEPS`` batches each: one tenant's flood fills its own look-ahead, never
        another's)."""
        cap = AHEAD_STEPS * self.settings.max_batch
        if not self.reader.tenants:
            return cap - self.compute.outstanding, None
        held: dict[str, int] = {}
        for job in self.compute.active.values():
            tenant = job.tenant
            held[tenant] = held.get(tenant, 0) + 1
        names = {"", *(t for ts in self.reader.tenants.values() for t in ts)}
        caps = {t: cap - held.get(t, 0) for t in names}
        return sum(max(c, 0) for c in caps.values()), caps

    async def _triage(self, jobs: list[Job]) -> None:
        await until_done(lambda: self.batcher.triage(self.redis, jobs), self._stopping.is_set)

    async def _take(self, entries: list[Entry], alone: bool = False) -> list[Job]:
        most = self.settings.max_deliveries
        doomed = [e for e in entries if e.carried >= most]  # its earlier copies killed workers
        if doomed:
            await self.dead_letter(doomed, {e.entry_id: e.carried for e in doomed})
            entries = [e for e in entries if e.carried < most]
        now_ms = self.now_ms()
        for entry in entries:
            entry.waited_s = max(now_ms - entry.added_ms, 0) / 1000
        jobs = self.batcher.jobs(entries, now_ms, force_triage=alone)
        await self._triage(jobs)
        runtime = {
            j.work.lora for j in jobs if j.work is not None and is_runtime_adapter(j.work.lora)
        }
        if runtime:
            failed = await self.adapters.ensure(runtime)  # type: ignore[arg-type]
            for job in jobs:
                if job.work is not None and job.work.lora in failed:
                    job.fail(failed[job.work.lora])
                    job.work = None
        if alone:
            return jobs
        self.compute.add(jobs)
        return jobs

    # -- taking over ----------------------------------------------------------------------
    async def _run_reclaimed(self) -> bool:
        """Claim one reclaimable entry and run it alone; False when there is none."""
        while self._reclaimable:
            stream, entry_id, delivered = self._reclaimable.pop(0)
            claimed = await self._claim(stream, entry_id)
            for entry in claimed:  # its deliveries, its earlier copies' too: at the limit, _take
                entry.carried += delivered  # dead-letters it instead of running it
            if not claimed:
                continue
            log.info("running %s %s alone, claimed from a dead consumer", stream, entry_id)
            jobs = await self._take(claimed, alone=True)
            todo = [j for j in jobs if j.work is not None]
            settled = [j for j in jobs if j.work is None]
            if settled:
                self.writer.add(settled)
            for job in todo:
                self.compute.active[job.key] = job
            if todo:
                await self.compute.step(only=todo)
                while any(j.key in self.compute.active for j in todo):
                    await self.compute.step(only=[])
            return True
        return False

    async def _claim(self, stream: str, entry_id: str) -> list[Entry]:
        claimed: list[Entry] = []

        async def claim_it() -> None:
            claimed[:] = await self.reader.claim(stream, [entry_id])

        await until_done(claim_it, self._stopping.is_set)
        return claimed

    async def dead_letter(self, entries: list[Entry], deliveries: dict[str, int]) -> None:
        """Answer each entry's waiters with ``DeadLettered``, record it, acknowledge it."""
        jobs = []
        for entry in entries:
            reason = (
                f"request was delivered {deliveries.get(entry.entry_id, '?')} times and never "
                "answered (each time its worker died): it may crash the model"
            )
            job = Job(valid_digest(entry.digest), entry.shard, [entry], dead=reason)
            job.fail(DeadLettered(reason), "dead_letter")
            jobs.append(job)
        await self.writer.write(jobs)
        self._written(jobs)

    def held(self) -> list[tuple[str, str]]:
        """(stream, id) of each entry this worker holds in memory (read, not acknowledged)."""
        jobs = [*self.compute.active.values(), *self.writer.queued()]
        return [(e.stream, e.entry_id) for job in jobs for e in job.entries]

    def held_entries(self) -> set[str]:
        """Ids of the entries this worker holds in memory."""
        return {entry_id for _, entry_id in self.held()}

    # -- bookkeeping ----------------------------------------------------------------------
    def _stepped(self, works: list[Work], seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_step(len(works), seconds)
        # the step's time is its rows': those it finished and those it advanced (generations)
        ran = self.backend.stepped or works
        for work in ran:
            job = work.tag
            tenant = job.tenant if isinstance(job, Job) else ""
            self.stats.tenant(tenant)["compute_s"] += seconds / len(ran)
        if works:
            high = [w.high for w in works]
            self.reader.note_step(any(high), not any(high))
        self.reader.step_ended()

    def _written(self, jobs: list[Job]) -> None:
        self.compute.written()
        self.stats.record(jobs)
        self.stats.batches = self.compute.steps
        self.stats.computed = self.compute.computed
        self.stats.busy_s = self.compute.busy_s
        entries = [e for j in jobs for e in j.entries]
        if self.metrics is not None:
            self.metrics.observe_written(
                [e.entry_id for e in entries], [j.outcome for j in jobs], self.now_ms()
            )
            self.metrics.observe_tenants(self.stats.tenants)
        if log.isEnabledFor(logging.DEBUG):
            answered = {j.digest: j.outcome for j in jobs}
            log.debug(
                "answered %d entries, %d distinct: %s",
                len(entries),
                len(jobs),
                " ".join(f"{d[:12]}={o}" for d, o in answered.items()),
                extra={"worker": self.name, "requests": answered},
            )
