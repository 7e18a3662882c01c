"""The pool on a Redis Cluster under the faults ``tests/test_cluster_pool.py`` leaves out: a
master with no replica killed and started again (its data gone, kept in an AOF, or an older RDB
snapshot), the blocking (``*_sync``) producer path under a failover and a slot moving, and what
``lmpool-status`` says while a node is down."""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest
import torch
from poolkit import mock_row
from test_cluster_pool import move_slot, pending

from localpool.redis_cluster import RedisCluster
from producer import RemoteLM
from shared.keys import Keys
from shared.settings import Settings
from worker import status

V = 300
MODEL = f"mock-{V}"
KEYS = Keys()
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", params=["none", "aof", "rdb"])
def bare_cluster(request: pytest.FixtureRequest) -> Iterator[RedisCluster]:
    """3 masters, no replica: a master killed leaves its slots unserved (``cluster_state:fail``
    everywhere, the default ``cluster-require-full-coverage``) until it is started again, with
    nothing (``none``), its AOF (``aof``), or the RDB snapshot taken before the kill (``rdb``)."""
    with RedisCluster(masters=3, replicas=0, appendonly=request.param == "aof") as cluster:
        cluster.persistence = request.param  # type: ignore[attr-defined]
        yield cluster


def other_url(cluster: RedisCluster, victim: Any) -> str:
    return next(n.url for n in cluster.masters if n.port != victim.port)


def kill_and_restart(cluster: RedisCluster, down_s: float = 3.0) -> Callable[[], None]:
    """The master of shard 0 killed (after an RDB snapshot in ``rdb``), started ``down_s``
    later from its directory."""
    victim = cluster.master_of(KEYS.stats(MODEL, 0))

    def fault() -> None:
        if getattr(cluster, "persistence", "") == "rdb":
            admin = victim.admin()
            admin.bgsave()
            while cast(dict[str, Any], admin.info("persistence"))["rdb_bgsave_in_progress"]:
                time.sleep(0.01)
            time.sleep(0.3)  # writes the snapshot misses: it comes back older
        cluster.kill(victim)
        time.sleep(down_s)
        cluster.restart(victim)

    return fault


def right(prompts: list[list[int]], results: list[Any]) -> list[Any]:
    """What is not the right row (a wrong row, or an error)."""
    return [
        got
        for p, got in zip(prompts, results, strict=True)
        if not isinstance(got, torch.Tensor) or not torch.equal(got, mock_row(V, p))
    ]


def blocking_under_load(
    url: str, fault: Callable[[], Any], n: int, threads: int = 4, **settings: Any
) -> tuple[list[list[int]], list[Any]]:
    """``n`` blocking calls from ``threads`` threads, ``fault`` run once they are under way:
    the prompts and the answers (or errors)."""
    prompts = [[i % 256, 9, i // 256] for i in range(n)]
    lm = RemoteLM.from_name(MODEL, settings=Settings(redis_url=url, **settings))

    def one(p: list[int]) -> Any:
        try:
            return lm.next_token_logprobs_sync(p)
        except Exception as e:  # the test reports it
            return e

    try:
        with ThreadPoolExecutor(threads) as pool:
            futures = [pool.submit(one, p) for p in prompts]
            time.sleep(0.5)
            assert sum(f.done() for f in futures) < n, "the fault must come mid-load"
            fault()
            results = [f.result() for f in futures]
    finally:
        lm.cleanup()
    return prompts, results


@pytest.mark.asyncio
async def test_a_master_without_replica_killed_and_restarted_mid_load(
    bare_cluster: RedisCluster, workers: Callable[..., Any]
) -> None:
    """The cluster refuses everything while the master is down; once it is back (empty, from
    its AOF, or from an older snapshot), every request is answered with the right row within
    its timeout, and the workers carry on and serve at once."""
    bare_cluster.flushall()
    fault = kill_and_restart(bare_cluster)
    url = other_url(bare_cluster, bare_cluster.master_of(KEYS.stats(MODEL, 0)))
    ws = [
        workers(url, backend="mock", mock_vocab_size=V, mock_delay_ms=50, claim_after_s=3)
        for _ in range(2)
    ]
    prompts = [[i % 256, 3, i // 256] for i in range(400)]
    settings = Settings(redis_url=url, timeout_s=60, resend_s=3)
    async with await RemoteLM.connect(model=MODEL, settings=settings) as lm:
        gate = asyncio.Semaphore(32)

        async def one(p: list[int]) -> Any:
            async with gate:
                return await lm.next_token_logprobs(p)

        tasks = [asyncio.create_task(one(p)) for p in prompts]
        await asyncio.sleep(0.5)
        assert sum(t.done() for t in tasks) < len(tasks), "the fault must come mid-load"
        started = time.monotonic()
        await asyncio.to_thread(fault)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        took = time.monotonic() - started
        bad = right(prompts, results)
        assert not bad, f"{len(bad)} not right: {bad[0]!r}"
        assert took < 30, took
        after = [[i % 256, 4, 1] for i in range(64)]
        started = time.monotonic()
        got = await lm.batch_next_token_logprobs(after)
        assert time.monotonic() - started < 5, "the workers must serve at once"
        assert not right(after, list(got))
    logs = "".join(w.log(10**7) for w in ws)
    assert all(w.proc is not None and w.proc.poll() is None for w in ws), logs[-3000:]
    deadline = time.monotonic() + 30
    while pending(url) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert pending(url) == 0


def test_blocking_calls_ride_over_a_master_without_replica_restarted(
    bare_cluster: RedisCluster, workers: Callable[..., Any]
) -> None:
    bare_cluster.flushall()
    fault = kill_and_restart(bare_cluster)
    url = other_url(bare_cluster, bare_cluster.master_of(KEYS.stats(MODEL, 0)))
    workers(url, backend="mock", mock_vocab_size=V, mock_delay_ms=20)
    prompts, results = blocking_under_load(url, fault, 200, timeout_s=60, resend_s=3)
    bad = right(prompts, results)
    assert not bad, f"{len(bad)} not right: {bad[0]!r}"


def test_blocking_calls_ride_over_a_failover(
    redis_cluster: RedisCluster, cluster_url: str, workers: Callable[..., Any]
) -> None:
    victim = redis_cluster.master_of(KEYS.stats(MODEL, 0))
    url = other_url(redis_cluster, victim)
    workers(url, backend="mock", mock_vocab_size=V, mock_delay_ms=20)

    def fault() -> None:
        redis_cluster.kill(victim)
        redis_cluster.wait_failover(victim)

    prompts, results = blocking_under_load(url, fault, 200, timeout_s=60, resend_s=3)
    bad = right(prompts, results)
    assert not bad, f"{len(bad)} not right: {bad[0]!r}"


def test_blocking_calls_ride_over_a_slot_moving(
    redis_cluster: RedisCluster, cluster_url: str, workers: Callable[..., Any]
) -> None:
    workers(cluster_url, backend="mock", mock_vocab_size=V, mock_delay_ms=20)
    prompts, results = blocking_under_load(
        cluster_url,
        lambda: move_slot(redis_cluster, KEYS.stats(MODEL, 0)),
        400,
        timeout_s=60,
        resend_s=3,
    )
    bad = right(prompts, results)
    assert not bad, f"{len(bad)} not right: {bad[0]!r}"


def test_status_names_the_node_that_is_down(
    bare_cluster: RedisCluster, workers: Callable[..., Any]
) -> None:
    """A master down (no replica to take over): the whole cluster refuses commands. The status
    command says so in one line naming the node and its slots, without waiting long."""
    if getattr(bare_cluster, "persistence", "") != "none":
        pytest.skip("the same with every persistence")
    bare_cluster.flushall()
    victim = bare_cluster.master_of(KEYS.stats(MODEL, 0))
    url = other_url(bare_cluster, victim)
    workers(url, backend="mock", mock_vocab_size=V)
    bare_cluster.kill(victim)
    try:
        for wait_s in (0.0, 2.5):  # before and after the others mark it failed
            time.sleep(wait_s)
            out, err = io.StringIO(), io.StringIO()
            started = time.monotonic()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = status.main(["--redis-url", url])
            took = time.monotonic() - started
            said = err.getvalue().strip()
            assert rc == 1, out.getvalue()
            assert len(said.splitlines()) == 1, said
            assert f"127.0.0.1:{victim.port}" in said and "slots" in said, said
            assert took < 8, (took, said)
    finally:
        bare_cluster.restart(victim)


def test_status_while_a_slot_moves(
    redis_cluster: RedisCluster, cluster_url: str, workers: Callable[..., Any]
) -> None:
    """Shard 0's slot half moved (MIGRATING/IMPORTING, keys on both nodes): the status command
    follows the redirections and shows the pool."""
    workers(cluster_url, backend="mock", mock_vocab_size=V)
    with RemoteLM.from_name(MODEL, settings=Settings(redis_url=cluster_url)) as lm:
        lm.batch_next_token_logprobs_sync([[i, 1] for i in range(150)])  # keys to move
    with ThreadPoolExecutor(1) as pool:
        moving = pool.submit(move_slot, redis_cluster, KEYS.stats(MODEL, 0), 5, 0.2)
        runs = []
        while not moving.done():
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                runs.append(
                    (status.main(["--redis-url", cluster_url]), out.getvalue(), err.getvalue())
                )
        moving.result()
    assert len(runs) >= 2, runs
    assert all(rc == 0 and f"model {MODEL}" in o for rc, o, _ in runs), runs
