"""Fault injection: killed workers, a restarted Redis, poison prompts, shutdown, bad messages.

Every test checks that each request is answered with the right values (or a typed error),
and that nothing is left pending.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import torch

from producer import RemoteLM
from shared.errors import DeadLettered, QueueFull
from shared.keys import GROUP, Keys
from shared.redis_server import RedisServer
from shared.settings import Settings
from worker.backends.mock import MockBackend

V = 300
MODEL = f"mock-{V}"
KEYS = Keys()
STREAMS = KEYS.streams(MODEL, Settings().shards)
pytestmark = pytest.mark.timeout(240)


def reference(ids: list[int]) -> torch.Tensor:
    return MockBackend(V).logprobs([ids], None)[0]


def pending_count(url: str) -> int:
    r = redis.Redis.from_url(url)
    try:
        total = 0
        for stream in STREAMS:
            if r.exists(stream):
                total += int(r.xpending(stream, GROUP)["pending"])
        return total
    finally:
        r.close()


async def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_kill_9_a_worker_mid_batch_loses_nothing(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    common = {"backend": "mock", "mock_vocab_size": V, "mock_delay_ms": 30, "claim_after_s": 1}
    victim = workers(redis_url, **common)
    survivor = workers(redis_url, **common)
    prompts = [[i % 256, i // 256 + 1, 9] for i in range(600)]
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=120) as lm:
        tasks = [asyncio.create_task(lm.next_token_logprobs(p)) for p in prompts]
        await victim.wait_counter("requests", 32)
        victim.kill()  # SIGKILL with a batch in hand and more read ahead
        results = await asyncio.gather(*tasks)
    for got, ids in zip(results, prompts, strict=True):
        assert torch.equal(got, reference(ids))
    assert pending_count(redis_url) == 0
    assert int(survivor.info()["requests"]) > 0


@pytest.mark.asyncio
async def test_redis_restart_with_aof_mid_load_loses_nothing(
    workers: Callable[..., Any], tmp_path: Any
) -> None:
    with RedisServer(appendonly=True) as server:
        workers(server.url, backend="mock", mock_vocab_size=V, mock_delay_ms=20)
        prompts = [[i % 256, 3, i // 256] for i in range(300)]
        async with await RemoteLM.connect(server.url, model=MODEL, timeout_s=120) as lm:
            tasks = [asyncio.create_task(lm.next_token_logprobs(p)) for p in prompts]
            await asyncio.sleep(0.5)
            assert sum(t.done() for t in tasks) < len(tasks), "restart must happen mid-load"
            await asyncio.to_thread(server.restart)
            results = await asyncio.gather(*tasks)
        for got, ids in zip(results, prompts, strict=True):
            assert torch.equal(got, reference(ids))
        assert pending_count(server.url) == 0


@pytest.mark.asyncio
async def test_poison_prompt_is_dead_lettered_and_its_producer_told(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    common = {
        "backend": "mock",
        "mock_vocab_size": V,
        "mock_crash_on": "13",
        "claim_after_s": 0.3,
        "max_deliveries": 2,
    }
    first = workers(redis_url, **common)
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=120) as lm:
        # one batch: the poison kills the worker with its innocent batch mate in hand
        poison = asyncio.create_task(lm.next_token_logprobs([1, 13]))
        innocent = asyncio.create_task(lm.next_token_logprobs([1, 2]))
        assert await asyncio.to_thread(first.proc.wait, 30) == 70  # type: ignore[union-attr]
        second = workers(redis_url, **common)  # reclaims them one by one; the poison kills it
        assert await asyncio.to_thread(second.proc.wait, 30) == 70  # type: ignore[union-attr]
        workers(redis_url, **common)  # sees 2 deliveries: dead-letters it, answers the other
        with pytest.raises(DeadLettered, match="delivered 2 times"):
            await poison
        assert torch.equal(await innocent, reference([1, 2]))
        assert torch.equal(await lm.next_token_logprobs([2, 2]), reference([2, 2]))
    r = redis.Redis.from_url(redis_url)
    dead = r.xrange(KEYS.dead(MODEL))
    r.close()
    assert len(dead) == 1 and b"delivered 2 times" in dead[0][1][b"reason"]
    assert pending_count(redis_url) == 0


@pytest.mark.asyncio
async def test_sigterm_finishes_the_batch_in_hand_and_leaves_nothing_pending(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    w = workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=40)
    prompts = [[i, 5] for i in range(200)]
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=120) as lm:
        tasks = [asyncio.create_task(lm.next_token_logprobs(p)) for p in prompts]
        await w.wait_counter("requests", 16)
        code = await asyncio.to_thread(w.terminate)
        assert code == 0, w.log()
        assert pending_count(redis_url) == 0
        r = redis.Redis.from_url(redis_url)
        assert r.zcard(KEYS.workers(MODEL)) == 0, "the worker unregistered"
        r.close()
        workers(redis_url, backend="mock", mock_vocab_size=V)  # serves the rest
        results = await asyncio.gather(*tasks)
    for got, ids in zip(results, prompts, strict=True):
        assert torch.equal(got, reference(ids))


@pytest.mark.asyncio
async def test_malformed_messages_are_dead_lettered_and_the_worker_carries_on(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    workers(redis_url, backend="mock", mock_vocab_size=V)
    r = redis.Redis.from_url(redis_url)
    stream = KEYS.stream(MODEL)
    junk = [b"", b"\xc1garbage", b"\x93\x01\x02", os.urandom(64), b"\xc6\xff\xff\xff\xff"]
    for raw in junk:
        r.xadd(stream, {"m": raw})
    r.xadd(stream, {"other": b"field"})
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        assert torch.equal(await lm.next_token_logprobs([4, 4]), reference([4, 4]))
    await wait_until(
        lambda: r.xlen(KEYS.dead(MODEL)) == len(junk) + 1, 10, "junk to be dead-lettered"
    )
    assert pending_count(redis_url) == 0
    r.close()


@pytest.mark.asyncio
async def test_a_full_queue_rejects_new_requests_clearly(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    workers(
        redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=300, max_batch=1, max_queue=5
    )
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as lm:
        outcomes = await asyncio.gather(
            *(lm.next_token_logprobs([i, 1]) for i in range(30)), return_exceptions=True
        )
    rejected = [o for o in outcomes if isinstance(o, QueueFull)]
    answered = [o for o in outcomes if isinstance(o, torch.Tensor)]
    assert rejected and answered and len(rejected) + len(answered) == 30
    assert "LMPOOL_MAX_QUEUE=5" in str(rejected[0])


@pytest.mark.asyncio
async def test_in_flight_requests_are_bounded_per_producer(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=50, max_batch=2)
    settings = Settings(redis_url=redis_url, max_in_flight=4)
    r = redis.Redis.from_url(redis_url)
    seen: list[int] = []
    async with await RemoteLM.connect(model=MODEL, settings=settings) as lm:
        task = asyncio.gather(*(lm.next_token_logprobs([i, 2]) for i in range(40)))
        while not task.done():
            seen.append(sum(r.xlen(s) for s in STREAMS))
            await asyncio.sleep(0.01)
        await task
    r.close()
    assert max(seen) <= 4, max(seen)


@pytest.mark.asyncio
async def test_cancelled_requests_are_skipped_by_workers(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    w = workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=200, max_batch=1)
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        tasks = [asyncio.create_task(lm.next_token_logprobs([i, 3])) for i in range(12)]
        await w.wait_counter("requests", 1)
        for t in tasks[3:]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        skipped = await w.wait_counter("skipped", 5, timeout_s=20)
    assert skipped >= 5
    assert int(w.info()["rows"]) < 12


PRODUCER_SCRIPT = """
import asyncio, sys
from producer import RemoteLM
async def main():
    lm = await RemoteLM.connect(sys.argv[1], model=sys.argv[2], timeout_s=1)
    tasks = [asyncio.create_task(lm.next_token_logprobs([i, 7, 7])) for i in range(50)]
    await asyncio.sleep(0.3)
    print("submitted", flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


@pytest.mark.asyncio
async def test_key_count_returns_to_baseline_after_producers_vanish(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    workers(
        redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=100, max_batch=2,
        result_ttl_s=1,
    )  # fmt: skip
    r = redis.Redis.from_url(redis_url)
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        await lm.next_token_logprobs([1, 1])  # creates the model's persistent counters
    await wait_until(lambda: not list(r.scan_iter("lmpool:res:*")), 10, "the warm-up to expire")
    baseline = set(r.keys())
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER_SCRIPT, redis_url, MODEL], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    assert (await asyncio.to_thread(proc.stdout.readline)).strip() == b"submitted"
    assert len(set(r.keys()) - baseline) > 10
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    await wait_until(lambda: set(r.keys()) <= baseline, 30, "keys to expire")
    r.close()
