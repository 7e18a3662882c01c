"""The worker's writer against a Redis that refuses for a while: a restart still loading its data
is waited out (nothing lost), and a write refused for good lets its entries go instead of
holding them forever."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from redis.asyncio import Redis

from localpool.redis_server import find_server_binary, free_port
from shared.errors import WorkerError
from shared.keys import GROUP, Keys
from shared.resp import Loading, error_reply
from shared.settings import Settings
from worker.stream.batcher import Job
from worker.stream.reader import Entry
from worker.stream.writer import Writer

MODEL = "m"
DIGEST = "a" * 40
pytestmark = pytest.mark.timeout(60)


def answered_job(stream: str, entry_id: str) -> Job:
    job = Job(DIGEST, 0, [Entry(stream, entry_id, b"x", DIGEST, 0, False)])
    job.fail(WorkerError("the model failed"))  # an answer without a row: FINISH and XACK
    return job


def test_error_replies_keep_redis_py_classes_for_passing_states() -> None:
    loading = error_reply("LOADING Redis is loading the dataset in memory")
    assert isinstance(loading, Loading) and isinstance(loading, redis.ResponseError)
    assert isinstance(loading, redis.ConnectionError)  # transient: retried where raised
    assert str(loading).startswith("LOADING")
    assert isinstance(error_reply("READONLY You can't write"), redis.exceptions.ReadOnlyError)
    other = error_reply("NOSCRIPT No matching script")
    assert type(other) is redis.ResponseError and str(other).startswith("NOSCRIPT")


@pytest.mark.asyncio
async def test_a_write_during_a_restarts_loading_waits_for_it_and_loses_nothing(
    tmp_path: Path,
) -> None:
    """Redis restarted from its dump answers LOADING for ~3 s (a key-load delay): the answer
    written meanwhile goes through once it has loaded; before, the writer's task died on the
    first LOADING reply and the entry stayed pending, held (renewed) by a live worker, for good."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"

    def server(*extra: str) -> subprocess.Popen[bytes]:
        args = ["--port", str(port), "--dir", str(tmp_path), "--save", "", "--appendonly", "no"]
        return subprocess.Popen([find_server_binary(), *args, *extra], stdout=subprocess.DEVNULL)

    def wait_up() -> None:
        for _ in range(100):
            try:
                redis.Redis.from_url(url).ping()
                return
            except redis.exceptions.BusyLoadingError:
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("the server did not start")

    stream = Keys().stream(MODEL, "high", 0, "")
    proc = server()
    try:
        wait_up()
        r = redis.Redis.from_url(url)
        r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        entry_id = cast(bytes, r.xadd(stream, {"m": b"x", "d": DIGEST})).decode()
        r.xreadgroup(GROUP, "w1", {stream: ">"})  # pending on w1, as a worker read it
        r.mset({f"filler:{i}": "x" for i in range(3000)})
        r.save()
        r.close()
    finally:
        proc.terminate()
        proc.wait()
    proc = server("--key-load-delay", "1000", "--loading-process-events-interval-bytes", "1024")
    try:
        wait_up()
        r = redis.Redis.from_url(url)
        with pytest.raises(redis.exceptions.BusyLoadingError):
            r.ping()  # still loading when the write starts
        settings = Settings.from_env({"LMPOOL_REDIS_URL": url, "LMPOOL_MODEL_NAME": MODEL})
        written: list[int] = []
        client = Redis.from_url(url)
        writer = Writer(client, settings, "w1", on_written=lambda jobs: written.append(len(jobs)))
        assert writer.conn is not None  # the write goes on shared.resp's connection
        writer.add([answered_job(stream, entry_id)])
        await asyncio.wait_for(writer.drain(), 30)
        assert written == [1] and writer.queued() == []
        assert cast(dict[str, Any], r.xpending(stream, GROUP))["pending"] == 0
        await writer.aclose()
        await client.aclose()
        r.close()
    finally:
        proc.terminate()
        proc.wait()


@pytest.mark.asyncio
async def test_a_refused_write_lets_its_entries_go(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A write Redis refuses (not a passing state: here NOPERM) is logged with what it held, and
    its entries are no longer held by the worker (so no longer renewed: its producers queue
    them again, or other workers take them over); the writer goes on with later answers."""
    settings = Settings.from_env({"LMPOOL_REDIS_URL": redis_url, "LMPOOL_MODEL_NAME": MODEL})
    client = Redis.from_url(redis_url)
    written: list[int] = []
    writer = Writer(client, settings, "w1", on_written=lambda jobs: written.append(len(jobs)))
    real_write = writer.write
    refusals = [redis.exceptions.NoPermissionError("NOPERM no permissions")]

    async def write(jobs: list[Job], taken: dict[int, set[Any]] | None = None) -> None:
        if refusals:
            raise refusals.pop()
        await real_write(jobs, taken)

    writer.write = write  # type: ignore[method-assign]
    stream = Keys().stream(MODEL, "high", 0, "")
    writer.add([answered_job(stream, "1-0")])
    await writer.drain()
    assert writer.queued() == [] and written == []
    assert "writing 1 answers (1 entries) failed; left pending" in caplog.text
    writer.add([answered_job(stream, "2-0")])
    await writer.drain()
    assert written == [1]
    await writer.aclose()
    await client.aclose()
