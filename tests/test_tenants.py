"""Tenants of one pool: who asks is known, tenants share the batches by weight, nobody queues
behind another's flood, and the per-tenant counters add up to the pool's."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import pytest
import redis
import torch
from poolkit import mock_row
from redis.exceptions import NoPermissionError

from localpool.redis_server import RedisServer
from producer import RemoteLM
from shared.acl import producer_rule, worker_rule
from shared.errors import RequestTimeout, SettingsError
from shared.keys import Keys
from shared.settings import Settings
from worker.status import collect
from worker.stream.tenants import Shares

V = 300
MODEL = f"mock-{V}"
pytestmark = pytest.mark.timeout(240)


def reference(ids: list[int]) -> torch.Tensor:
    return mock_row(V, ids)


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, V) for _ in range(6)] for _ in range(n)]


async def connect(url: str, tenant: str, **kwargs: Any) -> RemoteLM:
    return await RemoteLM.connect(
        model=MODEL, settings=Settings(redis_url=url), tenant=tenant, cache_size=0, **kwargs
    )


# -- who asks -------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_the_tenant_is_the_acl_user_and_cannot_be_claimed(
    workers: Callable[..., Any],
) -> None:
    rules = [
        worker_rule("w", "pw", "lab"),
        producer_rule("alice", "pa", "lab", tenant=True),
        producer_rule("bob", "pb", "lab", tenant=True),
    ]
    with RedisServer(password="admin", acl_lines=rules) as server:
        workers(server.url_for("w", "pw"), backend="mock", mock_vocab_size=V, key_prefix="lab")
        alice = Settings(redis_url=server.url_for("alice", "pa"), key_prefix="lab")
        async with await RemoteLM.connect(model=MODEL, settings=alice) as lm:
            assert lm.tenant == "alice"
            assert torch.equal(await lm.next_token_logprobs([1, 2]), reference([1, 2]))
            assert torch.equal(lm.next_token_logprobs_sync([3]), reference([3]))
        async with await RemoteLM.connect(model=MODEL, settings=alice, tenant="alice") as lm:
            assert torch.equal(await lm.next_token_logprobs([4, 5]), reference([4, 5]))
        with pytest.raises(SettingsError, match="ACL user 'alice'"):
            await RemoteLM.connect(model=MODEL, settings=alice, tenant="bob")

        # below the library: Redis refuses alice's requests in bob's stream (and in the
        # stream of no tenant), directly and through the SUBMIT script
        keys = Keys("lab")
        raw = redis.Redis.from_url(server.url_for("alice", "pa"))
        for stream in (keys.stream(MODEL, "high", 0, "bob"), keys.stream(MODEL, "high", 0)):
            with pytest.raises(NoPermissionError):
                raw.xadd(stream, {"m": b"x", "d": "ab" * 20})
        assert raw.xlen(keys.stream(MODEL, "high", 0, "bob")) == 0  # reading is allowed
        raw.close()
        admin = redis.Redis.from_url(server.url)
        tenants: set[bytes] = set()
        for shard in range(4):
            tenants |= cast("set[bytes]", admin.smembers(keys.tenants(MODEL, shard)))
        assert tenants == {b"alice"}
        admin.close()


@pytest.mark.asyncio
async def test_a_new_tenant_waits_once_for_its_streams_to_be_found(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """Workers find a new tenant's streams within a blocking read (~100-200 ms); once found,
    on every shard: its requests to other shards are not delayed again."""
    workers(redis_url, backend="mock", mock_vocab_size=V)
    lm = await connect(redis_url, "carol")
    try:
        first = time.monotonic()
        await lm.next_token_logprobs([9, 9, 9])
        first_s = time.monotonic() - first
        later = []
        for p in prompts(8, 12):  # spread over the shards by their first tokens
            started = time.monotonic()
            assert torch.equal(await lm.next_token_logprobs(p), reference(p))
            later.append(time.monotonic() - started)
    finally:
        await lm.close()
    assert first_s < 1.0
    assert sorted(later)[len(later) // 2] < 0.05 and max(later) < 0.5, later


@pytest.mark.asyncio
async def test_a_tenants_timeout_names_its_own_queue(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A tenant's requests wait in its own streams: the queue state of a timeout counts them."""
    worker = workers(redis_url, backend="mock", mock_vocab_size=V)
    lm = await RemoteLM.connect(
        model=MODEL, settings=Settings(redis_url=redis_url, timeout_s=1.0), tenant="dave"
    )
    worker.kill()
    try:
        with pytest.raises(RequestTimeout, match=r"within 1s.*interactive queue 1 \(0 pending"):
            await lm.next_token_logprobs([42, 43])
    finally:
        await lm.close()


def test_tenant_names_and_weights_are_checked() -> None:
    with pytest.raises(SettingsError, match="LMPOOL_TENANT"):
        Settings(tenant="a b")
    with pytest.raises(SettingsError, match="weight of 'a' must be a number > 0"):
        Settings(tenant_weights='{"a": 0}')
    with pytest.raises(SettingsError, match="JSON object"):
        Settings(tenant_weights="[1]")
    with pytest.raises(SettingsError, match="unknown setting LMPOOL_TENANTS"):
        Settings.from_env({"LMPOOL_TENANTS": "x"})
    assert Settings(tenant_weights='{"a": 3, "b": 0.5}').weights() == {"a": 3.0, "b": 0.5}


def test_deficit_round_robin_gives_shares_by_weight_and_keeps_no_idle_credit() -> None:
    shares = Shares({"b": 3.0})
    served = {"a": 0, "b": 0}
    for _ in range(100):  # both always have more waiting than they may take
        quotas = shares.quotas(["a", "b"], 10)
        assert sum(quotas.values()) <= 10
        shares.settle(quotas, quotas, {"a", "b"})
        for t, n in quotas.items():
            served[t] += n
    assert served["b"] / served["a"] == pytest.approx(3, rel=0.05)
    quotas = shares.quotas(["a", "b"], 10)
    owed_b = shares.deficit["b"]
    shares.settle(quotas, {"a": 0, "b": quotas["b"]}, {"b"})  # a had nothing waiting
    assert shares.deficit["a"] == 0.0 and shares.deficit["b"] == owed_b - quotas["b"]


# -- sharing the batches --------------------------------------------------------------------
async def flood(lm: RemoteLM, ids: list[list[int]], done: list[float]) -> None:
    async def one(p: list[int]) -> None:
        row = await lm.next_token_logprobs(p)
        assert torch.equal(row, reference(p))
        done.append(time.monotonic())

    await asyncio.gather(*(one(p) for p in ids))


@pytest.mark.asyncio
async def test_a_tenant_does_not_queue_behind_another_tenants_flood(
    any_redis_url: str, workers: Callable[..., Any]
) -> None:
    """A queues 2,000 requests at once (batches of 16 at ~8 ms each: over a second of work);
    B's lone requests meanwhile are answered within a few batches each, while most of A's queue
    is still there: first come, first served would answer them after all of A's. A is another
    researcher's process: its own RemoteLM, in its own thread's event loop, so that this loop
    stays free for the requests it times."""
    workers(any_redis_url, backend="mock", mock_vocab_size=V, max_batch=16, mock_delay_ms=8)
    n = 2000
    b = await connect(any_redis_url, "b")
    a_done: list[float] = []
    a_connected = threading.Event()

    async def tenant_a() -> None:
        async with await connect(any_redis_url, "a") as a:
            await a.next_token_logprobs([8])
            a_connected.set()
            await flood(a, prompts(1, n), a_done)

    await b.next_token_logprobs([7])  # B's streams known to the worker before the flood
    flooding = asyncio.create_task(asyncio.to_thread(asyncio.run, tenant_a()))
    waits = []
    try:
        assert await asyncio.to_thread(a_connected.wait, 30), "tenant A did not connect"
        await asyncio.sleep(0.05)
        for p in prompts(2, 8):
            started = time.monotonic()
            assert torch.equal(await b.next_token_logprobs(p), reference(p))
            waits.append(time.monotonic() - started)
        a_left = n - len(a_done)
    finally:
        await b.close()
        await asyncio.wait_for(flooding, 60)  # A's flood is answered whole, whatever B saw
    assert len(a_done) == n
    assert a_left > n // 3, f"B's requests ({waits} s) were answered after most of A's"
    assert sorted(waits)[len(waits) // 2] < 0.2, f"B waited {waits} s"


def served_by_tenant(r: redis.Redis) -> dict[str, float]:
    """Requests the worker has answered per tenant, as its last heartbeat says."""
    keys = Keys()
    out: dict[str, float] = {}
    for key in r.scan_iter(keys.worker_pattern()):
        raw = cast("bytes | None", r.hget(key, "tenants"))
        for tenant, counters in (json.loads(raw) if raw else {}).items():
            out[tenant] = out.get(tenant, 0) + counters["requests"]
    return out


@pytest.mark.asyncio
async def test_saturating_tenants_share_the_batches_by_weight(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """Weights 1 and 3, both with far more queued than a batch: while both have work, the
    worker answers three of B's requests for each of A's (within 10%), and nothing is lost.
    (Read from the worker's heartbeats, by a thread: this loop is busy with 2,100 requests.)
    Batches take 12 ms, so that this process has queued both floods before the worker is far
    into them: with 4 ms a batch the worker once outran B's submissions (B served 2.6x A's in
    the window, B's requests arriving slower than its weight would take them)."""
    workers(
        redis_url, backend="mock", mock_vocab_size=V, max_batch=16, mock_delay_ms=12,
        tenant_weights='{"b": 3}', heartbeat_s=0.05,
    )  # fmt: skip
    a, b = await connect(redis_url, "a"), await connect(redis_url, "b")
    snapshots: list[dict[str, float]] = []
    stop = threading.Event()

    def watch() -> None:
        with redis.Redis.from_url(redis_url) as r:
            while not stop.wait(0.02):
                snapshots.append(served_by_tenant(r))

    watcher = threading.Thread(target=watch)
    try:
        await asyncio.gather(a.next_token_logprobs([7]), b.next_token_logprobs([8]))
        a_done: list[float] = []
        b_done: list[float] = []
        watcher.start()
        await asyncio.gather(flood(a, prompts(3, 600), a_done), flood(b, prompts(4, 1500), b_done))
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
        await a.close()
        await b.close()
    assert len(a_done) == 600 and len(b_done) == 1500
    # between two heartbeats from the middle of the run, both with work left (at 1:3, B ends
    # first, having had 1,500 when A has had 500); not from the start: one tenant's requests
    # reach the worker first and fill its first batches alone, as they should
    first = next((s for s in snapshots if s.get("b", 0) >= 200), None)
    last = next((s for s in snapshots if s.get("b", 0) >= 1300), None)
    assert first and last, f"no heartbeats from the middle of the run: {snapshots[-5:]}"
    a_n, b_n = last["a"] - first["a"], last["b"] - first["b"]
    assert b_n / a_n == pytest.approx(3, rel=0.1), f"served A {a_n}, B {b_n} meanwhile"


# -- accounting -----------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_the_status_queued_now_and_mean_wait_of_each_tenant_are_right(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """Mid-run, a tenant's "queued now" is what waits in its streams (length less what
    workers took), also for requests of no tenant (``-``, always 0 before; taken entries were
    counted as queued); its mean wait in the stream is over the requests that waited it (it
    was over fewer: a mean longer than the run)."""
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=500, max_batch=2,
            heartbeat_s=0.1)  # fmt: skip
    a = await connect(redis_url, "alice")
    none = await RemoteLM.connect(model=MODEL, settings=Settings(redis_url=redis_url))
    r = redis.asyncio.Redis.from_url(redis_url)
    try:
        started = time.monotonic()
        asks = asyncio.gather(
            *(a.next_token_logprobs([i, 3]) for i in range(12)),
            *(none.next_token_logprobs([i, 4]) for i in range(12)),
        )
        await asyncio.sleep(1.7)
        data = (await collect(r, Keys()))["models"][MODEL]
        elapsed = time.monotonic() - started
        await asks
    finally:
        await r.aclose()
        for lm in (a, none):
            await lm.close()
    truth: dict[str, int] = {}
    for label, stream in data["streams"].items():
        tenant = label.split(":")[2] if label.count(":") == 2 else "-"
        truth[tenant] = truth.get(tenant, 0) + stream["length"] - stream["pending"]
    shown = {t: int(row.get("queued", 0)) for t, row in data["tenants"].items()}
    assert truth["-"] > 0 and truth["alice"] > 0, truth  # mid-run: both wait
    assert shown == truth
    for tenant, row in data["tenants"].items():
        if row.get("requests"):
            assert row["wait_s"] / row["requests"] <= elapsed, (tenant, row, elapsed)


@pytest.mark.asyncio
async def test_per_tenant_counters_add_up_to_the_pools(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    workers(redis_url, backend="mock", mock_vocab_size=V, heartbeat_s=0.1)
    a, b = await connect(redis_url, "a"), await connect(redis_url, "b")
    none = await RemoteLM.connect(model=MODEL, settings=Settings(redis_url=redis_url))
    try:
        assert none.tenant == ""
        await a.batch_next_token_logprobs(prompts(5, 30))
        await b.batch_next_token_logprobs(prompts(6, 20))
        await none.batch_next_token_logprobs(prompts(7, 10))
        await b.batch_next_token_logprobs(prompts(5, 30))  # A's prompts: shared-cache hits
    finally:
        for lm in (a, b, none):
            await lm.close()
    await asyncio.sleep(0.5)  # the workers' counters reach their heartbeats
    r = redis.asyncio.Redis.from_url(redis_url)
    data = (await collect(r, Keys()))["models"][MODEL]
    await r.aclose()
    tenants = data["tenants"]
    assert set(tenants) == {"a", "b", "-"}
    worker = data["workers"][0]
    assert sum(t.get("requests", 0) for t in tenants.values()) == worker["requests"] == 60
    assert (tenants["a"]["computed"], tenants["b"]["computed"], tenants["-"]["computed"]) == (
        30, 20, 10,
    )  # fmt: skip
    assert tenants["a"]["prompt_tokens"] == 30 * 6
    assert tenants["b"]["producer_cache_hits"] == 30
    assert (
        sum(t.get("producer_cache_hits", 0) for t in tenants.values())
        == (data["producer_counters"]["cache_hits"])
    )
    assert all(t["compute_s"] > 0 and t["wait_s"] >= 0 for t in tenants.values())
