"""Stepping the backend: jobs go in at step boundaries, finished ones go to the writer.

The backend runs in one dedicated thread (the compute thread, which also loads it), one
``step()`` at a time, so Redis I/O (reading the next entries, writing the last answers) overlaps
the model (steps that take less than a thread hand-off, like the mock backend's, run on the
event loop). One thread, always the same: torch's CPU thread pool (OpenMP) belongs to the thread
that calls into it, and calls from several threads in turn would keep several pools spinning on
the same cores (measured: eight concurrent samples 2.05x one through asyncio's default executor,
see ``bench/generation.py``). Jobs that arrive during a step join at
the next one: a next-token request waits for at most the step in progress (the backend's
scheduler puts it ahead of the next decode step of running generations). Results are encoded
in the same thread, right after the step, in the pool's wire dtype (a step's rows on a GPU leave
it in one copy: ``encode_results``).

With ``LMPOOL_MAX_WAIT_MS`` set, an idle model holds a partly filled batch until it fills or
that long after its oldest job was read, while the reader reads (``gathering``).

Entries taken over from a dead consumer run alone, claimed just before they run: if one of them
is what killed that consumer, it can take only itself down (its delivery count rises until it
is dead-lettered), never a batch of innocent ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from shared.aio import wait_event
from shared.codec import torch_dtype
from shared.errors import Expired, WorkerError
from shared.protocol import Encoded, encode_result, encode_results
from shared.settings import Settings
from worker.backends.base import Backend, EngineDead, Work
from worker.stream.batcher import TRIAGE_AFTER_MS, Job

log = logging.getLogger("lmpool.worker")
T = TypeVar("T")
INLINE_STEP_S = 0.001
"""Steps shorter than this (on average) run on the event loop: handing them to the compute
thread and back costs more (two wake-ups) than they take, and there is no model time to
overlap Redis I/O with. Model steps, milliseconds long, always run in the thread."""
FORSAKEN_CHECK_S = 1.0
"""How often running generations are checked for waiters (one round trip for all of them)."""


_thread: ThreadPoolExecutor | None = None


async def in_compute_thread(fn: Callable[[], T]) -> T:
    """``fn()`` in the process's compute thread (created on first use)."""
    global _thread
    if _thread is None:
        _thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmpool-compute")
    return await asyncio.get_running_loop().run_in_executor(_thread, fn)


class Compute:
    def __init__(
        self,
        backend: Backend,
        settings: Settings,
        on_finished: Callable[[list[Job]], None],
        on_step: Callable[[list[Work], float], None],
        now_ms: Callable[[], float],
        triage: Callable[[list[Job]], Awaitable[None]],
    ) -> None:
        self.backend = backend
        backend.max_batch = settings.max_batch
        backend.settles_later = True  # see ``written``
        self.wire_dtype = torch_dtype(settings.wire_dtype)
        self.on_finished = on_finished
        self.on_step = on_step
        self.now_ms = now_ms
        """Now on the Redis server's clock (deadlines are on it)."""
        self.triage = triage
        """Checks jobs against Redis (``Batcher.triage``): result there? anyone waiting?"""
        self.ready: list[Job] = []
        self.active: dict[str, Job] = {}
        """Jobs handed to the backend (or ready for it), by ``Job.key``: duplicates join them."""
        self.have = asyncio.Event()
        self.lock = asyncio.Lock()
        """Held while the compute thread works: one step, or one other backend call."""
        self.busy = False
        self.step_started = 0.0
        """When the step now running (``busy``) started (monotonic)."""
        self.step_s = 1.0
        """Recent steps' duration (moving average); starts high, so first steps use the thread."""
        self.steps = 0
        self.busy_s = 0.0
        self.computed = 0
        self.max_wait_s = settings.max_wait_ms / 1000
        self.gathering_until = 0.0
        """While in the future (monotonic), a partly filled batch waits for company."""
        self.wake_reader: Callable[[], None] = lambda: None
        """Called when a batch starts waiting for company: the reader then reads meanwhile."""
        self.weights = settings.weights()
        self._finish_tag: dict[str, float] = {}
        """Tenant -> virtual finish time of its last queued work (weighted fair queuing)."""
        self._virtual = 0.0
        """Virtual time: the largest rank of the works finished so far."""
        self._settling: asyncio.Task[None] | None = None
        self._forsaken_at = 0.0

    def stuck_s(self) -> float:
        """How long the step now running has run (0 when none runs)."""
        return time.monotonic() - self.step_started if self.busy else 0.0

    @property
    def outstanding(self) -> int:
        return len(self.active)

    @property
    def gathering(self) -> float:
        """Seconds a partly filled batch still waits for company (``LMPOOL_MAX_WAIT_MS``)."""
        return max(0.0, self.gathering_until - time.monotonic())

    def add(self, jobs: list[Job]) -> None:
        """Queue jobs for the model; settled ones (errors, cache hits, skips) go straight on,
        and a duplicate of a job already queued or running joins it."""
        settled = []
        for job in jobs:
            if job.work is None:
                settled.append(job)
                continue
            twin = self.active.get(job.key)
            if twin is not None:
                twin.entries.extend(job.entries)  # acknowledged with it
                continue
            self.active[job.key] = job
            self.ready.append(job)
            self._rank(job)
        if settled:
            self.on_finished(settled)
        if self.ready:
            self.have.set()

    def _rank(self, job: Job) -> None:
        """Weighted fair queuing between tenants: a work's rank is its tenant's virtual finish
        time, so a tenant whose request arrives behind another's backlog is served next, not
        after it; with one tenant (or none) ranks follow arrival order."""
        assert job.work is not None
        tenant = job.tenant
        start = max(self._finish_tag.get(tenant, 0.0), self._virtual)
        job.work.rank = self._finish_tag[tenant] = start + 1 / self.weights.get(tenant, 1.0)
        if len(self._finish_tag) > 4096:  # tenants come and go: forget the idle ones
            self._finish_tag = {t: f for t, f in self._finish_tag.items() if f > self._virtual}

    async def run_until(
        self, done: Callable[[], bool], claim: Callable[[], Awaitable[bool]]
    ) -> None:
        """Step while there is work; when idle, return if ``done()`` (a stopping worker takes
        over nothing more), else run one reclaimed entry alone (``claim``), or wait."""
        while True:
            if not self.ready and not self.backend.has_work():
                if done():
                    return
                if await claim():
                    continue
                self.have.clear()
                if not self.ready:
                    await self.have.wait()
                continue
            if self.max_wait_s and not self.backend.has_work():
                await self._gather(done)
            await self.step()

    async def _gather(self, done: Callable[[], bool]) -> None:
        """With the model idle and fewer than ``max_batch`` jobs ready, wait for more, until
        ``max_wait_ms`` after the oldest of them was read (the reader reads meanwhile), or
        until reading is over (``done()``: the worker stops)."""
        deadline = min(j.read_at for j in self.ready) + self.max_wait_s
        if len(self.ready) >= self.backend.max_batch or deadline <= time.monotonic():
            return
        self.gathering_until = deadline
        self.wake_reader()
        try:
            while len(self.ready) < self.backend.max_batch and not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.have.clear()
                await wait_event(self.have, left)
        finally:
            self.gathering_until = 0.0

    async def step(self, only: list[Job] | None = None) -> None:
        """Submit what is ready (or only ``only``) and run one backend step."""
        submit = self.ready if only is None else only
        if only is None:
            self.ready = []
        else:
            self.ready = [j for j in self.ready if j not in only]
        submit = await self._check_again(self._drop_expired(submit))
        await self._drop_forsaken_generations()
        if submit:
            self.backend.submit([j.work for j in submit if j.work is not None])
        elif not self.backend.has_work():
            return
        self.busy = True
        started = self.step_started = time.monotonic()
        try:
            async with self.lock:
                self._drop_given_up_generations()
                if self.step_s < INLINE_STEP_S:
                    works = self._step()  # cheaper than handing it to the thread and back
                else:
                    works = await in_compute_thread(self._step)
        except EngineDead:
            raise
        except Exception as e:
            # The backend failed as a whole (not one request): answer what it held, go on.
            log.exception("backend step failed")
            works = [
                j.work for j in self.active.values() if j.work is not None and j not in self.ready
            ]
            for w in works:
                w.error = w.error or WorkerError(f"the model failed: {e!r}")
                self._settle(w)
            self.backend.abandon()  # answered: none of them may come back from a later step
        finally:
            self.busy = False
            seconds = time.monotonic() - started
            self.step_s += (seconds - self.step_s) / 8  # a moving average of recent steps
            self.busy_s += seconds
            self.steps += 1
        if works:
            self._virtual = max(self._virtual, max(w.rank for w in works))
        finished = [w.tag for w in works if isinstance(w.tag, Job)]
        for job in finished:
            self.active.pop(job.key, None)
        self.computed += sum(w.error is None for w in works if isinstance(w.tag, Job))
        if finished:  # first: the writer's task then runs ahead of the reader woken below
            self.on_finished(finished)
        self.on_step(works, seconds)
        self.backend.stepped = []  # read by on_step: it must not keep the step's rows alive
        for w in works:
            # A job and its work refer to each other: left so, the pair (the job's encoded
            # result, the work's tensors) waits for Python's rarest collection, and a worker
            # serving SMC runs grew by 1.4 GB in 2 minutes (bench/worker_memory.py).
            w.tag = None

    async def _check_again(self, jobs: list[Job]) -> list[Job]:
        """Jobs that waited here longer than ``TRIAGE_AFTER_MS`` since they were read are
        checked again (one round trip): their askers may have cancelled meanwhile, or another
        worker may have written their result."""
        now = time.monotonic()
        stale = [j for j in jobs if now - j.read_at > TRIAGE_AFTER_MS / 1000]
        if not stale:
            return jobs
        for job in stale:
            job.triage = True
        await self.triage(stale)
        settled = [j for j in stale if j.work is None]
        if not settled:
            return jobs
        for job in settled:
            self.active.pop(job.key, None)
        self.on_finished(settled)
        return [j for j in jobs if j.work is not None]

    async def _drop_forsaken_generations(self) -> None:
        """Running generations (``sample``) that nobody waits for any more (their askers
        cancelled) or whose result is in Redis stop between two tokens: checked once a
        ``FORSAKEN_CHECK_S``, one round trip for all. Before, they ran to their end or their
        deadline (the default timeout: 120 s), holding a batch slot and a stopping worker."""
        now = time.monotonic()
        if now - self._forsaken_at < FORSAKEN_CHECK_S:
            return
        self._forsaken_at = now
        jobs = [
            j
            for j in self.active.values()
            if j.kind == "sample" and j.work is not None and j not in self.ready
        ]
        if not jobs:
            return
        works = {id(j): j.work for j in jobs}
        for job in jobs:
            job.triage = True
        await self.triage(jobs)  # sets the work of those it settles (skipped, cache_hit) to None
        gone = {id(j) for j in jobs if j.work is None}
        if not gone:
            return
        async with self.lock:
            dropped = self.backend.drop_generations(lambda w: id(w.tag) in gone)
        stopped = {id(w.tag) for w in dropped}
        settled = []
        for job in jobs:
            if id(job) in stopped:
                works[id(job)].tag = None  # type: ignore[union-attr]
                self.active.pop(job.key, None)
                settled.append(job)
            elif id(job) in gone:  # an engine that keeps its generations (vLLM) runs it on
                job.work, job.outcome = works[id(job)], "computed"
        if settled:
            log.info("%d generation(s) stopped: nobody waits for them", len(settled))
            self.on_finished(settled)

    def _drop_expired(self, jobs: list[Job]) -> list[Job]:
        """Jobs whose deadline passed while they waited for this step are answered
        ``Expired`` instead of computed: their askers have given up."""
        now_ms = self.now_ms()
        expired = [j for j in jobs if _past_deadline(j, now_ms)]
        if not expired:
            return jobs
        self._answer_expired(expired, now_ms, "dropped unrun")
        return [j for j in jobs if j.work is not None]

    def _drop_given_up_generations(self) -> None:
        """Generations (``sample``) whose deadline has passed stop between two tokens,
        answered ``Expired``: their askers have given up, and a long one would otherwise run on
        (and hold a stopping worker) for nothing."""
        now_ms = self.now_ms()
        gone = self.backend.drop_generations(lambda w: _past_deadline(w.tag, now_ms))
        if gone:
            log.info("%d generation(s) stopped: their askers' deadlines passed", len(gone))
            self._answer_expired([w.tag for w in gone], now_ms, "stopped unfinished")

    def _answer_expired(self, jobs: list[Job], now_ms: float, what: str) -> None:
        """Answer ``jobs`` (past their deadlines) ``Expired``, saying ``what`` became of them."""
        for job in jobs:
            assert job.request is not None  # _past_deadline
            late_ms = now_ms - job.request["deadline_ms"]
            job.fail(Expired(f"{what}: its deadline passed {late_ms:.0f} ms ago"), "expired")
            if job.work is not None:
                job.work.tag = None  # the pair refer to each other: see ``step``
            job.work = None
            self.active.pop(job.key, None)
        self.on_finished(jobs)

    def written(self) -> None:
        """A batch of answers is written: what the backend's steps left for later (the hf KV
        cache's stores) runs now in the compute thread, while their askers read them, instead
        of before the answers left (a step that comes first does it itself)."""
        if self.backend.unsettled() and self._settling is None:
            self._settling = asyncio.get_running_loop().create_task(self._settle_backend())

    async def _settle_backend(self) -> None:
        try:
            async with self.lock:
                if self.backend.unsettled():
                    await in_compute_thread(self.backend.settle)
        except Exception:
            log.exception("the backend's work left for after a step failed")
        finally:
            self._settling = None

    async def settled(self) -> None:
        """Wait for ``written``'s work, if any is running."""
        if self._settling is not None:
            await asyncio.shield(self._settling)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the compute thread between two steps (e.g. loading an adapter)."""
        async with self.lock:
            return await in_compute_thread(fn)

    def _step(self) -> list[Work]:
        """In the compute thread: one backend step, its results encoded."""
        works = self.backend.step()
        rows = [
            w
            for w in works
            if w.kind == "logprobs"
            and w.error is None
            and w.result is not None
            and isinstance(w.tag, Job)
        ]
        encoded = encode_results([w.result for w in rows], self.wire_dtype)  # type: ignore[misc]
        data = {id(w): d for w, d in zip(rows, encoded, strict=True)}
        for w in works:
            self._settle(w, data.get(id(w)))
        return works

    def _settle(self, work: Work, encoded: Encoded | None = None) -> None:
        """The job's answer from its work: the error, or the result (``encoded`` already)."""
        job = work.tag
        if not isinstance(job, Job):
            return
        if work.error is not None:
            log.warning(
                "request %s failed: %r", job.digest, work.error, extra={"digest": job.digest}
            )
            job.fail(work.error)
        elif encoded is not None:
            job.result = encoded  # a row, in the wire dtype (``_step``)
        elif work.result is not None:
            job.result = encode_result(work.result)  # samples, scores: as they are


def _past_deadline(job: object, now_ms: float) -> bool:
    """Whether ``job`` (a worker's job, or anything else a work may carry) has a request whose
    deadline (on the Redis server's clock) is before ``now_ms``."""
    return isinstance(job, Job) and job.request is not None and job.request["deadline_ms"] < now_ms
