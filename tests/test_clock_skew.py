"""Hosts whose clocks are not the Redis server's: a worker's heartbeats, the queue wait it
measures, and who counts as live are all on the server's clock, whichever host looks."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from poolkit import WorkerProcess, mock_row

from localpool.launch import SOURCE_ROOT
from localpool.redis_server import free_port
from producer import RemoteLM

V = 300
MODEL = f"mock-{V}"
SKEWED = Path(__file__).resolve().parent / "skewed_clock"
pytestmark = pytest.mark.timeout(120)


def skewed(shift_s: float) -> dict[str, str]:
    """Environment of a process whose clock runs ``shift_s`` off."""
    return {"PYTHONPATH": f"{SKEWED}:{SOURCE_ROOT}", "TEST_CLOCK_SHIFT_S": str(shift_s)}


@pytest.mark.asyncio
@pytest.mark.parametrize("shift_s", [-10.0, 10.0])
async def test_a_worker_whose_clock_is_off_is_live_for_everyone(
    redis_url: str, tmp_path: Path, shift_s: float
) -> None:
    """10 s behind (3 heartbeats are 6 s): no live worker for ``lmpool-status`` or a
    producer's connect (NoWorker) before, though it served. 10 s ahead, its queue-wait
    metric said every request had waited 10 s."""
    port = free_port()
    w = WorkerProcess(
        redis_url, tmp_path, backend="mock", mock_vocab_size=V, metrics_port=port,
        extra_env=skewed(shift_s),
    )  # fmt: skip
    w.start().wait_ready()
    try:
        async with await RemoteLM.connect(redis_url, model=MODEL, connect_timeout_s=5) as lm:
            rows = await lm.batch_next_token_logprobs([[i, 9] for i in range(20)])
        assert all(torch.equal(r, mock_row(V, [i, 9])) for i, r in enumerate(rows))
        await asyncio.sleep(0.5)
        status = subprocess.run(
            [sys.executable, "-m", "worker.status", "--redis-url", redis_url, "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert len(json.loads(status.stdout)["models"][MODEL]["workers"]) == 1
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        metrics = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in body.decode().splitlines()
            if line.startswith("lmpool_queue_wait_seconds_")
        }
        labels = f'{{backend="mock",model="{MODEL}"}}'
        waited = metrics[f"lmpool_queue_wait_seconds_sum{labels}"]
        count = metrics[f"lmpool_queue_wait_seconds_count{labels}"]
        assert count == 20 and waited / count < 1.0, (waited, count)
    finally:
        w.stop()


@pytest.mark.asyncio
async def test_a_producer_whose_clock_is_off_finds_the_live_worker(
    redis_url: str, tmp_path: Path
) -> None:
    """The producer's side of the same: a blocking connect and a status from a host 10 s
    ahead of the server see the worker that serves (they saw none before)."""
    w = WorkerProcess(redis_url, tmp_path, backend="mock", mock_vocab_size=V).start().wait_ready()
    try:
        code = (
            "from producer import RemoteLM; "
            f"lm = RemoteLM.from_name({MODEL!r}, redis_url={redis_url!r}, connect_timeout_s=5); "
            "print(lm.next_token_logprobs_sync([1, 2]).shape[0])"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env={**skewed(10.0), "PATH": "/usr/bin:/bin"},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0 and out.stdout.strip() == str(V), out.stderr[-500:]
        status = subprocess.run(
            [sys.executable, "-m", "worker.status", "--redis-url", redis_url, "--json"],
            env={**skewed(10.0), "PATH": "/usr/bin:/bin"},
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert len(json.loads(status.stdout)["models"][MODEL]["workers"]) == 1
    finally:
        w.stop()
