"""The pool on a Redis Cluster: failover under load, and Redis losing everything under a worker.

The core pool tests run on a single server and on a cluster (``tests/test_pool_mock.py``);
these are the faults only a cluster (or a wiped server) brings.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import torch
from poolkit import mock_row

from localpool.redis_cluster import RedisCluster
from producer import RemoteLM
from shared.keys import GROUP, Keys
from shared.redis_conn import connect_redis_sync
from shared.settings import Settings

V = 300
MODEL = f"mock-{V}"
KEYS = Keys()
pytestmark = pytest.mark.timeout(240)


def reference(ids: list[int]) -> torch.Tensor:
    return mock_row(V, ids)


def pending(url: str, shards: int = 4) -> int:
    r = connect_redis_sync(url)
    try:
        total = 0
        for stream in KEYS.streams(MODEL, shards):
            try:
                total += int(r.xpending(stream, GROUP)["pending"])
            except redis.ResponseError:
                pass  # no group (yet)
        return total
    finally:
        r.close()


@pytest.mark.asyncio
async def test_killing_a_master_mid_load_loses_nothing(
    redis_cluster: RedisCluster, cluster_url: str, workers: Callable[..., Any]
) -> None:
    """SIGKILL of the master that holds shard 0 while 400 requests are out: its replica takes
    over, producers and workers ride over the errors, and every request is answered with the
    right row. Writes the old master had not yet replicated are lost: stream entries and
    results (producers re-submit what stays unanswered, LMPOOL_RESEND_S) and acknowledgements
    (the entries are pending again; a worker reclaims them, LMPOOL_CLAIM_AFTER_S)."""
    for _ in range(2):
        workers(cluster_url, backend="mock", mock_vocab_size=V, mock_delay_ms=100, claim_after_s=3)
    settings = Settings(redis_url=cluster_url, timeout_s=90, resend_s=2)
    prompts = [[i % 256, 5, i // 256] for i in range(400)]
    async with await RemoteLM.connect(model=MODEL, settings=settings) as lm:
        tasks = [asyncio.create_task(lm.next_token_logprobs(p)) for p in prompts]
        await asyncio.sleep(0.3)  # 13 batches of 16 per worker at ~100 ms: ~1.3 s of work
        assert sum(t.done() for t in tasks) < len(tasks), "the kill must happen mid-load"
        victim = redis_cluster.master_of(KEYS.stats(MODEL, 0))
        started = time.monotonic()
        redis_cluster.kill(victim)
        await asyncio.to_thread(redis_cluster.wait_failover, victim)
        results = await asyncio.gather(*tasks)
        took = time.monotonic() - started
    wrong = [
        p for p, got in zip(prompts, results, strict=True) if not torch.equal(got, reference(p))
    ]
    assert not wrong, f"{len(wrong)} wrong answers"
    assert took < 60, took
    deadline = time.monotonic() + 30
    while pending(cluster_url) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert pending(cluster_url) == 0


@pytest.mark.asyncio
async def test_a_worker_recovers_from_redis_losing_everything(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """FLUSHALL (as a restart without persistence, or a promoted replica that never saw the
    consumer group, leaves things): the worker creates its groups, metadata and registration
    again within a heartbeat or two, and serves."""
    w = workers(redis_url, backend="mock", mock_vocab_size=V)
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        assert torch.equal(await lm.next_token_logprobs([1, 2]), reference([1, 2]))
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    r.close()
    settings = Settings(redis_url=redis_url, connect_timeout_s=10, timeout_s=10)
    async with await RemoteLM.connect(model=MODEL, settings=settings) as lm:
        assert torch.equal(await lm.next_token_logprobs([3, 4]), reference([3, 4]))
    assert w.proc is not None and w.proc.poll() is None, "the worker must carry on"


def test_a_cluster_without_an_arq_redis_is_refused_at_start_up(
    cluster_url: str, workers: Callable[..., Any]
) -> None:
    w = workers(cluster_url, wait=False, backend="mock", mock_vocab_size=V, arq_redis_url="")
    assert w.proc is not None
    assert w.proc.wait(timeout=60) != 0
    assert "set LMPOOL_ARQ_REDIS_URL to a plain Redis" in w.log()
