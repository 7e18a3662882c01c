"""Running the pool: the status command, the metrics endpoint and priorities, on a live pool."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any, cast

import pytest
import redis
from poolkit import not_redis

from localpool.redis_server import free_port
from producer import RemoteLM
from shared.keys import Keys
from worker.stream.consumer import Stats

V = 300
MODEL = f"mock-{V}"
pytestmark = pytest.mark.timeout(180)


def status(url: str, *args: str) -> str:
    env_free = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "worker.status", "--redis-url", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env_free,
        check=True,
    )
    return out.stdout


def test_status_without_redis_or_with_a_bad_setting_says_so_in_one_line() -> None:
    """An operator's first mistakes: Redis not reachable (exit 1), an unknown variable (exit
    2); one line on stderr naming it, no traceback."""
    url = f"redis://:pw@127.0.0.1:{free_port()}/0"
    cases = [
        ({}, ["--redis-url", url], 1, f"redis://:***@127.0.0.1:{url.rsplit(':', 1)[1]}"),
        ({"LMPOOL_MAX_BATCH_SIZE": "8"}, [], 2, "did you mean LMPOOL_MAX_BATCH?"),
    ]
    for env, args, code, says in cases:
        out = subprocess.run(
            [sys.executable, "-m", "worker.status", *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin", **env},
        )
        assert out.returncode == code, out.stderr
        assert out.stdout == "" and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith("lmpool-status: ") and says in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and ":pw@" not in out.stderr


def test_status_of_an_empty_pool_names_where_it_looked(redis_url: str) -> None:
    """``lmpool-status`` in a new shell (no ``LMPOOL_REDIS_URL``), on another database or under
    another key prefix finds no model: it says which Redis and prefix it looked at (it said
    "on this Redis"), so the operator sees the setting to fix."""
    other_db = redis_url.rsplit("/", 1)[0] + "/5"
    text = status(other_db, "--prefix", "lab")
    assert f"no model has registered a worker on {other_db} under key prefix 'lab'" in text


def test_status_watched_through_a_pipe_that_closes_ends_quietly(redis_url: str) -> None:
    """``lmpool-status --watch 1 | head -1``: the closed pipe ends it with exit 0 and nothing on
    stderr (it is not Redis' fault); a negative interval is refused."""
    cmd = [sys.executable, "-m", "worker.status", "--redis-url", redis_url]
    proc = subprocess.Popen(
        [*cmd, "--watch", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline()  # the first refresh
    proc.stdout.close()
    assert proc.wait(timeout=30) == 0
    assert proc.stderr.read() == b""
    bad = subprocess.run([*cmd, "--watch", "-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--watch -1" in bad.stderr, bad.stderr


@pytest.mark.asyncio
async def test_status_and_metrics_on_a_live_pool(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    port = free_port()
    w = workers(redis_url, backend="mock", mock_vocab_size=V, metrics_port=port)
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        await lm.batch_next_token_logprobs([[i, 1] for i in range(20)])
        lm.clear_cache()
        await lm.batch_next_token_logprobs([[i, 1] for i in range(10)])  # shared-cache hits
    r = redis.Redis.from_url(redis_url)
    r.xadd(Keys().stream(MODEL, "low"), {"m": b"junk"})  # one dead letter
    r.close()
    await w.wait_counter("dead_letters", 1)
    await w.wait_counter("requests", 21)

    data = json.loads(status(redis_url, "--json"))
    model = data["models"][MODEL]
    assert len(model["workers"]) == 1
    worker = model["workers"][0]
    assert worker["backend"] == "mock" and worker["device"] == "cpu" and worker["max_batch"] == 16
    assert worker["rows"] == 20
    assert len(model["streams"]) == 8  # four shards, each with an interactive and offline stream
    assert all(s == {"length": 0, "pending": 0} for s in model["streams"].values())
    assert worker["shards"] == [0, 1, 2, 3]  # the only worker owns every shard
    assert model["dead_letters"] == 1
    assert model["producer_counters"]["cache_hits"] == 10
    assert model["shared_cache_hit_rate"] == pytest.approx(10 / 30)
    text = status(redis_url)
    assert f"model {MODEL}" in text and "1 live worker(s)" in text and "33.3%" in text

    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    metrics = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in body.splitlines()
        if line and not line.startswith("#")
    }
    labels = f'backend="mock",model="{MODEL}"'
    assert metrics[f"lmpool_batch_size_count{{{labels}}}"] >= 2
    assert metrics[f'lmpool_requests_total{{{labels},outcome="computed"}}'] == 20
    assert metrics[f'lmpool_requests_total{{{labels},outcome="dead_letter"}}'] == 1
    assert metrics[f"lmpool_queue_wait_seconds_count{{{labels}}}"] >= 20


@pytest.mark.asyncio
async def test_failed_requests_are_not_counted_as_computed(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """The heartbeat's ``computed`` (the status command's) agrees with the metrics and the
    tenant counters: a request the model failed on is an error, not computed (it was both)."""
    port = free_port()
    w = workers(redis_url, backend="mock", mock_vocab_size=V, metrics_port=port, mock_fail_on="99")
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        asks = [lm.next_token_logprobs([i, 1]) for i in range(6)]
        asks += [lm.next_token_logprobs([99, i]) for i in range(3)]
        await asyncio.gather(*asks, return_exceptions=True)
    await w.wait_counter("requests", 9)
    worker = json.loads(status(redis_url, "--json"))["models"][MODEL]["workers"][0]
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    labels = f'backend="mock",model="{MODEL}"'
    computed = f'lmpool_requests_total{{{labels},outcome="computed"}} 6.0'
    assert worker["computed"] == 6 and computed in body
    assert worker["tenants"]["-"]["computed"] == 6 and worker["errors"] == 3


def test_a_workers_rate_is_over_the_last_minute_and_falls_to_zero_when_idle() -> None:
    """The rate in a worker's heartbeat (``requests_per_s``, the status command's req/s):
    requests of the last 60 s over 60 s, or over its time up when shorter (at least 1 s); a
    worker idle for a minute reports 0 (before: the last burst's count over the time since it,
    never 0, and over less than a minute for a worker up for hours)."""
    stats = Stats(started=1000.0)
    stats.recent = [(1001.0, 100)]
    assert stats.per_second(now=1000.5) == 100.0  # at least a second
    assert stats.per_second(now=1002.0) == 50.0
    assert stats.per_second(now=1050.0) == 2.0
    assert stats.per_second(now=1062.0) == 0.0 and not stats.recent
    stats.recent = [(5000.0, 30), (5030.0, 30)]
    assert stats.per_second(now=5040.0) == 1.0  # up for an hour: 60 requests over 60 s


@pytest.mark.asyncio
async def test_status_sums_the_queues_by_priority_and_names_the_streams_that_hold_any(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """Twenty offline requests behind a worker that takes one a second: one line says how many
    are queued (read by no worker) and taken (read, unanswered) in each priority class, and
    names only the streams that hold any (not all eight)."""
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=1000, max_batch=1)
    async with await RemoteLM.connect(redis_url, model=MODEL, priority="low") as offline:
        batch = asyncio.gather(*(offline.next_token_logprobs([i, 3]) for i in range(20)))
        await asyncio.sleep(0.5)  # queued, the first one in the step
        line = next(x for x in status(redis_url).splitlines() if "live worker(s)" in x)
        batch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await batch
    found = re.search(r"high: 0 queued \+ 0 taken, low: (\d+) queued \+ (\d+) taken", line)
    assert found, line
    queued, taken = int(found[1]), int(found[2])
    assert 15 <= queued + taken <= 20 and taken >= 1, line
    named = re.findall(r"(\w+):(\d):?\w* (\d+)\+(\d+)", line.split("(by stream: ", 1)[1])
    assert named and all(p == "low" and int(q) + int(n) > 0 for p, _, q, n in named), line
    assert sum(int(q) for *_, q, _ in named) == queued, line
    assert sum(int(n) for *_, n in named) == taken, line


@pytest.mark.asyncio
async def test_a_model_no_worker_serves_shows_in_one_line_and_can_be_unlisted(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """A model whose workers stopped stays listed, in one line; ``--forget`` unlists it, and
    refuses (exit 1, one line) while a worker serves it or when no such model is listed."""
    cmd = [sys.executable, "-m", "worker.status", "--redis-url", redis_url]
    env = {"PATH": "/usr/bin:/bin"}
    w = workers(redis_url, backend="mock", mock_vocab_size=V)
    async with await RemoteLM.connect(redis_url, model=MODEL) as lm:
        await lm.next_token_logprobs([1, 2])
    busy = subprocess.run([*cmd, "--forget", MODEL], capture_output=True, text=True, env=env)
    assert busy.returncode == 1 and "1 live worker(s)" in busy.stderr, busy.stderr
    assert w.terminate() == 0
    assert f"model {MODEL}: no live worker, nothing queued" in status(redis_url)
    done = subprocess.run([*cmd, "--forget", MODEL], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and f"model {MODEL!r} unlisted" in done.stdout, done.stderr
    assert "no model has registered a worker" in status(redis_url)
    again = subprocess.run([*cmd, "--forget", MODEL], capture_output=True, text=True, env=env)
    assert again.returncode == 1 and again.stderr.count("\n") == 1, again.stderr
    assert f"no model {MODEL!r} is listed" in again.stderr


@pytest.mark.asyncio
async def test_offline_work_does_not_starve_interactive_requests(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=20, max_batch=4)
    keys = Keys()
    r = redis.Redis.from_url(redis_url)
    async with (
        await RemoteLM.connect(redis_url, model=MODEL, priority="low") as offline,
        await RemoteLM.connect(redis_url, model=MODEL) as interactive,
    ):
        batch = asyncio.gather(*(offline.next_token_logprobs([i, 2, 2]) for i in range(200)))

        def offline_queued() -> int:
            return sum(cast(int, r.xlen(s)) for s in keys.streams(MODEL, 4, "low"))

        while offline_queued() < 150:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        await interactive.next_token_logprobs([7, 7, 7])
        waited = time.monotonic() - started
        left = offline_queued()
        await batch
    r.close()
    assert left > 100, "the interactive request went ahead of the offline queue"
    assert waited < 1.0, waited


def test_status_with_a_wrong_url_says_so_in_one_line(redis_url: str) -> None:
    """A URL that is no Redis URL (exit 2), a database the server does not have, a port where
    no Redis answers but something else does (exit 1): one line naming the URL, never a
    traceback (they were tracebacks through redis-py)."""
    base = redis_url.rsplit("/", 1)[0]
    with not_redis() as port:
        cases = [
            ("http://127.0.0.1:6379/0", 2, "--redis-url"),
            (f"{base}/999", 1, "DB index is out of range"),
            (f"redis://127.0.0.1:{port}/0", 1, f"127.0.0.1:{port}"),
        ]
        for url, code, says in cases:
            out = subprocess.run(
                [sys.executable, "-m", "worker.status", "--redis-url", url],
                capture_output=True,
                text=True,
                timeout=60,
                env={"PATH": "/usr/bin:/bin"},
            )
            assert out.returncode == code, (url, out.stderr)
            assert out.stdout == "" and out.stderr.count("\n") == 1, (url, out.stderr)
            assert out.stderr.startswith("lmpool-status: ") and says in out.stderr, out.stderr
            assert "Traceback" not in out.stderr


@pytest.mark.asyncio
async def test_the_tenants_compute_seconds_add_up_to_the_workers_steps(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """Each step's time is shared by the rows it ran, generations' decode steps included: the
    tenants' ``compute_s`` add up to the worker's busy time, in the heartbeat and in the
    metrics (before, a decode step that finished no generation was nobody's: samples of 16
    tokens counted one step in 17)."""
    port = free_port()
    w = workers(redis_url, backend="mock", mock_vocab_size=V, mock_delay_ms=10, metrics_port=port)
    async with (
        await RemoteLM.connect(redis_url, model=MODEL, tenant="gen") as gen,
        await RemoteLM.connect(redis_url, model=MODEL, tenant="rows") as rows,
    ):
        await asyncio.gather(
            *(gen.sample([5, i], max_tokens=16, eos_token_ids=[], seed=i) for i in range(4)),
            rows.batch_next_token_logprobs([[i, 2] for i in range(8)]),
        )
    await w.wait_counter("requests", 12)
    await asyncio.sleep(0.5)  # a heartbeat after the last write
    info = w.info()
    compute = {t: c["compute_s"] for t, c in info["tenants"].items()}
    assert sum(compute.values()) == pytest.approx(info["busy_s"], rel=0.02, abs=0.005), info
    assert compute["gen"] > 10 * 0.010, compute  # 16 decode steps of 10 ms at least
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in body.splitlines()
        if line and not line.startswith("#")
    }
    labels = f'backend="mock",model="{MODEL}"'
    tenants = sum(
        v for k, v in values.items() if k.startswith("lmpool_tenant_compute_seconds_total")
    )
    assert tenants == pytest.approx(values[f"lmpool_batch_seconds_sum{{{labels}}}"], rel=0.02)
    assert not [k for k in values if k.startswith("lmpool_tenant_") and "_s_total" in k]


@pytest.mark.asyncio
async def test_the_workers_log_never_shows_the_redis_password(
    redis_server: Any, tmp_path: Any
) -> None:
    """The worker's start-up line names its Redis URL with the password masked, as every
    other line and message does (it printed the URL as given)."""
    from poolkit import WorkerProcess

    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    r.execute_command("ACL", "SETUSER", "lmw", "on", ">s3cret-pw", "~*", "&*", "+@all")
    r.close()
    url = redis_server.url_for("lmw", "s3cret-pw")
    w = WorkerProcess(url, tmp_path, backend="mock", mock_vocab_size=V).start()
    try:
        w.wait_ready()
        assert w.terminate() == 0
    finally:
        w.stop()
        r = redis.Redis.from_url(redis_server.url)
        r.execute_command("ACL", "DELUSER", "lmw")
        r.close()
    log = w.log(100_000)
    assert "serving" in log and "lmw:***@" in log, log
    assert "s3cret-pw" not in log, log
