"""The compute loop with the real mock backend, whose steps cost a fixed time in the compute
thread (``LMPOOL_MOCK_DELAY_MS``): an adapter load finds a gap between two steps of a flood, and
a step that fails as a whole answers its works once and loses nothing added meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from shared.protocol import decode_result, wire_bytes, wire_len
from shared.settings import Settings
from worker.backends.base import Work
from worker.backends.mock import MockBackend
from worker.stream.batcher import Job
from worker.stream.compute import Compute, in_compute_thread

pytestmark = pytest.mark.asyncio

VOCAB = 64
DELAY_MS = 20.0


class Harness:
    def __init__(self, max_batch: int = 4, wire_dtype: str = "float32") -> None:
        self.backend = MockBackend(VOCAB, delay_ms=DELAY_MS)
        self.spans: list[tuple[float, float]] = []
        """(start, end) of each of the model's batches (monotonic seconds)."""
        timed = self.backend.logprobs

        def logprobs(prompts: list[list[int]], lora: str | None) -> torch.Tensor:
            start = time.monotonic()
            try:
                return timed(prompts, lora)
            finally:
                self.spans.append((start, time.monotonic()))

        self.backend.logprobs = logprobs  # type: ignore[method-assign]
        self.finished: list[Job] = []

        async def triage(jobs: list[Job]) -> None:
            return None

        self.compute = Compute(
            self.backend,
            Settings(max_batch=max_batch, wire_dtype=wire_dtype),
            self.finished.extend,
            lambda works, seconds: None,
            lambda: time.time() * 1000,
            triage,
        )
        self.compute.step_s = DELAY_MS / 1000  # in the compute thread from the first step
        self.made = 0
        self.done = False

    def jobs(self, n: int) -> list[Job]:
        out = []
        for _ in range(n):
            self.made += 1
            job = Job(f"{self.made:064x}", 0, [])
            job.work = Work("logprobs", [1, 2, self.made % VOCAB], tag=job)
            out.append(job)
        return out

    async def until(self, ok: Callable[[], bool], timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not ok():
                await asyncio.sleep(0.002)

    async def run(self) -> None:
        await self.compute.run_until(lambda: self.done, _nothing_to_claim)

    def check_answers(self) -> None:
        """Every job made was answered once, with its own row (or an error)."""
        digests = [j.digest for j in self.finished]
        assert sorted(digests) == sorted(f"{i:064x}" for i in range(1, self.made + 1))
        for job in self.finished:
            if job.error is None:
                assert job.result is not None
                want = self.backend._row([1, 2, int(job.digest, 16) % VOCAB], None)
                assert torch.equal(decode_result(wire_bytes(job.result)), want)


async def _nothing_to_claim() -> bool:
    return False


async def test_an_adapter_load_finds_a_gap_in_a_flood() -> None:
    h = Harness()
    runner = asyncio.create_task(h.run())

    async def flood() -> None:
        while not h.done:
            h.compute.add(h.jobs(4))
            await asyncio.sleep(DELAY_MS / 2000)
            while h.compute.outstanding > 12:
                await asyncio.sleep(0.001)

    flooding = asyncio.create_task(flood())
    await h.until(lambda: len(h.spans) >= 3)
    asked = time.monotonic()
    steps_before = len(h.spans)
    assert await h.compute.call(lambda: "loaded") == "loaded"
    waited = time.monotonic() - asked
    assert waited < 0.5, waited  # a step or two, not the end of the flood
    await h.until(lambda: len(h.spans) >= steps_before + 3)  # the flood goes on after it
    h.done = True
    await flooding
    await h.until(lambda: h.compute.outstanding == 0)
    h.compute.have.set()
    await runner
    h.check_answers()


async def test_a_failed_step_loses_nothing_added_meanwhile() -> None:
    h = Harness()
    real_step = h.backend.step
    calls = 0

    def step() -> list[Work]:
        nonlocal calls
        calls += 1
        if calls == 2:
            time.sleep(DELAY_MS / 1000)
            raise RuntimeError("the device fell over")
        return real_step()

    h.backend.step = step  # type: ignore[method-assign]
    runner = asyncio.create_task(h.run())
    h.compute.add(h.jobs(8))  # two batches: the second one's step fails
    await h.until(lambda: calls == 2)
    h.compute.add(h.jobs(4))  # added while the failing step runs
    await h.until(lambda: len(h.finished) == 12)
    h.done = True
    h.compute.have.set()
    await runner
    h.check_answers()
    failed = [j for j in h.finished if j.error is not None]
    assert failed and all("the device fell over" in str(j.error) for j in failed)
    # the jobs added during the failed step were computed after it
    assert all(j.error is None for j in h.finished if int(j.digest, 16) > 8)


async def test_rows_go_in_the_wire_dtype_and_scores_as_they_are() -> None:
    """``LMPOOL_WIRE_DTYPE=float16``: a next-token row is sent in half precision (widened back
    on decoding); a score's values keep their own dtype."""
    h = Harness(wire_dtype="float16")
    row, score = Job(f"{1:064x}", 0, []), Job(f"{2:064x}", 0, [])
    row.work = Work("logprobs", [1, 2, 3], tag=row)
    score.work = Work("score", [1, 2], params={"cont": [3, 4]}, tag=score)
    h.made = 2
    runner = asyncio.create_task(h.run())
    h.compute.add([row, score])
    await h.until(lambda: len(h.finished) == 2)
    h.done = True
    h.compute.have.set()
    await runner
    assert row.result is not None and score.result is not None
    want = h.backend._row([1, 2, 3], None)
    assert torch.equal(decode_result(wire_bytes(row.result)), want.half().float())
    assert wire_len(row.result) < VOCAB * 4  # two bytes an element, not four
    assert isinstance(score.result, bytes)
    assert torch.equal(decode_result(score.result), h.backend.score([1, 2], [3, 4], None))


async def test_answered_jobs_and_their_rows_are_freed_without_the_cycle_collector() -> None:
    """A job and its work referred to each other, and a row is a view of its step's whole
    ``[batch, V]`` tensor: every answered job waited, with its step's rows, for Python's rarest
    collection (a worker serving SMC runs grew 1.4 GB in 2 minutes). With the collector off,
    answered jobs, their works and their steps' row tensors go as soon as nobody holds them."""
    import gc
    import weakref

    h = Harness()
    rows: list[weakref.ref[torch.Tensor]] = []
    logprobs = h.backend.logprobs

    def tracked(prompts: list[list[int]], lora: str | None) -> torch.Tensor:
        out = logprobs(prompts, lora)
        rows.append(weakref.ref(out))
        return out

    h.backend.logprobs = tracked  # type: ignore[method-assign]
    gc.collect()
    gc.disable()
    try:
        runner = asyncio.create_task(h.run())
        for _ in range(3):
            h.compute.add(h.jobs(4))
            await h.until(lambda: h.compute.outstanding == 0)
        h.done = True
        h.compute.have.set()
        await runner
        # The compute thread drops its last work item (which held that step's result) only
        # after the loop has it: once a next item runs there, the last one is gone.
        await in_compute_thread(lambda: None)
        h.check_answers()
        jobs = [weakref.ref(j) for j in h.finished]
        works = [weakref.ref(j.work) for j in h.finished if j.work is not None]
        h.finished.clear()
        assert len(rows) == 3 and len(jobs) == 12 and len(works) == 12
        assert all(r() is None for r in rows), "a step's rows outlived its encoding"
        assert all(j() is None for j in jobs), "answered jobs wait for the cycle collector"
        assert all(w() is None for w in works)
    finally:
        gc.enable()


async def test_a_steps_kv_stores_wait_until_its_answers_are_written(tmp_path: Path) -> None:
    """The hf backend's KV stores of a step run after its answers are handed to the writer:
    once the writer says they are written (``written``), in the compute thread; if another
    step comes first, that step stores them before it plans. Answers equal the no-cache
    path's either way."""
    from poolkit import build_tiny_llama

    from worker.backends.hf import HFBackend
    from worker.backends.hf.kv_cache import DEFER_MIN_ROWS

    model = build_tiny_llama(tmp_path)
    backend = HFBackend(Settings(model=str(model), kv_cache_mb=4))
    reference = HFBackend(Settings(model=str(model), kv_cache_mb=0))
    finished: list[Job] = []

    async def triage(jobs: list[Job]) -> None:
        return None

    compute = Compute(
        backend, Settings(max_batch=16), finished.extend, lambda w, s: None,
        lambda: time.time() * 1000, triage,
    )  # fmt: skip
    assert backend.settles_later and backend.kv_cache is not None
    made = 0

    def jobs(prompts: list[list[int]]) -> list[Job]:
        nonlocal made
        out = []
        for p in prompts:
            made += 1
            job = Job(f"{made:064x}", 0, [])
            job.work = Work("logprobs", p, tag=job)
            out.append(job)
        return out

    async def step(prompts: list[list[int]]) -> None:
        finished.clear()
        compute.add(jobs(prompts))
        await compute.step()
        assert len(finished) == len(prompts)
        for job, p in zip(finished, prompts, strict=True):
            assert job.result is not None
            want = reference.logprobs([p], None)[0]
            torch.testing.assert_close(
                decode_result(wire_bytes(job.result)), want, atol=1e-5, rtol=0
            )

    prompts = [[1, 2, 3, 4, 5, i] for i in range(6, 6 + DEFER_MIN_ROWS)]  # a lone row: at once
    await step(prompts)
    assert backend.unsettled() and backend.kv_cache.bytes_used == 0  # answered, not stored
    compute.written()
    await compute.settled()
    assert not backend.unsettled()
    assert all(backend.kv_cache.cached_length(p) == len(p) for p in prompts)

    # no write reported: the next step stores the last one's positions first, then reuses them
    longer = [[*p, 9] for p in prompts]
    await step(longer)
    computed = backend.kv_cache.tokens_computed
    await step([[*p, 10] for p in longer])
    assert backend.kv_cache.tokens_computed - computed == DEFER_MIN_ROWS
    compute.written()
    await compute.settled()
    assert backend.kv_cache.measured_bytes() == backend.kv_cache.bytes_used
