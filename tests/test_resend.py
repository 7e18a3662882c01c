"""A request that waits long is queued once: re-submissions (``LMPOOL_RESEND_S``) add its message
again only when Redis lost it or the worker holding it died, and a live worker's long work is not
taken over (``LMPOOL_CLAIM_AFTER_S``). Mock workers, a real Redis, a killed process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from poolkit import mock_row, wait_until

from localpool.redis_server import RedisServer
from producer import RemoteLM
from shared.acl import producer_rule, worker_rule
from shared.keys import Keys
from shared.redis_conn import connect_redis_sync
from shared.settings import Settings

V = 300
MODEL = f"mock-{V}"
pytestmark = pytest.mark.timeout(180)


def counter(url: str, name: str, prefix: str = "lmpool") -> int:
    """A producer-side counter (``queued``, ``joined``...) summed over the model's shards."""
    r = connect_redis_sync(url)
    keys = Keys(prefix)
    total = sum(int(cast(Any, r.hget(keys.stats(MODEL, s), name)) or 0) for s in range(4))
    r.close()
    return total


async def computed(pool: list[Any], least: int) -> int:
    """The workers' computed counters summed, once they reach ``least`` and a heartbeat more
    has passed (each worker publishes them every heartbeat)."""

    def total() -> int:
        return sum(int(w.info()["computed"]) for w in pool)

    await wait_until(lambda: total() >= least, 10, f"{least} computed")
    await asyncio.sleep(1.0)
    return total()


def quick_resends(monkeypatch: pytest.MonkeyPatch) -> float:
    """Producers re-submit every 0.3 s and count a held request's worker dead after 0.6 s
    without a renewal (three heartbeats of 0.2 s); returns that heartbeat."""
    monkeypatch.setenv("LMPOOL_RESEND_S", "0.3")
    monkeypatch.setenv("LMPOOL_HEARTBEAT_S", "0.2")
    return 0.2


@pytest.mark.asyncio
async def test_requests_waiting_past_many_resends_are_queued_and_computed_once(
    any_redis_url: str, workers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of 1.2 s, two workers, four requests: each waits through several re-submissions,
    queued or held (read ahead, or in the step) past the 0.6 s after which a request left
    unrenewed counts as lost. Each is queued once and computed once (before: a stream entry
    every re-submission, and the idle worker computed the busy one's requests again). On a
    single Redis and on a cluster."""
    redis_url = any_redis_url
    heartbeat_s = quick_resends(monkeypatch)
    common = {"backend": "mock", "mock_vocab_size": V, "mock_delay_ms": 1200, "max_batch": 1}
    pool = [workers(redis_url, heartbeat_s=heartbeat_s, **common) for _ in range(2)]
    prompts = [[i, 7] for i in range(4)]
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as lm:
        rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    for p, row in zip(prompts, rows, strict=True):
        assert torch.equal(row, mock_row(V, p))
    assert counter(redis_url, "queued") == 4
    assert counter(redis_url, "joined") >= 4  # the re-submissions found them queued or held
    assert await computed(pool, 4) == 4


@pytest.mark.asyncio
async def test_a_tenants_re_submissions_run_under_its_acl_rule(
    workers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same under least-privilege ACL users (``shared.acl``): a tenant's re-submissions
    read the entry's record and its pending state with the commands its rule allows."""
    heartbeat_s = quick_resends(monkeypatch)
    rules = [worker_rule("w", "pw", "lab"), producer_rule("alice", "pa", "lab", tenant=True)]
    with RedisServer(password="admin", acl_lines=rules) as server:
        workers(
            server.url_for("w", "pw"), backend="mock", mock_vocab_size=V, mock_delay_ms=1200,
            max_batch=1, key_prefix="lab", heartbeat_s=heartbeat_s,
        )  # fmt: skip
        alice = Settings.from_env(redis_url=server.url_for("alice", "pa"), key_prefix="lab")
        prompts = [[i, 8] for i in range(2)]
        async with await RemoteLM.connect(model=MODEL, settings=alice, timeout_s=60) as lm:
            rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        for p, row in zip(prompts, rows, strict=True):
            assert torch.equal(row, mock_row(V, p))
        assert counter(server.url, "queued:alice", "lab") == 2
        assert counter(server.url, "joined:alice", "lab") >= 4


@pytest.mark.asyncio
async def test_a_producer_that_joined_anothers_request_does_not_queue_it_again(
    redis_url: str, workers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two producers ask for the same prompt behind a 1.2 s step; the second joins the first's
    entry, knows no id, and re-submits every 0.3 s: the digest stays one entry, computed once
    (before: the joiner's first re-submission added a second entry)."""
    heartbeat_s = quick_resends(monkeypatch)
    common = {"backend": "mock", "mock_vocab_size": V, "mock_delay_ms": 1200, "max_batch": 1}
    pool = [workers(redis_url, heartbeat_s=heartbeat_s, **common)]
    async with (
        await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as first,
        await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as joiner,
    ):
        blocker = asyncio.create_task(first.next_token_logprobs([9, 9, 1]))  # the worker's step
        await pool[0].wait_counter("requests", 1)
        asked = asyncio.create_task(first.next_token_logprobs([9, 9, 2]))
        await asyncio.sleep(0.1)
        joined = await joiner.next_token_logprobs([9, 9, 2])  # waits ~2.3 s: re-submits
        rows = [await blocker, await asked, joined]
    for ids, row in zip([[9, 9, 1], [9, 9, 2], [9, 9, 2]], rows, strict=True):
        assert torch.equal(row, mock_row(V, ids))
    assert counter(redis_url, "queued") == 2  # the blocker and the shared prompt, once each
    assert counter(redis_url, "joined") >= 4  # the joiner, then its re-submissions
    assert await computed(pool, 2) == 2


@pytest.mark.asyncio
async def test_a_long_generation_is_neither_taken_over_nor_queued_again(
    redis_url: str, workers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2 s generation (400 tokens, 5 ms each) against LMPOOL_CLAIM_AFTER_S=1 and re-submissions
    every 0.3 s: the worker that runs it renews it every heartbeat, so the idle second worker
    neither takes it over nor gets it queued again; the sample comes back once, whole."""
    heartbeat_s = quick_resends(monkeypatch)
    common = {"backend": "mock", "mock_vocab_size": V, "mock_delay_ms": 5, "claim_after_s": 1}
    pool = [workers(redis_url, heartbeat_s=heartbeat_s, **common) for _ in range(2)]
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as lm:
        started = time.monotonic()
        tokens = await lm.sample([1, 2], 400, [], seed=3)
        took = time.monotonic() - started
    assert len(tokens) == 400 and took > 1.5
    assert counter(redis_url, "queued") == 1
    assert await computed(pool, 1) == 1
    assert not any("taking over" in w.log() for w in pool)


@pytest.mark.asyncio
async def test_a_claim_after_shorter_than_a_heartbeat_takes_nothing_over_from_a_live_worker(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """LMPOOL_CLAIM_AFTER_S=0.8 under a heartbeat of 2 s (the default): the worker that runs a 2 s
    generation claims it again four times within 0.8 s (``Settings.renew_s``), not every 2 s, so
    the idle second worker, scanning every 0.4 s, never finds it idle that long (before: taken
    over after 0.8 s and computed twice)."""
    common = {
        "backend": "mock", "mock_vocab_size": V, "mock_delay_ms": 5, "claim_after_s": 0.8,
        "heartbeat_s": 2.0,
    }  # fmt: skip
    pool = [workers(redis_url, **common) for _ in range(2)]
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as lm:
        tokens = await lm.sample([3, 4], 400, [], seed=5)
    assert len(tokens) == 400
    assert await computed(pool, 1) == 1
    assert not any("taking over" in w.log() for w in pool)


@pytest.mark.asyncio
async def test_a_request_held_by_a_killed_worker_is_queued_again_within_seconds(
    redis_url: str, workers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker holding a request is killed with SIGKILL mid-step; with LMPOOL_CLAIM_AFTER_S
    at 120 s no worker takes it over, but its producer's re-submission sees it unrenewed past
    0.6 s and queues it again: a second worker answers it in seconds, with the right row."""
    heartbeat_s = quick_resends(monkeypatch)
    common = {
        "backend": "mock", "mock_vocab_size": V, "claim_after_s": 120, "heartbeat_s": heartbeat_s
    }  # fmt: skip
    victim = workers(redis_url, mock_delay_ms=30_000, **common)
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as lm:
        task = asyncio.create_task(lm.next_token_logprobs([5, 6]))
        await victim.wait_counter("requests", 1)
        victim.kill()
        started = time.monotonic()
        survivor = workers(redis_url, **common)
        row = await task
        took = time.monotonic() - started
    assert torch.equal(row, mock_row(V, [5, 6]))
    assert took < 30, f"answered after {took:.1f}s"
    assert await computed([survivor], 1) == 1
    assert counter(redis_url, "queued") == 2  # once, and once again after the kill
