"""The pool on a Redis as deployed: capped (``maxmemory``, ``volatile-lru``), full and evicting.

The shared cache gives up its oldest results to make room; a result still awaited is the
newest key there, and must reach its asker without being computed again."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import redis
import torch
from poolkit import wait_until

from localpool.redis_server import RedisServer, fill_until_evicting
from producer import RemoteLM
from shared.keys import Keys
from shared.scripts import SUBMIT_SCRIPT, submit_call
from worker.backends.mock import MockBackend

VOCAB = 49_152  # 196 KB rows, as a small model's (float32)


@pytest.mark.asyncio
async def test_2000_requests_at_128_in_flight_on_a_full_redis_each_computed_once(
    workers: Callable[..., Any],
) -> None:
    """2,000 distinct requests, 128 in flight, on a 64 MB Redis filled first (about 300 rows
    fit; the requests' rows alone are 390 MB): every answer right, the cache evicting all the
    while, and the worker computing each request exactly once."""
    with RedisServer(maxmemory_mb=64, maxmemory_policy="volatile-lru") as server:
        w = workers(server.url, backend="mock", mock_vocab_size=VOCAB)
        filled = fill_until_evicting(server.url, 4 * VOCAB, "filler")
        assert filled > 200
        async with await RemoteLM.connect(server.url, model=f"mock-{VOCAB}") as lm:
            lm.cache.clear()
            slots = asyncio.Semaphore(128)
            prompts = [[i % 97, i // 97, 3] for i in range(2000)]

            async def ask(ids: list[int]) -> torch.Tensor:
                async with slots:
                    return await lm.next_token_logprobs(ids)

            rows = await asyncio.gather(*(ask(p) for p in prompts))
        r: Any = redis.Redis.from_url(server.url)
        evicted = int(r.info("stats")["evicted_keys"])
        r.close()
        assert await w.wait_counter("computed", 2000) == 2000
        await asyncio.sleep(2.5)  # a heartbeat later: nothing computed since
        assert int(w.info().get("computed", 0)) == 2000
    assert evicted > 1500
    backend = MockBackend(VOCAB)
    for p, row in zip(prompts, rows, strict=True):
        assert torch.equal(row, backend.logprobs([p], None)[0])


@pytest.mark.asyncio
async def test_what_is_awaited_has_no_ttl_and_nothing_stays_forever(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A queued request's waiter set and an unread result carry no TTL (so ``volatile-lru``
    cannot take them); the first read gives a result its TTL; a result whose asker left, and a
    waiter set nobody answers, get theirs (or go) once due, from the workers' sweep."""
    vocab, model = 2000, "mock-2000"
    workers(redis_url, backend="mock", mock_vocab_size=vocab, mock_delay_ms=400, result_ttl_s=2)
    keys = Keys("lmpool")
    r: Any = redis.Redis.from_url(redis_url)
    lm = await RemoteLM.connect(redis_url, model=model)
    results, waiter_sets = keys.results(model), keys.results(model).replace(":res:", ":wait:")
    waiting = asyncio.create_task(lm.next_token_logprobs([7, 8]))
    await wait_until(lambda: bool(r.keys(waiter_sets)), 5, "a waiter set")
    (waiters,) = r.keys(waiter_sets)
    assert r.pttl(waiters) == -1
    result = waiters.replace(b":wait:", b":res:")
    row = await waiting
    assert torch.equal(row, MockBackend(vocab).logprobs([[7, 8]], None)[0])
    assert 0 < r.pttl(result) <= 2000  # read: from now on an ordinary cache entry

    # an asker that leaves before its answer: its result is written, unread, without a TTL
    left = asyncio.create_task(lm.next_token_logprobs([9, 9]))
    await asyncio.sleep(0.1)
    left.cancel()
    await lm.close()
    await wait_until(lambda: len(r.keys(results)) == 2, 5, "the result")
    (lost,) = set(r.keys(results)) - {result}
    assert r.pttl(lost) == -1
    # due after min(result TTL, 60 s) = 2 s; then swept within a heartbeat: it gets its TTL
    await wait_until(lambda: r.pttl(lost) > 0, 6, "the unread result's TTL")

    # a waiter set whose request is never answered (its entry went to a stream nobody reads)
    orphan, nowhere = "cd" * 20, keys.stream(model, "high", 0) + ":nowhere"
    SUBMIT_SCRIPT.load_sync(r)
    names, args = submit_call(
        keys, model, 0, nowhere, [(orphan, "0", b"message")],
        reply=keys.reply("gone"), wait_ms=300, max_queue=1000, stale_ms=15_000,
    )  # fmt: skip
    code = r.execute_command("EVALSHA", SUBMIT_SCRIPT.sha, len(names), *names, *args)
    assert b"-" in code[0] and r.pttl(keys.waiters(model, 0, orphan)) == -1
    await wait_until(lambda: not r.exists(keys.waiters(model, 0, orphan)), 5, "the sweep")
    await wait_until(
        lambda: all(r.zcard(keys.due(model, s)) == 0 for s in range(4)), 5, "empty due sets"
    )
    r.delete(nowhere)
    r.close()
