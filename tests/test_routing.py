"""Prefix-affinity routing: shards, leases, rebalancing on join and death, work stealing."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis
import torch
from poolkit import mock_row

from producer import RemoteLM
from producer.remote_lm import token_array
from producer.routing import shard_of

V = 300
MODEL = f"mock-{V}"
MOCK = {"backend": "mock", "mock_vocab_size": V}
pytestmark = pytest.mark.timeout(180)


def reference(ids: list[int]) -> torch.Tensor:
    return mock_row(V, ids)


def packed(ids: list[int]) -> bytes:
    return token_array(ids, 1 << 20).tobytes()


def test_shard_choice() -> None:
    prompt = list(range(40))
    assert shard_of(packed(prompt), 1, 32) == 0
    # the first 32 tokens decide: a longer prompt with the same head stays on its shard
    assert shard_of(packed(prompt), 8, 32) == shard_of(packed([*prompt, 7, 7, 7]), 8, 32)
    by_key = shard_of(packed([1]), 8, 32, affinity="run-1")
    assert by_key == shard_of(packed([2, 3]), 8, 32, affinity="run-1")
    spread = Counter(shard_of(packed([i, i + 1]), 8, 32) for i in range(800))
    assert set(spread) == set(range(8)) and min(spread.values()) > 50


async def wait_for(check: Callable[[], bool], timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def shards_of(w: Any) -> list[int]:
    return list(w.info().get("shards", []))


@pytest.mark.asyncio
async def test_leases_rebalance_when_workers_join_and_die(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    a = workers(redis_url, **MOCK)
    await wait_for(lambda: shards_of(a) == [0, 1, 2, 3])
    b = workers(redis_url, **MOCK)
    await wait_for(lambda: len(shards_of(a)) == 2 and len(shards_of(b)) == 2)
    assert set(shards_of(a)).isdisjoint(shards_of(b))

    prompts = [[i, i % 7, 3] for i in range(300)]
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as lm:
        first = asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts[:150]))
        a.kill()
        rest = asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts[150:]))
        results = [*await first, *await rest]
        await wait_for(lambda: shards_of(b) == [0, 1, 2, 3])
    for got, ids in zip(results, prompts, strict=True):
        assert torch.equal(got, reference(ids))


@pytest.mark.asyncio
async def test_one_affinity_key_reaches_one_worker(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    # stealing off: on a loaded machine a request may wait past steal_after_ms, and then any
    # idle worker may take it (by design); here only the leases decide
    pool = [workers(redis_url, **MOCK, steal_after_ms=60_000) for _ in range(2)]
    await wait_for(lambda: all(len(shards_of(w)) == 2 for w in pool))
    await asyncio.sleep(0.5)  # reads blocked before the leases moved have returned
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        for step in range(20):  # an SMC run: one request at a time, each a token longer
            await lm.next_token_logprobs([5] * (step + 1), affinity="smc-run-1")
        rows = [int(w.info()["rows"]) for w in pool]
        await wait_for(lambda: sum(int(w.info()["rows"]) for w in pool) == 20)
    rows = sorted(int(w.info()["rows"]) for w in pool)
    assert rows == [0, 20], rows


@pytest.mark.asyncio
async def test_an_idle_worker_steals_from_a_busy_shard(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    pool = [
        workers(redis_url, **MOCK, mock_delay_ms=40, max_batch=2, steal_after_ms=30)
        for _ in range(2)
    ]
    await wait_for(lambda: all(len(shards_of(w)) == 2 for w in pool))
    prompts = [[i, 1, 2] for i in range(120)]
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as lm:
        results = await asyncio.gather(
            *(lm.next_token_logprobs(p, affinity="one-hot-shard") for p in prompts)
        )
    for got, ids in zip(results, prompts, strict=True):
        assert torch.equal(got, reference(ids))
    await wait_for(lambda: sum(int(w.info()["rows"]) for w in pool) == 120)
    rows = [int(w.info()["rows"]) for w in pool]
    assert min(rows) >= 20, f"the idle worker should have taken a share: {rows}"


@pytest.mark.asyncio
async def test_cache_kv_pins_on_the_serving_worker(
    redis_url: str, workers: Callable[..., Any], tiny_llama: Any
) -> None:
    workers(redis_url, model=str(tiny_llama), kv_cache_mb=16)
    async with await RemoteLM.connect(redis_url, model=str(tiny_llama)) as lm:
        assert await lm.cache_kv(list(range(1, 60)), affinity="run-7") is True
        assert await lm.cache_kv(list(range(1, 60)), affinity="run-7") is True  # not cached
    workers(redis_url, **MOCK)
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        assert await lm.cache_kv([1, 2, 3]) is False  # no KV cache in the mock backend


@pytest.mark.asyncio
async def test_one_prompt_asked_on_two_shards_answers_both_askers(
    redis_url: str, workers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two producers ask for the same prompt with affinity keys of two shards while the one
    worker (owning every shard) is busy, so it reads both entries together: each shard's asker
    gets its row (before, the two merged into one job answered on the first shard only, and the
    other asker timed out)."""
    monkeypatch.setenv("LMPOOL_RESEND_S", "1")
    workers(redis_url, **MOCK, mock_delay_ms=400)
    keys = {shard_of(b"", 4, 32, affinity=f"run-{i}"): f"run-{i}" for i in range(64)}
    first, second = keys[0], keys[1]
    ids = [5, 6, 7]
    lms = [await RemoteLM.connect(redis_url, model=MODEL, timeout_s=6) for _ in range(2)]
    try:
        blocker = asyncio.ensure_future(lms[0].next_token_logprobs([9, 9, 9]))
        await asyncio.sleep(0.1)  # the worker is in its 400 ms step
        rows = await asyncio.gather(
            lms[0].next_token_logprobs(ids, affinity=first),
            lms[1].next_token_logprobs(ids, affinity=second),
        )
        await blocker
    finally:
        for lm in lms:
            await lm.close()
    for row in rows:
        assert torch.equal(row, reference(ids))


def test_clear_kv_cache_unpins_a_prefix_on_every_shard_it_was_pinned_on(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """One prefix pinned under affinity keys of two shards is unpinned on both (before, only on
    the shard of the last pin: the other worker kept it unevictable)."""
    from shared.keys import Keys

    workers(redis_url, **MOCK)
    keys = {shard_of(b"", 4, 32, affinity=f"run-{i}"): f"run-{i}" for i in range(64)}
    lm = RemoteLM.from_name(MODEL, redis_url=redis_url, timeout_s=10.0)
    ids = [11, 12, 13, 14]
    assert lm.cache_kv(ids, affinity=keys[0]) is False  # the mock backend has no KV cache
    assert lm.cache_kv(ids, affinity=keys[1]) is False
    lm.clear_kv_cache()
    r = redis.Redis.from_url(redis_url)
    queued = [int(r.hget(Keys().stats(MODEL, s), "queued") or 0) for s in range(4)]  # type: ignore[arg-type]
    r.close()
    lm.cleanup()
    assert queued == [2, 2, 0, 0], queued  # a pin and an unpin on each of the two shards


def _pending_of(url: str, stream: str) -> dict[str, int]:
    """Consumer -> entries it holds in ``stream``."""
    from shared.keys import GROUP

    r = redis.Redis.from_url(url)
    try:
        summary: Any = r.xpending(stream, GROUP)
    finally:
        r.close()
    return {c["name"].decode(): int(c["pending"]) for c in summary["consumers"] or []}


@pytest.mark.asyncio
async def test_a_dead_owners_shard_is_taken_over_though_an_answer_left_a_gap(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A worker killed while it computes an entry of its shard leaves that entry pending; the
    survivor takes the shard's next request after ``steal_after_ms`` and answers it (XACK +
    XDEL). The request after that must be taken over too, long before the dead owner's lease
    lapses (before: Redis reports a group's lag as nil once a deleted entry follows a pending
    one, which read as nothing to take, so it waited for the lease: past its timeout)."""
    from shared.keys import Keys

    slow = {**MOCK, "heartbeat_s": 4, "steal_after_ms": 1000}  # leases live 8-12 s after a kill
    a = workers(redis_url, **slow, mock_delay_ms=60_000)
    await wait_for(lambda: shards_of(a) == [0, 1, 2, 3])
    b = workers(redis_url, **slow)
    await wait_for(lambda: len(shards_of(a)) == 2 and len(shards_of(b)) == 2, timeout_s=30)
    shard = shards_of(a)[0]
    key = next(f"run-{i}" for i in range(256) if shard_of(b"", 4, 32, f"run-{i}") == shard)
    stream = Keys().stream(MODEL, "high", shard)
    (a_id,) = a.worker_ids()
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=5) as lm:
        held = asyncio.ensure_future(lm.next_token_logprobs([1, 2, 3], affinity=key))
        try:
            await wait_for(lambda: _pending_of(redis_url, stream).get(a_id) == 1)
            a.kill()  # its entry stays pending, its lease and heartbeat live on for 8 s at least
            killed = time.monotonic()
            for ids in ([4, 5, 6], [7, 8, 9]):  # the first is taken over, then answered
                row = await lm.next_token_logprobs(ids, affinity=key)
                assert torch.equal(row, reference(ids))
            took = time.monotonic() - killed
        finally:
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
    assert took < 8, f"the dead owner's shard waited for its lease to lapse: {took:.1f}s"


def _lease_owners(url: str) -> dict[int, str | None]:
    """Shard -> the worker id its lease names (None: free), read from Redis."""
    from shared.keys import Keys

    r = redis.Redis.from_url(url)
    try:
        values: list[Any] = [r.get(Keys().lease(MODEL, s)) for s in range(4)]
    finally:
        r.close()
    return {s: v.decode() if v else None for s, v in enumerate(values)}


@pytest.mark.asyncio
async def test_a_workers_published_shards_follow_its_leases_at_once(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """The shards a worker's heartbeat shows (``lmpool-status --json``) are the leases it
    holds as soon as they change (before: the heartbeat was written before the leases moved,
    so for a whole heartbeat a worker that gave shards up still showed them, and one that took
    them did not)."""
    slow = {**MOCK, "heartbeat_s": 5}
    a = workers(redis_url, **slow)
    (a_id,) = a.worker_ids()
    await wait_for(lambda: shards_of(a) == [0, 1, 2, 3])
    b = workers(redis_url, **slow)
    (b_id,) = b.worker_ids()
    await wait_for(lambda: list(_lease_owners(redis_url).values()).count(a_id) == 2, 30)
    held = [s for s, owner in _lease_owners(redis_url).items() if owner == a_id]
    await wait_for(lambda: shards_of(a) == held, timeout_s=1)
    await wait_for(lambda: list(_lease_owners(redis_url).values()).count(b_id) == 2, 30)
    taken = [s for s, owner in _lease_owners(redis_url).items() if owner == b_id]
    await wait_for(lambda: shards_of(b) == taken, timeout_s=1)
