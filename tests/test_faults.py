"""Fault injection: killed workers, a restarted Redis, poison prompts, shutdown, bad messages.

Every test checks that each request is answered with the right values (or a typed error),
and that nothing is left pending.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import pytest
import redis
import torch
from poolkit import kill, mock_row, producer_in_flight, wait_until

from localpool.redis_server import RedisServer
from producer import RemoteLM
from shared import protocol
from shared.errors import DeadLettered, InvalidRequest, ProtocolError, QueueFull, RequestTimeout
from shared.keys import GROUP, Keys
from shared.scripts import SUBMIT_SCRIPT, submit_call
from shared.settings import Settings
from worker.backends.mock import MockBackend

V = 300
MODEL = f"mock-{V}"
KEYS = Keys()
STREAMS = KEYS.streams(MODEL, Settings().shards)
pytestmark = pytest.mark.timeout(240)


def reference(ids: list[int]) -> torch.Tensor:
    return mock_row(V, ids)


def pending_count(url: str) -> int:
    r = redis.Redis.from_url(url)
    try:
        total = 0
        for stream in STREAMS:
            if r.exists(stream):
                total += int(cast("dict[str, Any]", r.xpending(stream, GROUP))["pending"])
        return total
    finally:
        r.close()


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
        # 19 batches of 16 at ~50 ms: about a second of work, restarted half-way. A read whose
        # reply the restart cut off leaves entries pending to a worker that never saw them: it
        # takes them back after LMPOOL_CLAIM_AFTER_S (their results exist by then: cache hits)
        workers(server.url, backend="mock", mock_vocab_size=V, mock_delay_ms=50, claim_after_s=1)
        prompts = [[i % 256, 3, i // 256] for i in range(300)]
        async with await RemoteLM.connect(server.url, model=MODEL, timeout_s=120) as lm:
            tasks = [asyncio.create_task(lm.next_token_logprobs(p)) for p in prompts]
            await asyncio.sleep(0.5)
            assert sum(t.done() for t in tasks) < len(tasks), "restart must happen mid-load"
            await asyncio.to_thread(server.restart)
            results = await asyncio.gather(*tasks)
        for got, ids in zip(results, prompts, strict=True):
            assert torch.equal(got, reference(ids))
        await wait_until(lambda: pending_count(server.url) == 0, 30, "no entry left pending")


async def slow_to_load(r: redis.Redis) -> None:
    """Give a ``RedisServer(appendonly=True, loading_delay_us=1000)`` 3,000 keys in its AOF's
    base, an RDB, whose keys load one by one (the delay applies): a restart answers LOADING
    for ~3 s."""
    r.mset({f"filler:{i}": "x" for i in range(3000)})
    r.bgrewriteaof()

    def rewritten() -> bool:
        return not cast(dict[str, Any], r.info("persistence"))["aof_rewrite_in_progress"]

    await wait_until(rewritten, 10, "the AOF rewritten")


@pytest.mark.asyncio
async def test_a_restart_that_answers_loading_for_seconds_loses_nothing(
    workers: Callable[..., Any], tmp_path: Any
) -> None:
    """Redis restarts while the worker computes a 2 s step and then answers LOADING for ~3 s
    (3,000 keys, each loaded 1 ms slower): the worker's write waits it out and the asker gets
    its row, nothing stays pending, and the worker logs one line per retry, no traceback (before:
    its writer died on LOADING, the entry stayed pending for good and the asker timed out)."""
    with RedisServer(appendonly=True, loading_delay_us=1000) as server:
        r = redis.Redis.from_url(server.url)
        await slow_to_load(r)
        w = workers(server.url, backend="mock", mock_vocab_size=V, mock_delay_ms=2000)
        async with await RemoteLM.connect(server.url, model=MODEL, timeout_s=30) as lm:
            ask = asyncio.create_task(lm.next_token_logprobs([3, 4, 5]))
            await asyncio.sleep(0.7)  # in its step
            await asyncio.to_thread(server.restart)  # returns once loaded (PONG)
            assert torch.equal(await ask, reference([3, 4, 5]))
        await wait_until(lambda: pending_count(server.url) == 0, 10, "no entry left pending")
        assert "LOADING" in w.log() and "Traceback" not in w.log(), w.log()
        r.close()


@pytest.mark.asyncio
async def test_requests_sent_while_redis_loads_its_data_wait_for_it_without_hammering_it(
    workers: Callable[..., Any],
) -> None:
    """Requests made while a restarted Redis answers LOADING (~3 s) are answered once it has
    loaded, their SUBMITs repeated after growing pauses as when Redis is unreachable (before:
    at once, one round trip after another, as long as the loading lasted; before today's
    ``shared.resp.Loading``, the callers failed at once with "submit failed")."""
    with RedisServer(appendonly=True, loading_delay_us=1000) as server:
        r = redis.Redis.from_url(server.url)
        await slow_to_load(r)
        workers(server.url, backend="mock", mock_vocab_size=V)
        async with await RemoteLM.connect(server.url, model=MODEL, timeout_s=30) as lm:
            assert torch.equal(await lm.next_token_logprobs([1]), reference([1]))
            restart = asyncio.create_task(asyncio.to_thread(server.restart))

            def loading() -> bool:
                try:
                    r.ping()
                except redis.exceptions.BusyLoadingError:
                    return True
                except redis.ConnectionError:
                    pass
                return False

            await wait_until(loading, 10, "Redis loading")
            prompts = [[7], [8, 9], [10, 11, 12]]
            alone = asyncio.create_task(lm.next_token_logprobs([13]))  # alone: the one-trip path
            await asyncio.sleep(0.5)
            rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
            assert torch.equal(await alone, reference([13]))
            await restart
        for row, ids in zip(rows, prompts, strict=True):
            assert torch.equal(row, reference(ids))
        stats = cast(dict[str, Any], r.info("commandstats"))
        refused = stats.get("cmdstat_evalsha", {}).get("rejected_calls", 0)
        assert refused < 30, stats.get("cmdstat_evalsha")  # 10 here; 74 and 80 before
        r.close()


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
        assert await asyncio.to_thread(first.proc.wait, 30) == 70
        second = workers(redis_url, **common)  # reclaims them one by one; the poison kills it
        assert await asyncio.to_thread(second.proc.wait, 30) == 70
        workers(redis_url, **common)  # sees 2 deliveries: dead-letters it, answers the other
        with pytest.raises(DeadLettered, match="delivered 2 times"):
            await poison
        assert torch.equal(await innocent, reference([1, 2]))
        assert torch.equal(await lm.next_token_logprobs([2, 2]), reference([2, 2]))
    r = redis.Redis.from_url(redis_url)
    dead = cast("list[tuple[bytes, dict[bytes, bytes]]]", r.xrange(KEYS.dead(MODEL)))
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
async def test_a_stopping_worker_renews_what_it_finishes_so_nothing_is_queued_again(
    redis_url: str, workers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After SIGTERM a worker finishes the requests it holds (one running, two read ahead: two
    steps of 1.2 s) and goes on claiming them again meanwhile: its producers, re-submitting every
    0.3 s, see them held and queue nothing again (before, renewals stopped with the reading and
    the two read ahead were queued again). A worker started later serves the one left unread."""
    monkeypatch.setenv("LMPOOL_RESEND_S", "0.3")
    monkeypatch.setenv("LMPOOL_HEARTBEAT_S", "0.2")  # held: renewed within 3 heartbeats
    w = workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=1200, max_batch=2)
    prompts = [[i, 7] for i in range(4)]
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as lm:
        asks = asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        await wait_until(lambda: pending_count(redis_url) == 3, 10, "one running, two read ahead")
        assert await asyncio.to_thread(w.terminate, 30) == 0, w.log()
        workers(redis_url, backend="mock", mock_vocab_size=V)
        rows = await asks
    for row, ids in zip(rows, prompts, strict=True):
        assert torch.equal(row, reference(ids))
    r = redis.Redis.from_url(redis_url)
    queued = sum(int(cast(Any, r.hget(KEYS.stats(MODEL, s), "queued")) or 0) for s in range(4))
    r.close()
    assert queued == 4
    assert pending_count(redis_url) == 0


@pytest.mark.asyncio
async def test_a_stopping_worker_takes_over_nothing_more(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A worker taking over a dead worker's entries one at a time stops after the one in hand
    when told to (before, it ran every entry it had queued for taking over first: 7 more, 4 s
    here); the others stay pending, and a worker started later serves them: nothing lost."""
    dead = workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=3000,
                   max_batch=16)  # fmt: skip
    prompts = [[i, 1] for i in range(24)]
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=120) as lm:
        asks = asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        await wait_until(lambda: pending_count(redis_url) >= 16, 10, "a batch read")
        dead.kill()
        taker = workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=500,
                        claim_after_s=1, log_level="INFO")  # fmt: skip
        await wait_until(lambda: "claimed from a dead consumer" in taker.log(), 20, "a takeover")
        started = time.monotonic()
        assert await asyncio.to_thread(taker.terminate, 60) == 0, taker.log()
        assert time.monotonic() - started < 2.5, taker.log()
        after = taker.log(100_000).split("SIGTERM")[-1]
        assert after.count("claimed from a dead consumer") <= 1, after
        workers(redis_url, backend="mock", mock_vocab_size=V, claim_after_s=1)
        rows = await asks
    for row, ids in zip(rows, prompts, strict=True):
        assert torch.equal(row, reference(ids))


@pytest.mark.asyncio
async def test_a_generation_whose_asker_gave_up_stops_and_sigterm_is_prompt(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A 60,000-token sample (~3 ms a token here: minutes) whose asker times out after 1 s stops
    at its deadline, between two tokens: the worker answers ``Expired``, serves on, and a
    SIGTERM then stops it in seconds with nothing pending."""
    w = workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=3)
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=1.0) as lm:
        with pytest.raises(RequestTimeout):
            await lm.sample([1, 2], 60_000, [], seed=1)
        await asyncio.sleep(1.0)  # past the deadline: the generation has stopped
        assert torch.equal(await lm.next_token_logprobs([3, 4]), reference([3, 4]))
    started = time.monotonic()
    assert await asyncio.to_thread(w.terminate, 20) == 0, w.log()
    assert time.monotonic() - started < 10
    assert "generation(s) stopped: their askers' deadlines passed" in w.log()
    assert pending_count(redis_url) == 0


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
async def test_a_dead_lettered_request_answers_its_waiters_and_keeps_little(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A producer of another version sends a 1.6 MB message (beyond the worker's
    LMPOOL_MAX_MESSAGE_BYTES) through the SUBMIT script: its waiter is told why at once, and
    the dead letter keeps 4 KiB of the message, not all of it."""
    workers(redis_url, backend="mock", mock_vocab_size=V)
    r = redis.Redis.from_url(redis_url)
    digest, reply = "ab" * 20, KEYS.reply("old-producer")
    huge = b"\x00" * 1_600_000
    SUBMIT_SCRIPT.load_sync(r)
    keys, args = submit_call(
        KEYS, MODEL, 0, KEYS.stream(MODEL, "high", 0), [(digest, "0", huge)],
        reply=reply, wait_ms=60_000, max_queue=1000, stale_ms=15_000,
    )  # fmt: skip
    code = r.execute_command("EVALSHA", SUBMIT_SCRIPT.sha, len(keys), *keys, *args)
    assert len(code) == 1 and b"-" in code[0]  # queued: the id of its entry
    popped = cast("tuple[bytes, bytes] | None", r.blpop([reply], timeout=10))
    assert popped is not None, "the waiter of a dead-lettered request was never answered"
    got_digest, outcome = protocol.decode_reply(popped[1])
    assert got_digest == digest
    assert isinstance(outcome, ProtocolError) and "exceeds the limit of 1048576" in str(outcome)
    ((_, fields),) = cast("list[tuple[bytes, dict[bytes, bytes]]]", r.xrange(KEYS.dead(MODEL)))
    assert len(fields[b"m"]) == 4096 and int(fields[b"size"]) == len(huge)
    assert pending_count(redis_url) == 0
    r.close()


@pytest.mark.asyncio
async def test_too_long_prompts_fail_at_the_producer_at_once(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    workers(redis_url, backend="mock", mock_vocab_size=V, max_message_bytes=4096)
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as lm:
        started = time.monotonic()
        with pytest.raises(InvalidRequest, match="1600000 tokens exceeds the limit of 65536"):
            await lm.next_token_logprobs(list(range(8)) * 200_000)
        assert time.monotonic() - started < 1.0
        with pytest.raises(InvalidRequest, match="LMPOOL_MAX_MESSAGE_BYTES=4096"):
            await lm.next_token_logprobs([1] * 2000)
        with pytest.raises(InvalidRequest, match="exceeds the limit"):
            lm.next_token_logprobs_sync([1] * 100_000)
        assert torch.equal(await lm.next_token_logprobs([1] * 500), reference([1] * 500))


@pytest.mark.asyncio
async def test_a_score_too_big_for_the_workers_fails_at_the_producer_on_a_large_vocabulary(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A continuation travels as a msgpack list: an id of 65,536 or more takes 5 bytes there,
    not 4. A score whose message is over ``LMPOOL_MAX_MESSAGE_BYTES`` only by that is refused
    by the producer at once (before: sent, dead-lettered by the worker, ``DeadLettered``)."""
    big = 100_000
    workers(redis_url, backend="mock", mock_vocab_size=big, max_message_bytes=4096)
    async with await RemoteLM.connect(redis_url, model=f"mock-{big}", timeout_s=30) as lm:
        cont = [70_000 + i for i in range(780)]  # 3,900 bytes as a list, 3,120 counted as int32
        started = time.monotonic()
        with pytest.raises(InvalidRequest, match="LMPOOL_MAX_MESSAGE_BYTES=4096"):
            await lm.score(list(range(10)), cont)
        assert time.monotonic() - started < 1.0
        assert (await lm.score(list(range(10)), cont[:300])).shape == (300,)


@pytest.mark.asyncio
async def test_a_sample_longer_than_the_context_is_refused_stating_the_limits(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A generation reads its prompt and every token it draws but the last: past the model's
    context it is refused before anything is sent, and by the worker when a producer does not
    check (its limit raised here); ``max_tokens`` past the protocol's bound names the bound."""
    workers(redis_url, backend="mock", mock_vocab_size=V)
    async with await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as lm:
        limit = lm.prompt_limit
        started = time.monotonic()
        with pytest.raises(
            InvalidRequest, match=f"prompt and max_tokens - 1 of {limit + 1} tokens exceeds"
        ):
            await lm.sample([1, 2], limit, [V - 1])
        with pytest.raises(InvalidRequest, match=r"max_tokens must be an int in \[0, 1000000\]"):
            await lm.batch_sample([[1]], 10**9, [V - 1])
        assert time.monotonic() - started < 1.0
        assert len(await lm.sample([1, 2], limit - 1, [V - 1], seed=0)) <= limit - 1
        lm.prompt_limit = 10**9  # as a producer that does not check
        with pytest.raises(
            InvalidRequest, match=f"of {limit + 1} tokens exceeds the limit of {limit}"
        ):
            await lm.sample([1, 2], limit, [V - 1])


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
async def test_a_lone_request_to_a_full_queue_fails_at_once(
    redis_url: str, workers: Callable[..., Any], listen_block_s: float
) -> None:
    """A request alone in its producer goes out with the pop of its reply in one pipeline; a
    full queue's refusal must end that pop at once (SUBMIT pushes a marker), not after it
    blocked."""
    workers(
        redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=1000, max_batch=1, max_queue=2
    )
    r = redis.Redis.from_url(redis_url)
    async with (
        await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as busy,
        await RemoteLM.connect(redis_url, model=MODEL, timeout_s=60) as lone,
    ):
        filling = asyncio.gather(
            *(busy.next_token_logprobs([i, 3]) for i in range(8)), return_exceptions=True
        )
        while sum(cast(int, r.xlen(s)) for s in STREAMS) < 2:
            await asyncio.sleep(0.005)
        started = time.monotonic()
        with pytest.raises(QueueFull, match="LMPOOL_MAX_QUEUE=2"):
            await lone.next_token_logprobs([99, 3])
        with pytest.raises(QueueFull, match="LMPOOL_MAX_QUEUE=2"):
            lone.next_token_logprobs_sync([98, 3])
        assert time.monotonic() - started < listen_block_s / 2, "a refusal waited for a reply"
        outcomes = await filling
    r.close()
    answered = {i: o for i, o in enumerate(outcomes) if isinstance(o, torch.Tensor)}
    assert answered and all(torch.equal(o, reference([i, 3])) for i, o in answered.items())


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
            seen.append(sum(cast(int, r.xlen(s)) for s in STREAMS))
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


@pytest.mark.asyncio
async def test_a_request_asked_again_after_its_only_asker_left_is_answered(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """The only asker cancels while the entry waits behind a slow step (its waiter set empties
    and vanishes); asked again, the request is queued again and answered with the right row,
    well before LMPOOL_RESEND_S, and no entry stays pending."""
    w = workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=300, max_batch=1)
    r = redis.Redis.from_url(redis_url)
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        blocker = asyncio.create_task(lm.next_token_logprobs([9, 9]))
        await w.wait_counter("requests", 1)
        first = asyncio.create_task(lm.next_token_logprobs([5, 6]))
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        prepared = lm._prepare("logprobs", [5, 6], None, {})
        waiters = Keys().waiters(MODEL, prepared.shard, prepared.digest)
        await wait_until(lambda: not r.exists(waiters), 5, "the waiter set to empty")
        started = time.monotonic()
        row = await lm.next_token_logprobs([5, 6])
        assert time.monotonic() - started < 5
        assert torch.equal(row, reference([5, 6]))
        await blocker
    await wait_until(lambda: pending_count(redis_url) == 0, 10, "every entry to be acknowledged")
    r.close()


@pytest.mark.asyncio
async def test_a_request_asked_again_while_its_leaving_is_on_its_way_is_answered(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """Asked again at once after its only asker cancelled: the new SUBMIT (on its own
    connection) may reach Redis before the leaving SREM, join the waiter set, and be taken out
    of it by that SREM; the worker then skips it and nobody is told. Answered within a step,
    not after LMPOOL_RESEND_S (longer than the timeout here: a RequestTimeout before)."""
    w = workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=300, max_batch=1)
    settings = Settings(redis_url=redis_url, timeout_s=8, resend_s=30)
    async with await RemoteLM.connect(model=MODEL, settings=settings) as lm:
        blocker = asyncio.create_task(lm.next_token_logprobs([9, 9]))
        await w.wait_counter("requests", 0)
        await asyncio.sleep(0.1)
        first = asyncio.create_task(lm.next_token_logprobs([5, 6]))
        await asyncio.sleep(0.05)  # queued behind the blocker
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.sleep(0)  # its leaving has begun
        started = time.monotonic()
        row = await lm.next_token_logprobs([5, 6])
        took = time.monotonic() - started
        await blocker
    assert torch.equal(row, reference([5, 6]))
    assert took < 3, took


@pytest.mark.asyncio
async def test_a_blocking_call_that_times_out_leaves_its_waiter_sets(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """As an async one does: the worker then skips what nobody waits for (it computed all of it,
    and pushed replies nobody read)."""
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=400, max_batch=1)
    settings = Settings(redis_url=redis_url, timeout_s=0.5)
    r = redis.Redis.from_url(redis_url)
    async with await RemoteLM.connect(model=MODEL, settings=settings) as lm:
        blocker = asyncio.create_task(asyncio.to_thread(lm.next_token_logprobs_sync, [9, 9]))
        await asyncio.sleep(0.1)  # the worker is busy for 400 ms
        prompts = [[i, 8] for i in range(4)]
        with pytest.raises(RequestTimeout):
            await asyncio.to_thread(lm.batch_next_token_logprobs_sync, prompts)
        prepared = [lm._prepare("logprobs", ids, None, {}) for ids in prompts]
        sets = [Keys().waiters(MODEL, p.shard, p.digest) for p in prepared]
        left = [r.smembers(key) for key in sets]
        await asyncio.gather(blocker, return_exceptions=True)
    r.close()
    assert not any(left), left


def consumers(url: str) -> dict[str, int]:
    """Every consumer of the model's groups (``stream:name``) and what it holds."""
    r = redis.Redis.from_url(url)
    out = {}
    for stream in STREAMS:
        if r.exists(stream):
            for c in cast("list[dict[str, Any]]", r.xinfo_consumers(stream, GROUP)):
                out[f"{stream}:{c['name'].decode()}"] = int(c["pending"])
    r.close()
    return out


@pytest.mark.asyncio
async def test_stopped_and_killed_workers_leave_the_groups(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """Each worker process became a consumer of every stream for good: restarts piled them
    up. A stopped worker leaves at once; a killed one that held nothing is taken out by the
    others once idle past LMPOOL_CLAIM_AFTER_S; a live one stays."""
    for i in range(2):
        w = workers(redis_url, backend="mock", mock_vocab_size=V)
        async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
            await asyncio.gather(*(lm.next_token_logprobs([j, i]) for j in range(8)))
        before = consumers(redis_url)
        w.stop()  # SIGTERM: it leaves
        assert before and not consumers(redis_url), before
    w = workers(redis_url, backend="mock", mock_vocab_size=V)
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        await asyncio.gather(*(lm.next_token_logprobs([j, 5]) for j in range(8)))
    killed = set(consumers(redis_url))
    kill(w.proc)
    survivor = workers(redis_url, backend="mock", mock_vocab_size=V, claim_after_s=1)
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        await asyncio.gather(*(lm.next_token_logprobs([j, 6]) for j in range(8)))
    await wait_until(lambda: not killed & set(consumers(redis_url)), 10, "the dead to leave")
    left = consumers(redis_url)
    assert left and all(name.endswith(survivor.worker_ids()[0]) for name in left), left


@pytest.mark.asyncio
async def test_a_prompt_that_kills_workers_is_dead_lettered_though_submitted_again(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """Its producer submits it again once its holder looks dead, long before a take-over
    counts a second delivery: each new copy started with no delivery, so every restarted
    worker (a supervisor restarts them) read it and died, and its caller timed out. Now the
    new copy carries the deliveries (and replaces the old one): LMPOOL_MAX_DELIVERIES workers
    die at most, and the caller gets DeadLettered."""
    common = {
        "backend": "mock", "mock_vocab_size": V, "mock_crash_on": "13",
        "claim_after_s": 5, "max_deliveries": 2, "heartbeat_s": 0.2,
    }  # fmt: skip
    settings = Settings(redis_url=redis_url, timeout_s=25, resend_s=0.5, heartbeat_s=0.2)
    deaths = 0
    w = workers(redis_url, **common)
    async with await RemoteLM.connect(model=MODEL, settings=settings) as lm:
        poison = asyncio.create_task(lm.next_token_logprobs([1, 13]))
        while not poison.done() and deaths < 6:
            if not w.alive():
                deaths += 1
                w = workers(redis_url, **common)
            await asyncio.sleep(0.1)
        (outcome,) = await asyncio.gather(poison, return_exceptions=True)
        assert isinstance(outcome, DeadLettered), (deaths, outcome)
        assert deaths <= 2
        assert torch.equal(await lm.next_token_logprobs([1, 2]), reference([1, 2]))
    await wait_until(lambda: pending_count(redis_url) == 0, 10, "nothing left pending")


@pytest.mark.asyncio
async def test_a_taken_over_entry_counts_the_deliveries_it_carries(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """An entry that replaced a dead copy (it carries 1 delivery) and was then read by a
    worker that died (1 more): the worker that takes it over dead-letters it, at
    LMPOOL_MAX_DELIVERIES=2, instead of running it (and dying: its own count alone was 1)."""
    common = {
        "backend": "mock", "mock_vocab_size": V, "mock_crash_on": "13",
        "claim_after_s": 0.3, "max_deliveries": 2, "heartbeat_s": 0.2,
    }  # fmt: skip
    first = workers(redis_url, backend="mock", mock_vocab_size=V)
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        prepared = lm._prepare("logprobs", [1, 13], None, {})
    first.stop()
    r = redis.Redis.from_url(redis_url)
    stream = KEYS.stream(MODEL, "high", prepared.shard)
    deadline_ms = int(time.time() * 1000) + 60_000
    fields = {"m": prepared.message(deadline_ms), "d": prepared.digest, "k": 1}
    r.xadd(stream, fields)  # type: ignore[arg-type]
    r.xreadgroup(GROUP, "a-dead-worker", {stream: ">"}, count=1)  # its one delivery
    taker = workers(redis_url, **common)
    await wait_until(lambda: cast(int, r.xlen(KEYS.dead(MODEL))) > 0, 20, "the entry dead-lettered")
    await asyncio.sleep(0.5)
    dead = cast("list[tuple[bytes, dict[bytes, bytes]]]", r.xrange(KEYS.dead(MODEL)))
    r.close()
    # once (the scripts were not loaded yet: a re-run of the write after NOSCRIPT wrote it twice)
    assert len(dead) == 1 and b"delivered 2 times" in dead[0][1][b"reason"]
    assert taker.alive()
    await wait_until(lambda: pending_count(redis_url) == 0, 10, "nothing left pending")


class Evictor(threading.Thread):
    """Deletes every result the moment it is first written (as Redis evicts under
    ``maxmemory``), from keyspace notifications."""

    def __init__(self, url: str, keys: str = "res", event: bytes = b"set") -> None:
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(url)
        self.r.config_set("notify-keyspace-events", "K$s")
        self.sub = self.r.pubsub()
        self.keys, self.event = keys, event
        self.deleted: set[bytes] = set()
        self.done = threading.Event()

    def start(self) -> None:
        # keys of that kind (results by default) written from now on
        self.sub.psubscribe(f"__keyspace@0__:lmpool:*:{self.keys}:*")
        super().start()

    def run(self) -> None:
        while not self.done.is_set():
            m = self.sub.get_message(timeout=0.1)
            if m and m["type"] == "pmessage" and m["data"] == self.event:
                key = m["channel"].split(b":", 1)[1]
                if key not in self.deleted:
                    self.deleted.add(key)
                    self.r.delete(key)

    def stop(self) -> None:
        self.done.set()
        if self.is_alive():
            self.join(5)
        self.sub.close()
        self.r.close()


@pytest.mark.asyncio
async def test_results_evicted_before_they_are_read_are_computed_again(
    workers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every result vanishes as it is written, before its askers read it (an eviction under
    ``maxmemory``; the askers read 50 ms late here): async and blocking callers still get every
    right row, each computed a second time."""
    from producer.loop import LoopState
    from producer.submit import SyncState

    async def late_fetch(self: Any, *args: Any) -> Any:
        await asyncio.sleep(0.05)
        return await fetch(self, *args)

    def late_fetch_sync(self: Any, *args: Any) -> Any:
        time.sleep(0.05)
        return fetch_sync(self, *args)

    fetch, fetch_sync = LoopState._fetch, SyncState._fetch
    monkeypatch.setattr(LoopState, "_fetch", late_fetch)
    monkeypatch.setattr(SyncState, "_fetch", late_fetch_sync)
    vocab = 2000  # rows of 8 KB: read from the cache, not carried in the reply
    with RedisServer() as server:
        w = workers(server.url, backend="mock", mock_vocab_size=vocab)
        evictor = Evictor(server.url)
        try:
            async with await RemoteLM.connect(server.url, model=f"mock-{vocab}") as lm:
                # first, with nothing evicted: the worker loads its scripts (a write that meets
                # NOSCRIPT runs again whole, SET included)
                await lm.next_token_logprobs([1, 10])
                evictor.start()
                prompts = [[i, 11] for i in range(16)]
                rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
                sync_prompts = [[i, 12] for i in range(16)]
                sync_rows = await asyncio.to_thread(lm.batch_next_token_logprobs_sync, sync_prompts)
        finally:
            evictor.stop()
        backend = MockBackend(vocab)
        for p, row in zip(prompts + sync_prompts, [*rows, *sync_rows], strict=True):
            assert torch.equal(row, backend.logprobs([p], None)[0])
        assert len(evictor.deleted) == 32
        assert await w.wait_counter("computed", 65) == 65


@pytest.mark.asyncio
async def test_a_blocking_call_whose_waiter_sets_are_evicted_asks_again(
    workers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each request's waiter set vanishes as it is made (evicted by a full Redis): the worker
    then answers nobody, and a blocking caller, as an async one, submits again after
    ``LMPOOL_RESEND_S`` and gets every right row (it waited until its timeout before)."""
    monkeypatch.setenv("LMPOOL_RESEND_S", "0.5")
    vocab = 2000
    with RedisServer() as server:
        w = workers(server.url, backend="mock", mock_vocab_size=vocab, mock_delay_ms=100)
        evictor = Evictor(server.url, keys="wait", event=b"sadd")
        try:
            async with await RemoteLM.connect(
                server.url, model=f"mock-{vocab}", timeout_s=30
            ) as lm:
                await lm.next_token_logprobs([1, 10])  # scripts loaded, nothing evicted
                evictor.start()
                prompts = [[i, 15] for i in range(4)]
                started = time.monotonic()
                rows = await asyncio.to_thread(lm.batch_next_token_logprobs_sync, prompts)
                elapsed = time.monotonic() - started
        finally:
            evictor.stop()
        backend = MockBackend(vocab)
        for p, row in zip(prompts, rows, strict=True):
            assert torch.equal(row, backend.logprobs([p], None)[0])
        assert len(evictor.deleted) == 4  # every waiter set, once
        assert elapsed < 10
        # each computed once: the second submission finds its result in the cache
        assert await w.wait_counter("computed", 5) == 5


@pytest.mark.asyncio
async def test_a_full_capped_redis_evicts_results_and_every_answer_is_right(
    workers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis as deployed (``maxmemory``, ``volatile-lru``), small enough that the pool's own
    results overfill it: 240 distinct requests for 196 KB rows, 16 in flight, then 16 blocking
    ones, all answered right while Redis evicts."""
    monkeypatch.setenv("LMPOOL_RESEND_S", "1")  # an evicted waiter set or reply list: ask again
    vocab = 49_152
    with RedisServer(maxmemory_mb=24, maxmemory_policy="volatile-lru") as server:
        workers(server.url, backend="mock", mock_vocab_size=vocab)
        async with await RemoteLM.connect(server.url, model=f"mock-{vocab}") as lm:
            slots = asyncio.Semaphore(16)

            async def ask(ids: list[int]) -> torch.Tensor:
                async with slots:
                    return await lm.next_token_logprobs(ids)

            prompts = [[i, 13] for i in range(240)]
            rows = await asyncio.gather(*(ask(p) for p in prompts))
            sync_prompts = [[i, 14] for i in range(16)]
            sync_rows = await asyncio.to_thread(lm.batch_next_token_logprobs_sync, sync_prompts)
        r = redis.Redis.from_url(server.url)
        stats: Any = r.info("stats")
        r.close()
    backend = MockBackend(vocab)
    for p, row in zip(prompts + sync_prompts, [*rows, *sync_rows], strict=True):
        assert torch.equal(row, backend.logprobs([p], None)[0])
    assert stats["evicted_keys"] > 0


@pytest.mark.asyncio
async def test_a_redis_full_of_unread_results_is_freed_by_the_workers_sweep(
    workers: Callable[..., Any],
) -> None:
    """Unread results keep no TTL until they are due (askers gone), so a capped Redis full of
    them refuses every write (volatile-lru finds nothing to evict), the worker's heartbeat
    included. The heartbeat's sweep, which gives due results their TTL and is never refused
    at the cap, runs first: Redis takes writes again within a few heartbeats (before: the
    refused heartbeat skipped the sweep, and Redis stayed full for good)."""
    with RedisServer(maxmemory_mb=8, maxmemory_policy="volatile-lru") as server:
        w = workers(server.url, backend="mock", mock_vocab_size=V, heartbeat_s=0.2)
        r = redis.Redis.from_url(server.url)
        for i in range(10_000):  # results whose askers left: due long ago, no TTL yet
            digest = f"{i:040x}"
            try:
                r.zadd(KEYS.due(MODEL, i % 4), {f"r:{digest}": 0})
                r.set(KEYS.result(MODEL, i % 4, digest), b"x" * 100_000)
            except redis.exceptions.OutOfMemoryError:
                break
        else:
            raise AssertionError("Redis never filled up")

        def writable() -> bool:
            try:
                return bool(r.set("probe", b"x" * 100_000, px=60_000))
            except redis.exceptions.OutOfMemoryError:
                return False

        await wait_until(writable, 10, "Redis taking writes again")
        async with await RemoteLM.connect(server.url, model=MODEL, timeout_s=30) as lm:
            assert torch.equal(await lm.next_token_logprobs([4, 2]), reference([4, 2]))
        assert w.alive()
        r.close()


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
        await lm.next_token_logprobs([1, 1])
        shards = lm._client.settings.shards
    await wait_until(
        lambda: not list(r.scan_iter(Keys().results(MODEL))), 10, "the warm-up to expire"
    )

    def keys_now() -> set[bytes]:
        return set(cast("list[bytes]", r.keys()))

    # the per-shard counters are the only keys meant to last (a bounded number per model)
    baseline = keys_now() | {Keys().stats(MODEL, s).encode() for s in range(shards)}
    proc = await producer_in_flight(redis_url, MODEL, [[i, 7, 7] for i in range(50)])
    assert len(keys_now() - baseline) > 10
    kill(proc)
    await wait_until(lambda: keys_now() <= baseline, 30, "keys to expire")
    r.close()


@pytest.mark.asyncio
async def test_a_request_past_its_deadline_costs_no_compute(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A request whose asker gave up is dropped unrun (``Expired``); another asker of the same
    prompt with more time left has it submitted again and gets the answer."""
    w = workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=400, max_batch=1)
    async with (
        await RemoteLM.connect(redis_url, model=MODEL, timeout_s=0.25) as hasty,
        await RemoteLM.connect(redis_url, model=MODEL, timeout_s=30) as patient,
    ):
        blocker = asyncio.create_task(patient.next_token_logprobs([1, 1]))
        await w.wait_counter("rows", 0)
        await asyncio.sleep(0.05)  # the blocker is read first
        with pytest.raises(RequestTimeout):
            await hasty.next_token_logprobs([2, 2])  # queued behind 400 ms of work
        assert torch.equal(await blocker, reference([1, 1]))
        await w.wait_counter("errors", 1)  # the expired one, answered Expired
        assert await w.wait_counter("rows", 1) == 1, "the expired request must not run"
        # the same prompt, asked by both: the message carries the hasty deadline
        both = asyncio.gather(
            patient.next_token_logprobs([1, 1, 1]),  # busy the worker again
            hasty.next_token_logprobs([3, 3]),
            patient.next_token_logprobs([3, 3]),
            return_exceptions=True,
        )
        blocked, hasty_row, patient_row = await both
    assert isinstance(hasty_row, RequestTimeout)
    assert isinstance(patient_row, torch.Tensor) and isinstance(blocked, torch.Tensor)
    assert torch.equal(patient_row, reference([3, 3]))
    assert torch.equal(blocked, reference([1, 1, 1]))
