"""The pool on a Redis as deployed: capped (``maxmemory``, ``volatile-lru``), full and evicting.

The shared cache gives up its oldest results to make room; a result still awaited is the
newest key there, and must reach its asker without being computed again."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import torch
from poolkit import wait_until

from localpool.redis_server import RedisServer, fill_until_evicting
from producer import RemoteLM
from shared.errors import RedisFull
from shared.keys import GROUP, Keys
from shared.scripts import SUBMIT_SCRIPT, submit_call
from worker.backends.mock import MockBackend
from worker.quota import set_quota

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


def refuse_writes(r: Any) -> None:
    """A Redis that takes no more: ``maxmemory`` below what it holds, ``noeviction``."""
    r.config_set("maxmemory", int(r.info("memory")["used_memory"]) // 2)


def left_behind(r: Any, model: str) -> tuple[list[bytes], int, int]:
    """Waiter sets, stream entries and entries pending on a worker, of ``model``."""
    keys = Keys("lmpool")
    waiter_sets = r.keys(keys.results(model).replace(":res:", ":wait:"))
    streams = [k for k in r.keys(f"lmpool:{{{model}:*") if r.type(k) == b"stream"]
    entries = sum(int(r.xlen(s)) for s in streams)
    pending = sum(int(r.xpending(s, GROUP)["pending"]) for s in streams)
    return waiter_sets, entries, pending


@pytest.mark.asyncio
async def test_a_full_redis_refuses_requests_at_once_naming_the_cause(
    workers: Callable[..., Any],
) -> None:
    """A Redis at its cap that evicts nothing (``noeviction``) refuses SUBMIT: every path
    (a lone request, a batch, blocking calls) raises ``RedisFull`` at once, saying what to do,
    and leaves nothing behind (no waiter set, no entry, no quota lease); once Redis has room
    the same client is answered (before: ``LMPoolError('submit failed: ResponseError("OOM
    command not allowed ...")')``, nothing said of what to do)."""
    vocab, model = 2000, "mock-2000"
    with RedisServer() as server:
        w = workers(server.url, backend="mock", mock_vocab_size=vocab)
        r: Any = redis.Redis.from_url(server.url)
        operator: Any = aioredis.Redis.from_url(server.url)
        await set_quota(operator, Keys(), "alice", {"in_flight": 100, "tokens_per_s": 0})
        await operator.aclose()
        async with await RemoteLM.connect(server.url, model=model, tenant="alice") as lm:
            await lm.next_token_logprobs([1, 2])  # scripts loaded
            refuse_writes(r)
            started = asyncio.get_running_loop().time()
            with pytest.raises(RedisFull, match="maxmemory-policy volatile-lru"):
                await lm.next_token_logprobs([3, 4])
            assert asyncio.get_running_loop().time() - started < 3
            with pytest.raises(RedisFull, match="maxmemory"):
                await lm.batch_next_token_logprobs([[5, i] for i in range(4)])
            with pytest.raises(RedisFull):
                await asyncio.to_thread(lm.next_token_logprobs_sync, [6, 6])
            with pytest.raises(RedisFull):
                await asyncio.to_thread(lm.batch_next_token_logprobs_sync, [[7, 1], [7, 2]])
            await wait_until(lambda: r.zcard(Keys().quota_leases("alice")) == 0, 5, "leases")
            assert left_behind(r, model) == ([], 0, 0)
            r.config_set("maxmemory", 0)
            row = await lm.next_token_logprobs([3, 4])
        assert torch.equal(row, MockBackend(vocab).logprobs([[3, 4]], None)[0])
        w.stop()
        r.close()


@pytest.mark.asyncio
async def test_a_result_a_full_redis_refuses_to_store_is_an_error_not_a_wait(
    workers: Callable[..., Any],
) -> None:
    """Redis fills while a request is computed: the worker's write of its result is refused
    (OOM). Its asker gets ``RedisFull`` as soon as the write fails, not a wait until its
    timeout, nothing is left queued, and with room again it is answered right."""
    vocab, model = 2000, "mock-2000"
    with RedisServer() as server:
        w = workers(server.url, backend="mock", mock_vocab_size=vocab, mock_delay_ms=1000)
        r: Any = redis.Redis.from_url(server.url)
        async with await RemoteLM.connect(server.url, model=model, timeout_s=60) as lm:
            await lm.next_token_logprobs([1, 2])
            asking = asyncio.create_task(lm.next_token_logprobs([5, 6, 7]))
            await wait_until(lambda: left_behind(r, model)[2] == 1, 5, "the worker taking it")
            refuse_writes(r)
            started = asyncio.get_running_loop().time()
            with pytest.raises(RedisFull, match="maxmemory"):
                await asking
            assert asyncio.get_running_loop().time() - started < 5
            assert left_behind(r, model) == ([], 0, 0)
            r.config_set("maxmemory", 0)
            row = await lm.next_token_logprobs([5, 6, 7])
        assert torch.equal(row, MockBackend(vocab).logprobs([[5, 6, 7]], None)[0])
        assert w.alive() and "Redis is full" in w.log(20_000)
        w.stop()
        r.close()


def status(url: str, *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "worker.status", "--redis-url", url, *args],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}, check=True,
    ).stdout  # fmt: skip


@pytest.mark.asyncio
async def test_the_status_command_says_when_redis_is_full(workers: Callable[..., Any]) -> None:
    """A full Redis (above ``maxmemory``, ``noeviction``) refuses the workers' heartbeats too,
    so that within three of them the status command shows "no live worker": it now says first
    that Redis is full, and what to do (before: not a word of Redis' memory)."""
    with RedisServer() as server:
        w = workers(server.url, backend="mock", mock_vocab_size=2000)
        r: Any = redis.Redis.from_url(server.url)
        assert "no maxmemory cap" in status(server.url).splitlines()[0]
        refuse_writes(r)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            r.set("probe", b"x")
        first = status(server.url).splitlines()[0]
        assert "maxmemory-policy noeviction" in first and "FULL" in first, first
        assert "raise maxmemory" in first and "volatile-lru" in first
        memory = json.loads(status(server.url, "--json"))["redis"]
        assert memory["full"] and memory["refused_oom"] >= 1
        assert memory["used_memory"] > memory["maxmemory"] > 0
        r.config_set("maxmemory", 0)
        w.stop()
        r.close()
