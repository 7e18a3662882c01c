"""Tenants' quotas: requests in flight and prompt tokens per second, across all of a tenant's
producers; a call over quota is refused at once with nothing queued (or waits, if asked to),
a dead producer's requests stop counting when their time is up, and a tenant cannot raise its
own quota."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import pytest
import redis
import torch
from poolkit import kill, mock_row, producer_in_flight, wait_until
from redis.exceptions import NoPermissionError

from localpool.redis_server import RedisServer
from producer import RemoteLM
from shared.acl import producer_rule, worker_rule
from shared.errors import LMPoolError, QuotaExceeded
from shared.keys import Keys
from shared.redis_conn import connect_redis, connect_redis_sync
from shared.settings import Settings
from worker.quota import main as quota_cli
from worker.quota import read_quotas, set_quota
from worker.status import collect, render

V = 300
MODEL = f"mock-{V}"
pytestmark = pytest.mark.timeout(240)


def reference(ids: list[int]) -> torch.Tensor:
    return mock_row(V, ids)


async def connect(url: str, tenant: str, **kwargs: Any) -> RemoteLM:
    return await RemoteLM.connect(
        model=MODEL, settings=Settings(redis_url=url), tenant=tenant, cache_size=0, **kwargs
    )


async def quota(url: str, tenant: str, **limits: float) -> dict[str, dict[str, float]]:
    """Set ``tenant``'s quota (none given: clear it); every quota, as the status shows them."""
    r = connect_redis(url)
    try:
        await set_quota(r, Keys(), tenant, limits)
        return await read_quotas(r, Keys())
    finally:
        await r.aclose()


def queued_by(url: str, tenant: str) -> int:
    """Requests ``tenant`` queued, as SUBMIT counted them (every shard)."""
    r = connect_redis_sync(url)
    try:
        return sum(
            int(cast("bytes", r.hget(Keys().stats(MODEL, s), f"queued:{tenant}")) or 0)
            for s in range(4)
        )
    finally:
        r.close()


@pytest.mark.asyncio
async def test_over_its_in_flight_quota_a_call_is_refused_at_once_with_nothing_queued(
    any_redis_url: str, workers: Callable[..., Any]
) -> None:
    workers(any_redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=300, max_batch=4)
    await quota(any_redis_url, "alice", in_flight=4)
    alice, other = await connect(any_redis_url, "alice"), await connect(any_redis_url, "alice")
    bob = await connect(any_redis_url, "bob")
    try:
        for lm in (alice, other):  # each producer's connection made before the timed calls
            await lm.next_token_logprobs([8, 1 if lm is alice else 2])
        first = asyncio.create_task(alice.batch_next_token_logprobs([[1, i] for i in range(4)]))
        await wait_until(lambda: queued_by(any_redis_url, "alice") == 6, 10, "4 more queued")
        refusals = []
        for call in [
            other.next_token_logprobs([9, 9]),  # another producer of the same tenant
            alice.batch_next_token_logprobs([[5, 5], [6, 6]]),
        ]:
            started = time.perf_counter()
            with pytest.raises(QuotaExceeded, match="'alice' has as many requests in flight"):
                await call
            refusals.append(time.perf_counter() - started)
        assert max(refusals) < 0.010, f"refusals took {refusals} s"
        assert torch.equal(await bob.next_token_logprobs([9, 9]), reference([9, 9]))  # no quota
        rows = await first
        assert all(torch.equal(r, reference([1, i])) for i, r in enumerate(rows))
        assert queued_by(any_redis_url, "alice") == 6, "a refused call queued nothing"
        # the leases ended with their answers: room again
        assert torch.equal(await other.next_token_logprobs([9, 9]), reference([9, 9]))
        q = (await quota(any_redis_url, "alice", in_flight=4))["alice"]
        assert (q["admitted"], q["refused"], q["in_flight_now"]) == (7, 3, 0), q
    finally:
        for lm in (alice, other, bob):
            await lm.close()


@pytest.mark.asyncio
async def test_a_call_that_can_never_fit_says_so_even_when_waiting(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    workers(redis_url, backend="mock", mock_vocab_size=V)
    await quota(redis_url, "alice", in_flight=3)
    async with await connect(redis_url, "alice", quota_wait=True) as lm:
        with pytest.raises(QuotaExceeded, match="a call of 4 requests can never run"):
            await lm.batch_next_token_logprobs([[1, i] for i in range(4)])
        assert queued_by(redis_url, "alice") == 0


@pytest.mark.asyncio
async def test_a_waiting_tenant_gets_every_answer_never_past_its_quota(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=20, max_batch=16)
    await quota(redis_url, "alice", in_flight=2)
    r = redis.Redis.from_url(redis_url)
    most, done = 0, threading.Event()

    def watch() -> None:  # the tenant's leases alive at once, sampled from another thread
        nonlocal most
        while not done.is_set():
            most = max(most, cast("int", r.zcard(Keys().quota_leases("alice"))))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        async with await connect(redis_url, "alice", quota_wait=True) as lm:
            ids = [[2, i] for i in range(12)]
            rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in ids))
            assert all(torch.equal(row, reference(p)) for row, p in zip(rows, ids, strict=True))
            got = await asyncio.to_thread(lambda: lm.batch_next_token_logprobs_sync(ids[:2]))
            assert torch.equal(got[1], reference(ids[1]))
    finally:
        done.set()
        watcher.join()
        r.close()
    assert 1 <= most <= 2, most
    assert queued_by(redis_url, "alice") == 12  # the sync call's were all cached by then


@pytest.mark.asyncio
async def test_prompt_tokens_per_second(redis_url: str, workers: Callable[..., Any]) -> None:
    """A bucket of one second's tokens (100): a call of 80 goes, the next of 80 at once is
    refused with the time its tokens need, and goes after it; blocking calls the same."""
    workers(redis_url, backend="mock", mock_vocab_size=V)
    await quota(redis_url, "alice", tokens_per_s=100)
    async with await connect(redis_url, "alice") as lm:
        await lm.next_token_logprobs([1])  # the producer's connection, before the timed part
        await lm.next_token_logprobs(list(range(1, 81)))  # ~19 tokens left
        with pytest.raises(QuotaExceeded, match="prompt tokens per second") as info:
            await lm.next_token_logprobs(list(range(2, 82)))
        assert 0.3 < info.value.retry_after_s <= 0.61, info.value.retry_after_s
        with pytest.raises(QuotaExceeded, match="this call: 80 tokens"):
            await asyncio.to_thread(lm.next_token_logprobs_sync, list(range(3, 83)))
        await asyncio.sleep(info.value.retry_after_s + 0.05)
        row = await lm.next_token_logprobs(list(range(2, 82)))
        assert torch.equal(row, reference(list(range(2, 82))))
    assert queued_by(redis_url, "alice") == 3


@pytest.mark.asyncio
async def test_a_dead_producers_requests_stop_counting_when_their_time_is_up(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=2000, max_batch=2)
    await quota(redis_url, "alice", in_flight=2)
    kill(await producer_in_flight(redis_url, MODEL, [[4, 4], [4, 5]], tenant="alice"))
    killed = time.monotonic()
    async with await connect(redis_url, "alice", timeout_s=5) as lm:
        with pytest.raises(QuotaExceeded):
            await lm.next_token_logprobs([7, 7])
        # its leases end at its requests' timeout (1 s) plus the grace (5 s) after admission
        while (await quota(redis_url, "alice", in_flight=2))["alice"]["in_flight_now"]:
            assert time.monotonic() - killed < 10, "the dead producer's leases stayed"
            await asyncio.sleep(0.1)
        assert 4 < time.monotonic() - killed < 7
        assert torch.equal(await lm.next_token_logprobs([7, 7]), reference([7, 7]))


@pytest.mark.asyncio
async def test_closing_a_producer_gives_back_what_its_calls_held(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=2000, max_batch=1)
    await quota(redis_url, "alice", in_flight=2)
    lm = await connect(redis_url, "alice")
    call = asyncio.create_task(lm.batch_next_token_logprobs([[6, 1], [6, 2]]))
    await wait_until(lambda: queued_by(redis_url, "alice") == 2, 10, "the call to be queued")
    await lm.close()
    with pytest.raises(LMPoolError, match="closed"):
        await call
    assert (await quota(redis_url, "alice", in_flight=2))["alice"]["in_flight_now"] == 0


@pytest.mark.asyncio
async def test_no_quota_costs_one_question_a_second_and_a_new_one_applies_within_it(
    redis_url: str, workers: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import producer.quota

    asked: list[float] = []
    run = producer.quota._run

    async def counted(*args: Any) -> Any:
        asked.append(time.monotonic())
        return await run(*args)

    monkeypatch.setattr(producer.quota, "_run", counted)
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=200, max_batch=64)
    async with await connect(redis_url, "alice") as lm:
        await asyncio.gather(*(lm.next_token_logprobs([3, i]) for i in range(50)))
        await asyncio.gather(*(lm.next_token_logprobs([4, i]) for i in range(50)))
        assert len(asked) == 1, "one question for 100 calls within a second"
        assert not redis.Redis.from_url(redis_url).exists(Keys().quota_use("alice"))
        await quota(redis_url, "alice", in_flight=1)
        await asyncio.sleep(1.1)
        with pytest.raises(QuotaExceeded):
            await asyncio.gather(*(lm.next_token_logprobs([5, i]) for i in range(3)))


def test_the_quota_cli_and_status_show_it(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    env = ["--redis-url", redis_url]
    assert quota_cli(["alice", "--in-flight", "8", "--tokens-per-s", "500", *env]) == 0
    assert "tenant alice: in flight 0 of 8, prompt tokens/s 500" in capsys.readouterr().out

    async def status() -> str:
        r = connect_redis(redis_url)
        try:
            return render(await collect(r, Keys()))
        finally:
            await r.aclose()

    text = asyncio.run(status())
    assert "quotas (python -m worker.quota):" in text and "tenant alice: in flight 0 of 8" in text
    assert quota_cli(["alice", "--clear", *env]) == 0
    assert capsys.readouterr().out.strip() == "no tenant has a quota"
    for bad in (["al ice", "--in-flight", "1"], ["alice"], ["alice", "--in-flight", "-1"]):
        with pytest.raises(SystemExit):
            quota_cli([*bad, *env])


@pytest.mark.asyncio
async def test_a_tenant_cannot_raise_its_own_quota(workers: Callable[..., Any]) -> None:
    rules = [worker_rule("w", "pw", "lab"), producer_rule("alice", "pa", "lab", tenant=True)]
    with RedisServer(password="admin", acl_lines=rules) as server:
        workers(
            server.url_for("w", "pw"), backend="mock", mock_vocab_size=V, key_prefix="lab",
            mock_delay_ms=300,
        )  # fmt: skip
        admin = connect_redis(server.url)
        await set_quota(admin, Keys("lab"), "alice", {"in_flight": 1})
        await admin.aclose()
        alice = Settings(redis_url=server.url_for("alice", "pa"), key_prefix="lab")
        async with await RemoteLM.connect(model=MODEL, settings=alice, cache_size=0) as lm:
            assert torch.equal(await lm.next_token_logprobs([1, 2]), reference([1, 2]))
            with pytest.raises(QuotaExceeded):
                await asyncio.gather(lm.next_token_logprobs([1, 3]), lm.next_token_logprobs([1, 4]))
        raw = redis.Redis.from_url(server.url_for("alice", "pa"))
        with pytest.raises(NoPermissionError):
            raw.hset(Keys("lab").quota("alice"), "in_flight", "1000")
        raw.close()


@pytest.mark.asyncio
async def test_a_token_debt_outlives_the_minute_the_bucket_key_lives(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A call larger than a second's tokens leaves the bucket in debt: the bucket (the debt)
    must last until it is repaid, or a tenant gets a full bucket a minute later (a call of
    100 tokens under 1 token/s would cost a minute, not 100 s: 1.67x its rate, and more
    with larger calls)."""
    workers(redis_url, backend="mock", mock_vocab_size=V)
    await quota(redis_url, "alice", tokens_per_s=1)
    async with await connect(redis_url, "alice") as lm:
        await lm.next_token_logprobs(list(range(1, 101)))  # 100 tokens: 99 s in debt
        with pytest.raises(QuotaExceeded) as info:
            await lm.next_token_logprobs([1])
        assert info.value.retry_after_s > 98, info.value.retry_after_s
    r = redis.Redis.from_url(redis_url)
    try:
        ttl_ms = cast("int", r.pttl(Keys().quota_bucket("alice")))
    finally:
        r.close()
    assert ttl_ms >= 1000 * (info.value.retry_after_s - 1), (  # 1 s: the time these took
        f"the bucket in debt for {info.value.retry_after_s} s expires in {ttl_ms} ms: "
        "full again then"
    )


@pytest.mark.asyncio
async def test_a_token_quota_alone_still_shows_the_requests_in_flight(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """With a token quota and no in-flight limit, the status shows what is in flight (it
    said 0 whatever the tenant had in flight)."""
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=1500, max_batch=4)
    await quota(redis_url, "alice", tokens_per_s=100_000)
    async with await connect(redis_url, "alice") as lm:
        call = asyncio.create_task(lm.batch_next_token_logprobs([[3, 1], [3, 2], [3, 3]]))
        await wait_until(lambda: queued_by(redis_url, "alice") == 3, 10, "the call queued")
        q = (await quota(redis_url, "alice", tokens_per_s=100_000))["alice"]
        assert q["in_flight_now"] == 3, q
        await call
        q = (await quota(redis_url, "alice", tokens_per_s=100_000))["alice"]
        assert q["in_flight_now"] == 0, q


@pytest.mark.asyncio
async def test_closing_gives_back_what_blocking_calls_held(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A producer used by blocking calls (threads) and closed while they are in flight: its
    leases end at the close, not at the requests' timeout (120 s by default)."""
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=2000, max_batch=1)
    await quota(redis_url, "alice", in_flight=2)
    lm = await connect(redis_url, "alice")
    call = asyncio.create_task(
        asyncio.to_thread(lm.batch_next_token_logprobs_sync, [[6, 3], [6, 4]])
    )
    await wait_until(lambda: queued_by(redis_url, "alice") == 2, 10, "the call to be queued")
    await lm.close()
    assert (await quota(redis_url, "alice", in_flight=2))["alice"]["in_flight_now"] == 0
    await asyncio.gather(call, return_exceptions=True)  # its end releases nothing more
    assert (await quota(redis_url, "alice", in_flight=2))["alice"]["in_flight_now"] == 0


def test_close_sync_gives_back_what_blocking_calls_held(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=2000, max_batch=1)
    asyncio.run(quota(redis_url, "alice", in_flight=2))
    lm = asyncio.run(connect(redis_url, "alice"))
    errors: list[BaseException] = []

    def blocking() -> None:
        try:
            lm.batch_next_token_logprobs_sync([[6, 5], [6, 6]])
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=blocking)
    thread.start()
    deadline = time.monotonic() + 10
    while queued_by(redis_url, "alice") < 2:
        assert time.monotonic() < deadline, "the call was not queued"
        time.sleep(0.05)
    lm.cleanup()  # close_sync
    in_flight_at_close = asyncio.run(quota(redis_url, "alice", in_flight=2))["alice"]
    thread.join(30)
    assert in_flight_at_close["in_flight_now"] == 0, in_flight_at_close
    in_flight = asyncio.run(quota(redis_url, "alice", in_flight=2))["alice"]["in_flight_now"]
    assert in_flight == 0


def test_the_quota_cli_refuses_limits_that_make_no_sense(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fraction of a request in flight (0.5 refused every call as one that "can never run"),
    not-a-number or infinite limits (nan made no limit at all), limits given with --clear or
    with no tenant (silently ignored): each refused, naming what is wrong."""
    env = ["--redis-url", redis_url]
    for bad, says in [
        (["alice", "--in-flight", "0.5"], "whole number"),
        (["alice", "--in-flight", "2.5"], "whole number"),
        (["alice", "--in-flight", "nan"], "finite"),
        (["alice", "--tokens-per-s", "nan"], "finite"),
        (["alice", "--tokens-per-s", "inf"], "finite"),
        (["alice", "--clear", "--in-flight", "4"], "--clear"),
        (["--in-flight", "4"], "tenant"),
    ]:
        with pytest.raises(SystemExit):
            quota_cli([*bad, *env])
        assert says in capsys.readouterr().err, bad
    assert quota_cli(["alice", "--in-flight", "3", "--tokens-per-s", "2.5", *env]) == 0
    assert "in flight 0 of 3, prompt tokens/s 2.5" in capsys.readouterr().out
    assert quota_cli(["alice", "--clear", *env]) == 0


@pytest.mark.asyncio
async def test_a_call_that_waits_for_room_is_not_counted_refused(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """With ``quota_wait`` a call over quota asks again every few ms until admitted: each try
    counted as refused requests, the status said dozens refused where none was; only a call
    that gives up is refused (counted once)."""
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=500, max_batch=4)
    await quota(redis_url, "alice", in_flight=1)
    async with await connect(redis_url, "alice", quota_wait=True) as lm:
        rows = await asyncio.gather(lm.next_token_logprobs([7, 1]), lm.next_token_logprobs([7, 2]))
        assert torch.equal(rows[1], reference([7, 2]))
    q = (await quota(redis_url, "alice", in_flight=1))["alice"]
    assert (q["admitted"], q["refused"]) == (2, 0), q
    holder = await connect(redis_url, "alice")
    async with await connect(redis_url, "alice", quota_wait=True, timeout_s=0.3) as lm:
        first = asyncio.create_task(holder.next_token_logprobs([7, 3]))  # 0.5 s in flight
        await asyncio.sleep(0.1)
        with pytest.raises(QuotaExceeded, match="after waiting"):
            await lm.next_token_logprobs([7, 4])
        await first
    await holder.close()
    q = (await quota(redis_url, "alice", in_flight=1))["alice"]
    assert (q["admitted"], q["refused"]) == (3, 1), q
