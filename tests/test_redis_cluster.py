"""The Redis Cluster launcher (``localpool.redis_cluster.RedisCluster``) with plain redis-py.

What a cluster client needs to ride over a failover (redis-py 5.3.1, measured here with
3 masters x 1 replica, ``cluster-node-timeout 1000``: a master SIGKILLed, its replica promoted
and ``cluster_state:ok`` on every node 2.0-2.8 s later)::

    import socket
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError, TimeoutError
    from redis.retry import Retry                    # redis.asyncio.retry.Retry for asyncio

    RETRY_ERRORS = (ConnectionError, TimeoutError, socket.timeout, OSError)
    client = redis.cluster.RedisCluster.from_url(    # or redis.asyncio.cluster.RedisCluster
        url,
        cluster_error_retry_attempts=30,
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 5, supported_errors=RETRY_ERRORS),
    )

- With redis-py's defaults a command on the dead master's slots fails at once with
  ``ConnectionError: Error 111 connecting ... Connection refused`` (every call, sync and
  asyncio, until the replica took over). The reason: on a connection error the cluster client
  re-reads the topology and retries ``cluster_error_retry_attempts`` times *without any pause*,
  and the per-node ``Retry`` object never retries a refused connect, because ``connect()`` sees a
  builtin ``ConnectionRefusedError`` (an ``OSError``), not one of its default
  ``supported_errors``. Hence ``OSError`` in ``supported_errors``: each attempt then backs off
  0.02 + 0.04 + 0.08 + 0.1 + 0.1 = 0.34 s on the dead node before the topology is re-read,
  and 30 attempts cover about 10 s of failover.
- Measured with those settings (``test_*_client_rides_over_failover``, 6 runs each of sync
  and asyncio, one of them beside two CPU hogs on this 2-core machine): 0 errors reached the
  caller; the longest single call on the dead master's slots took 2.1-2.9 s (the failover
  itself plus at most one back-off round of 0.34 s); calls on the other masters' slots stalled
  0.8-1.3 s (every node answers ``CLUSTERDOWN`` between the moment the master is marked FAIL
  and the promotion; the client sleeps 0.25 s and re-reads the topology per such answer).
- ``TimeoutError`` in ``supported_errors`` also retries connect time-outs (a dead host on a
  real network, not loopback): keep ``socket_connect_timeout`` short there.
- Writes the old master acknowledged but had not yet replicated are lost at a failover (Redis
  replicates asynchronously): ``WAIT 1 100`` after a write makes it survive
  (``test_acknowledged_writes_survive_failover``). In a cluster client send it to the key's
  node: ``client.execute_command("WAIT", 1, 100, target_nodes=client.get_node_from_key(k))``
  (calls given ``target_nodes`` are not retried by redis-py).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
import redis
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.cluster
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    ConnectionError,
    RedisClusterException,
    ResponseError,
    TimeoutError,
)
from redis.retry import Retry

from localpool.redis_cluster import CLUSTER_BUS_OFFSET, ClusterMember, RedisCluster

RETRY_ERRORS = (ConnectionError, TimeoutError, socket.timeout, OSError)
FAILOVER_LIMIT_S = 10.0
SCRIPT = "redis.call('SET', KEYS[1], ARGV[1]); redis.call('SET', KEYS[2], ARGV[1]); return 2"


def riding_client(url: str) -> redis.cluster.RedisCluster:
    """A sync cluster client with the settings that ride over a failover (module doc)."""
    return redis.cluster.RedisCluster.from_url(
        url,
        cluster_error_retry_attempts=30,
        retry=Retry(
            ExponentialBackoff(cap=0.1, base=0.01),
            5,
            supported_errors=RETRY_ERRORS,  # OSError: a refused connect is retried too
        ),
    )


def riding_async_client(url: str) -> redis.asyncio.cluster.RedisCluster:
    return redis.asyncio.cluster.RedisCluster.from_url(
        url,
        cluster_error_retry_attempts=30,
        retry=redis.asyncio.retry.Retry(
            ExponentialBackoff(cap=0.1, base=0.01),
            5,
            supported_errors=RETRY_ERRORS,  # type: ignore[arg-type]  # stubs say RedisError
        ),
    )


def tag_on(cluster: RedisCluster, node: ClusterMember, avoid: bool = False) -> str:
    """A hash tag ``{tN}`` whose slot ``node`` serves (or, with ``avoid``, does not)."""
    for i in range(10_000):
        tag = f"{{t{i}}}"
        if (cluster.master_of(tag).port == node.port) != avoid:
            return tag
    raise AssertionError(f"no hash tag found for node {node.port}")


# -- the session cluster (the one the pool tests share) -------------------------------------


def test_layout_ports_and_roles(redis_cluster: RedisCluster, cluster_url: str) -> None:
    cluster = redis_cluster
    assert cluster.startup_s is not None and cluster.startup_s < 10.0
    assert len(cluster.nodes) == 6 and len(cluster.masters) == 3 and len(cluster.replicas) == 3
    for master in cluster.masters:
        assert len(cluster.replicas_of(master)) == 1
    ports = [n.port for n in cluster.nodes]
    assert len(set(ports) | {p + CLUSTER_BUS_OFFSET for p in ports}) == 12
    assert all(1024 < p < 55535 for p in ports)
    assert len({n.pid for n in cluster.nodes}) == 6 and all(n.alive for n in cluster.nodes)
    assert cluster_url == cluster.url == cluster.masters[0].url
    client = redis.cluster.RedisCluster.from_url(cluster_url)
    try:
        assert client.cluster_info()["cluster_state"] == "ok"
        assert {n.port for n in client.get_primaries()} == {n.port for n in cluster.masters}
        assert {n.port for n in client.get_replicas()} == {n.port for n in cluster.replicas}
    finally:
        client.close()


def test_keys_spread_over_all_masters(redis_cluster: RedisCluster, cluster_url: str) -> None:
    client = redis.cluster.RedisCluster.from_url(cluster_url)
    try:
        keys = [f"key:{i}" for i in range(300)]
        for k in keys:
            client.set(k, k)
        per_master = {m.port: m.dbsize() for m in redis_cluster.masters}
        assert sum(per_master.values()) == 300
        assert all(n > 50 for n in per_master.values()), per_master  # 100 each, give or take
        for k in keys[:30]:
            owner = redis_cluster.master_of(k)
            assert owner.port == client.get_node_from_key(k).port
            assert owner.admin().get(k) == k
        for master in redis_cluster.masters:  # replicas follow
            master.admin().execute_command("WAIT", 1, 1000)
            (replica,) = redis_cluster.replicas_of(master)
            assert replica.dbsize() == per_master[master.port]
    finally:
        client.close()


def test_scripts_run_in_one_slot_only(redis_cluster: RedisCluster, cluster_url: str) -> None:
    client = redis.cluster.RedisCluster.from_url(cluster_url, decode_responses=True)
    try:
        assert client.eval(SCRIPT, 2, "{job}:a", "{job}:b", "v") == 2
        assert client.mget("{job}:a", "{job}:b") == ["v", "v"]
        a, b = "a", "b"  # slots 15495 and 3300: different masters
        assert redis_cluster.master_of(a).port != redis_cluster.master_of(b).port
        with pytest.raises(RedisClusterException, match="same key slot"):  # refused client-side
            client.eval(SCRIPT, 2, a, b, "v")
        node = redis_cluster.master_of(a).admin()
        with pytest.raises(ResponseError, match="CROSSSLOT"):  # and by the server
            node.eval(SCRIPT, 2, a, b, "v")
        with pytest.raises(ResponseError, match="MOVED"):  # keys of another master's slot
            node.eval(SCRIPT, 2, b, "{b}:x", "v")
    finally:
        client.close()


@pytest.mark.asyncio
async def test_async_cluster_client(redis_cluster: RedisCluster, cluster_url: str) -> None:
    client = redis.asyncio.cluster.RedisCluster.from_url(cluster_url, decode_responses=True)
    try:
        assert await client.eval(SCRIPT, 2, "{x}:1", "{x}:2", "w") == 2
        await asyncio.gather(*(client.set(f"k{i}", i) for i in range(60)))
        assert await client.mget_nonatomic([f"k{i}" for i in range(60)]) == [
            str(i) for i in range(60)
        ]
        assert all(m.dbsize() > 0 for m in redis_cluster.masters)
    finally:
        await client.aclose()


def test_any_redis_url_fixture(any_redis_url: str, request: pytest.FixtureRequest) -> None:
    client = redis.Redis.from_url(any_redis_url, decode_responses=True)
    try:
        info = cast("dict[str, Any]", client.info("cluster"))
        assert info["cluster_enabled"] == (1 if "cluster]" in request.node.name else 0)
        assert client.dbsize() == 0  # flushed for the test
    finally:
        client.close()


# -- a private cluster for the tests that kill nodes -----------------------------------------


@pytest.fixture(scope="module")
def own_cluster() -> Iterator[RedisCluster]:
    with RedisCluster(masters=3, replicas=1) as cluster:
        yield cluster


@pytest.fixture
def cluster(own_cluster: RedisCluster) -> RedisCluster:
    """The module's private cluster, whole again and flushed."""
    if not all(n.alive for n in own_cluster.nodes):
        own_cluster.heal()
    own_cluster.flushall()
    return own_cluster


def test_acknowledged_writes_survive_failover(cluster: RedisCluster) -> None:
    victim = cluster.masters[1]
    (heir,) = cluster.replicas_of(victim)
    tag, other_tag = tag_on(cluster, victim), tag_on(cluster, victim, avoid=True)
    client = redis.cluster.RedisCluster.from_url(cluster.url, decode_responses=True)
    keys = [f"{tag}:{i}" for i in range(100)] + [f"{other_tag}:{i}" for i in range(20)]
    try:
        for k in keys:
            client.set(k, k)
            acked = client.execute_command("WAIT", 1, 100, target_nodes=client.get_node_from_key(k))
            assert acked == 1, k
    finally:
        client.close()

    t0 = time.monotonic()
    cluster.kill(victim)
    promoted = cluster.wait_failover(victim, timeout_s=FAILOVER_LIMIT_S)
    failover_s = time.monotonic() - t0
    print(f"failover (kill -> replica promoted, cluster_state:ok everywhere): {failover_s:.2f} s")
    assert promoted is heir and heir.role == "master"
    assert failover_s < FAILOVER_LIMIT_S
    assert victim.port not in {n.port for n in cluster.masters}
    assert cluster.master_of(tag) is heir

    client = redis.cluster.RedisCluster.from_url(cluster.url, decode_responses=True)
    try:
        assert client.mget_nonatomic(keys) == keys  # not one acknowledged key lost
        assert client.set(f"{tag}:after", "x")  # and the promoted master takes writes
    finally:
        client.close()

    t0 = time.monotonic()
    cluster.restart(victim)
    print(
        f"restart of the old master until it is an in-sync replica: {time.monotonic() - t0:.2f} s"
    )
    assert victim.alive and victim.role == "replica" and victim.master_id == heir.node_id
    assert cluster.replicas_of(heir) == [victim]
    repl = victim.info("replication")
    assert repl["role"] == "slave" and repl["master_link_status"] == "up"
    assert repl["master_port"] == heir.port
    heir.admin().execute_command("WAIT", 1, 1000)
    assert victim.dbsize() == heir.dbsize() == 101
    assert victim.admin().execute_command("READONLY")  # reads from the replica itself
    assert victim.admin().get(f"{tag}:after") == "x"


def test_killed_replica_rejoins_and_catches_up(cluster: RedisCluster) -> None:
    master = cluster.masters[0]
    (replica,) = cluster.replicas_of(master)
    tag = tag_on(cluster, master)
    cluster.kill(replica)
    assert not replica.alive and replica.pid is None
    client = redis.cluster.RedisCluster.from_url(cluster.url, decode_responses=True)
    try:
        for i in range(50):  # written while the replica is down
            client.set(f"{tag}:{i}", i)
    finally:
        client.close()
    cluster.restart(replica)
    assert replica.role == "replica" and replica.master_id == master.node_id
    assert master.role == "master" and cluster.master_of(tag) is master
    master.admin().execute_command("WAIT", 1, 1000)
    assert replica.dbsize() == 50


def _victim_and_tags(cluster: RedisCluster) -> tuple[ClusterMember, str, str]:
    victim = cluster.masters[-1]
    return victim, tag_on(cluster, victim), tag_on(cluster, victim, avoid=True)


def test_sync_client_rides_over_failover(cluster: RedisCluster) -> None:
    """Writers on the dead master's slots and on another master's, through the failover:
    no error reaches them, and their longest call is bounded."""
    victim, tag, other = _victim_and_tags(cluster)
    stop = threading.Event()
    stats: dict[str, dict[str, Any]] = {}

    def writer(prefix: str) -> None:
        client = riding_client(cluster.url)
        done, errors, worst = 0, [], 0.0
        try:
            while not stop.is_set():
                t = time.monotonic()
                try:
                    client.set(f"{prefix}:{done}", done)
                    done += 1
                except Exception as e:  # counted, and the test fails on any
                    errors.append(repr(e))
                worst = max(worst, time.monotonic() - t)
                time.sleep(0.002)
        finally:
            client.close()
        stats[prefix] = {"writes": done, "errors": errors, "longest_call_s": round(worst, 2)}

    threads = [threading.Thread(target=writer, args=(p,)) for p in (tag, other)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    cluster.kill(victim)
    cluster.wait_failover(victim, timeout_s=FAILOVER_LIMIT_S)
    failover_s = time.monotonic() - t0
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    print(f"failover {failover_s:.2f} s; sync writers: {stats}")
    assert not any(t.is_alive() for t in threads)
    assert stats[tag]["errors"] == [] and stats[other]["errors"] == []
    assert stats[tag]["longest_call_s"] < FAILOVER_LIMIT_S
    assert stats[tag]["longest_call_s"] >= 0.5  # it did wait for the failover
    # writes after the promotion went to the new master
    assert stats[tag]["writes"] > 0 and stats[other]["writes"] > 0
    promoted = cluster.master_of(tag)
    assert promoted is not victim and promoted.admin().exists(f"{tag}:{stats[tag]['writes'] - 1}")


@pytest.mark.asyncio
async def test_async_client_rides_over_failover(cluster: RedisCluster) -> None:
    victim, tag, _ = _victim_and_tags(cluster)
    client = riding_async_client(cluster.url)
    await client.initialize()
    done, errors, worst = 0, [], 0.0

    async def writer(stop_at: float) -> None:
        nonlocal done, worst
        while time.monotonic() < stop_at:
            t = time.monotonic()
            try:
                await client.set(f"{tag}:{done}", done)
                done += 1
            except Exception as e:
                errors.append(repr(e))
            worst = max(worst, time.monotonic() - t)
            await asyncio.sleep(0.002)

    try:
        task = asyncio.create_task(writer(float("inf")))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        cluster.kill(victim)
        await asyncio.to_thread(cluster.wait_failover, victim, FAILOVER_LIMIT_S)
        failover_s = time.monotonic() - t0
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await client.aclose()
    print(
        f"failover {failover_s:.2f} s; asyncio writer: {done} writes, errors {errors}, "
        f"longest call {worst:.2f} s"
    )
    assert errors == []
    assert 0.5 <= worst < FAILOVER_LIMIT_S
    assert cluster.master_of(tag) is not victim


def test_default_client_does_not_ride_over_failover(cluster: RedisCluster) -> None:
    """Why the settings above: redis-py's defaults give up on the dead master at once."""
    victim, tag, _ = _victim_and_tags(cluster)
    client = redis.cluster.RedisCluster.from_url(cluster.url)
    try:
        client.set(f"{tag}:0", 0)
        cluster.kill(victim)
        t0 = time.monotonic()
        with pytest.raises(ConnectionError):
            client.set(f"{tag}:1", 1)
        assert time.monotonic() - t0 < 1.0
        cluster.wait_failover(victim, timeout_s=FAILOVER_LIMIT_S)
        assert client.set(f"{tag}:2", 2)  # once promoted, the next call finds the new master
    finally:
        client.close()


def test_whole_cluster_restarts_from_its_aof() -> None:
    """``stop()`` then ``heal()``: the same cluster (nodes.conf) with its data (AOF)."""
    with RedisCluster(masters=3, replicas=1, appendonly=True) as cluster:
        assert all(
            n.admin().config_get("appendonly") == {"appendonly": "yes"} for n in cluster.nodes
        )
        keys = [f"aof:{i}" for i in range(100)]
        client = redis.cluster.RedisCluster.from_url(cluster.url, decode_responses=True)
        try:
            for k in keys:
                client.set(k, k)
        finally:
            client.close()
        roles = {n.port: (n.role, n.master_id) for n in cluster.nodes}
        cluster.stop()
        assert not any(n.alive for n in cluster.nodes)
        t0 = time.monotonic()
        cluster.heal()
        print(f"whole cluster restarted from its AOFs in {time.monotonic() - t0:.2f} s")
        assert {n.port: (n.role, n.master_id) for n in cluster.nodes} == roles
        client = redis.cluster.RedisCluster.from_url(cluster.url, decode_responses=True)
        try:
            assert client.mget_nonatomic(keys) == keys
        finally:
            client.close()


@pytest.mark.asyncio
async def test_a_pipeline_while_the_cluster_client_rereads_its_topology_is_transient(
    cluster_url: str,
) -> None:
    """After connection errors (a failover) one pipeline's retry closes the cluster client's
    node manager, whose default node is None until the topology is read again; another
    pipeline of the same client then in flight met an AttributeError inside redis-py once all
    its commands had answered (it reads the default node to decide whether to replace it).
    Its answers are returned (before: an AttributeError that failed a producer's submission
    outright in ``tests/test_cluster_pool.py``, then a transient error that threw away what the
    commands had done, a FINISH's waiter sets), and a later run succeeds."""
    from shared.redis_conn import connect_redis
    from shared.scripts import execute

    client = cast(Any, connect_redis(cluster_url))
    try:

        def build(pipe: Any) -> None:
            pipe.set("{t}:a", "x")
            pipe.incr("{t}:a")  # an error reply: redis-py then looks at the default node

        def run() -> Any:
            return execute(client, build, [], raise_on_error=False)

        first = await run()
        assert first[0] is True and isinstance(first[1], ResponseError)
        default = client.get_default_node()
        running = asyncio.create_task(run())
        await asyncio.sleep(0)  # the pipeline is out, waiting for its replies
        client.nodes_manager.default_node = None  # as the other pipeline's retry leaves it
        answered = await running
        assert answered[0] is True and isinstance(answered[1], ResponseError)
        client.nodes_manager.default_node = default
        again = await run()
        assert again[0] is True and isinstance(again[1], ResponseError)
    finally:
        await client.aclose()
