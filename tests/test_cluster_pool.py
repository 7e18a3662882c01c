"""The pool on a Redis Cluster: failover under load, and Redis losing everything under a worker.

The core pool tests run on a single server and on a cluster (``tests/test_pool_mock.py``);
these are the faults only a cluster (or a wiped server) brings.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from typing import Any, cast

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


async def _under_load(
    cluster_url: str, fault: Callable[[], Any], n: int, **settings: Any
) -> tuple[list[list[int]], list[Any], float]:
    """``n`` requests at 32 in flight, ``fault`` run in a thread once they are under way:
    the prompts, the answers (or errors), and the longest a request took (in flight)."""
    prompts = [[i % 256, 7, i // 256] for i in range(n)]
    took: list[float] = []
    async with await RemoteLM.connect(
        model=MODEL, settings=Settings(redis_url=cluster_url, **settings)
    ) as lm:
        gate = asyncio.Semaphore(32)

        async def one(p: list[int]) -> Any:
            async with gate:
                started = time.monotonic()
                try:
                    return await lm.next_token_logprobs(p)
                finally:
                    took.append(time.monotonic() - started)

        tasks = [asyncio.create_task(one(p)) for p in prompts]
        await asyncio.sleep(0.5)
        assert sum(t.done() for t in tasks) < len(tasks), "the fault must come mid-load"
        await asyncio.to_thread(fault)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return prompts, results, max(took)


@pytest.mark.asyncio
async def test_a_master_paused_past_the_node_timeout_keeps_the_writers_writing(
    redis_cluster: RedisCluster, cluster_url: str, workers: Callable[..., Any]
) -> None:
    """SIGSTOP of shard 0's master for 3 s (node timeout 1 s): its replica is promoted, and
    Redis 7 does not replicate SCRIPT LOAD, so FINISH and SWEEP meet NOSCRIPT there. Their
    load went to the primaries redis-py knew, which still counted the promoted replica among
    the replicas: NOSCRIPT again, the write failed (``ValueError: zip() argument 2 is shorter
    than argument 1``), its entries were let go and answered only after a re-submission
    (LMPOOL_RESEND_S, 15 s by default), and the heartbeat's SWEEP failed.

    A few requests still wait one re-submission (15 s), by design: commands sent to the
    paused master (a SUBMIT, or a worker's push of replies onto a reply list it serves) wait
    in its socket, and when it resumes it runs and acknowledges them before it learns, a
    millisecond later, that its replica took over; it then becomes a replica and a full
    resync drops them (traced: the pushes' answer 3 ms after SIGCONT, "Reconfiguring myself
    as a replica" 1 ms after SIGCONT, and the new master refusing a partial resync of the
    old one's 26,977 bytes it never got). A write Redis acknowledged and then lost in a
    failover is what the re-submission is for; the bound below allows one."""
    ws = [
        workers(cluster_url, backend="mock", mock_vocab_size=V, mock_delay_ms=50) for _ in range(2)
    ]
    victim = redis_cluster.master_of(KEYS.stats(MODEL, 0))

    def pause() -> None:
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGSTOP)
        time.sleep(3)
        os.kill(victim.pid, signal.SIGCONT)
        redis_cluster.wait_ready()

    prompts, results, took = await _under_load(cluster_url, pause, 600, timeout_s=60)
    wrong = [
        p for p, got in zip(prompts, results, strict=True) if not torch.equal(got, reference(p))
    ]
    assert not wrong, f"{len(wrong)} wrong answers: {results[prompts.index(wrong[0])]!r}"
    logs = "".join(w.log(10**7) for w in ws)
    assert "failed; left pending" not in logs and "heartbeat failed" not in logs, logs[-3000:]
    assert took < 20, took  # one re-submission at most (LMPOOL_RESEND_S: 15 s), see above


def move_slot(
    cluster: RedisCluster, key: str, keys_per_step: int = 3, pause_s: float = 0.3
) -> None:
    """Move ``key``'s slot to another master as ``redis-cli --cluster reshard`` does (IMPORTING,
    MIGRATING, MIGRATE a few keys at a time, SETSLOT NODE), slowly: requests meet the slot
    half moved (ASK, TRYAGAIN)."""
    src = cluster.master_of(key)
    dst = next(m for m in cluster.masters if m.port != src.port)
    a, b = src.admin(), dst.admin()
    slot = int(a.execute_command("CLUSTER", "KEYSLOT", key))
    b.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.node_id)
    a.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.node_id)
    while keys := a.execute_command("CLUSTER", "GETKEYSINSLOT", slot, keys_per_step):
        a.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys)
        time.sleep(pause_s)
    for master in cluster.masters:
        master.admin().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst.node_id)
    cluster.wait_ready()


@pytest.mark.asyncio
async def test_moving_a_slot_under_load_keeps_workers_and_requests_alive(
    redis_cluster: RedisCluster, cluster_url: str, workers: Callable[..., Any]
) -> None:
    """Shard 0's slot resharded to another master mid-load. redis-py gives up on redirections
    that do not settle (an ASKING sent on another pooled connection than its command, TRYAGAIN
    for a script whose keys are split) with ``ClusterError('TTL exhausted.')``, and a script's
    inner key of the moving slot is refused ("non local key"): both ended every worker ("the
    consumer failed ... exiting") and failed requests. Now they are waited out as a failover is.

    A write tried again while the slot moved threw away the waiter sets an earlier try's
    FINISH took (FINISH of another shard that ran while one command failed; a FINISH that took
    sets before Redis refused a key of the moving slot, its writes kept; redis-py's pipeline
    raising on its default node after every command had run): 4-12 askers a run waited their
    re-submission (LMPOOL_RESEND_S, 15 s). Those are fixed (and the test below), but about one
    run in five still has one request wait one re-submission (15.1 s; cause not found), so the
    bound is one re-submission, not none."""
    ws = [
        workers(cluster_url, backend="mock", mock_vocab_size=V, mock_delay_ms=50) for _ in range(2)
    ]
    moving: list[float] = []

    def move() -> None:
        started = time.monotonic()
        move_slot(redis_cluster, KEYS.stats(MODEL, 0))
        moving.append(time.monotonic() - started)

    prompts, results, took = await _under_load(cluster_url, move, 800, timeout_s=60)
    wrong = [
        p for p, got in zip(prompts, results, strict=True) if not torch.equal(got, reference(p))
    ]
    assert not wrong, f"{len(wrong)} wrong answers: {results[prompts.index(wrong[0])]!r}"
    assert all(w.proc is not None and w.proc.poll() is None for w in ws), ws[0].log() + ws[1].log()
    assert took < 20, (took, moving)  # the move (about 4 s), at most one resend (15 s)
    deadline = time.monotonic() + 30
    while pending(cluster_url) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert pending(cluster_url) == 0


def test_finish_refused_for_a_key_of_a_moving_slot_takes_no_waiter_set(
    redis_cluster: RedisCluster, cluster_url: str
) -> None:
    """FINISH refused ("non local key") because one digest's waiter set has already moved to
    the slot's new node changes nothing: a failed script keeps the writes it made, and
    FINISH took the sets before it, whose askers the failed call never named."""
    from shared.scripts import FINISH, finish_call

    digests = ["a" * 40, "b" * 40, "c" * 40]
    src = redis_cluster.master_of(KEYS.stats(MODEL, 0))
    dst = next(m for m in redis_cluster.masters if m.port != src.port)
    a, b = src.admin(), dst.admin()
    slot = int(a.execute_command("CLUSTER", "KEYSLOT", KEYS.stats(MODEL, 0)))
    a.hset(KEYS.stats(MODEL, 0), "queued", "3")  # FINISH's declared keys stay on src
    a.zadd(KEYS.due(MODEL, 0), {f"w:{d}": 0 for d in digests})
    for d in digests:
        a.sadd(KEYS.waiters(MODEL, 0, d), "reply-list")
    moved = KEYS.waiters(MODEL, 0, digests[1])
    b.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.node_id)
    a.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.node_id)
    try:
        a.execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", moved)
        names, args = finish_call(KEYS, MODEL, 0, False, 1000, [(d, b"r") for d in digests])
        with pytest.raises(redis.ResponseError, match="non local key"):
            a.eval(FINISH, len(names), *names, *args)
        left = set(cast(list[str], a.keys(KEYS.waiters(MODEL, 0, "*"))))
        assert left == {KEYS.waiters(MODEL, 0, d) for d in (digests[0], digests[2])}
    finally:
        pipe = b.pipeline(transaction=False)  # ASKING holds for the next command only
        pipe.execute_command("ASKING")
        pipe.delete(moved)
        pipe.execute()
        for node in (a, b):
            node.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
