"""Worker logs: JSON lines with request digests when asked for; a takeover when it happens."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import redis
import torch

from producer import RemoteLM
from shared.keys import GROUP, Keys
from shared.settings import Settings
from worker.backends.mock import MockBackend

pytestmark = pytest.mark.timeout(120)


@pytest.mark.asyncio
async def test_json_logs_carry_request_digests(redis_url: str, workers: Callable[..., Any]) -> None:
    w = workers(
        redis_url, backend="mock", mock_vocab_size=300, log_level="DEBUG", log_format="json"
    )
    async with await RemoteLM.connect(redis_url, model="mock-300") as lm:
        await lm.next_token_logprobs([1, 2, 3])
    await w.wait_counter("requests", 1)
    w.stop()
    records = [json.loads(line) for line in w.log().splitlines() if line.startswith("{")]
    batches = [r for r in records if r["message"].startswith("answered 1 entries")]
    assert batches, w.log()
    assert list(batches[0]["requests"].values()) == ["computed"]
    assert len(next(iter(batches[0]["requests"]))) == 40  # the full request digest
    assert {"time", "level", "logger", "pid", "worker"} <= set(batches[0])


def test_log_format_is_validated() -> None:
    with pytest.raises(ValueError, match="LOG_FORMAT"):
        Settings.from_env({"LMPOOL_LOG_FORMAT": "xml"})


def _pending(url: str, model: str) -> list[tuple[str, str, str]]:
    """(stream, entry id, consumer) of every entry pending in the model's streams."""
    keys, r = Keys(), redis.Redis.from_url(url, decode_responses=True)
    try:
        return [
            (stream, p["message_id"], p["consumer"])
            for stream in keys.streams(model, Settings().shards)
            if r.exists(stream)
            for p in cast(
                "list[dict[str, Any]]",
                r.xpending_range(stream, GROUP, min="-", max="+", count=100),
            )
        ]
    finally:
        r.close()


@pytest.mark.asyncio
async def test_a_takeover_is_logged_when_it_happens(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """kill -9 a worker with a request in hand: the survivor's log names the entry and its
    dead owner as soon as it takes them over, while it is still busy with other work, not
    only once it gets round to running the entry."""
    common = {"backend": "mock", "mock_vocab_size": 300, "claim_after_s": 0.5}
    victim = workers(redis_url, **common, mock_delay_ms=60_000)  # holds what it reads
    async with await RemoteLM.connect(redis_url, model="mock-300", timeout_s=120) as lm:
        held = asyncio.create_task(lm.next_token_logprobs([7, 7, 7]))
        deadline = time.monotonic() + 30
        while not (pending := _pending(redis_url, "mock-300")):
            assert time.monotonic() < deadline, "the victim never read the request"
            await asyncio.sleep(0.05)
        [(stream, entry_id, owner)] = pending
        victim.kill()
        prompts = [[i % 250, i // 250, 3] for i in range(400)]  # 25 batches of 0.1 s
        busy = [asyncio.create_task(lm.next_token_logprobs(p)) for p in prompts]
        survivor = workers(redis_url, **common, mock_delay_ms=100, wait=False)
        await asyncio.to_thread(survivor.wait_ready)
        while entry_id not in survivor.log(chars=1_000_000):
            assert time.monotonic() < deadline + 60, survivor.log()
            await asyncio.sleep(0.05)
        answered = sum(t.done() for t in busy)
        assert answered < len(busy) // 2, f"logged only after {answered} others were answered"
        line = next(x for x in survivor.log(chars=1_000_000).splitlines() if entry_id in x)
        assert "taking over 1 entry of " + owner + " on " + stream in line, line
        results = await asyncio.gather(held, *busy)
    for got, ids in zip(results, [[7, 7, 7], *prompts], strict=True):
        assert torch.equal(got, MockBackend(300).logprobs([ids], None)[0])


@pytest.mark.parametrize("backend", ["mock", "hf", "hf-first-start"])
def test_json_logs_are_json_from_start_to_stop(
    redis_url: str,
    workers: Callable[..., Any],
    backend: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
) -> None:
    """With LMPOOL_LOG_FORMAT=json every line the worker writes is one JSON object, arq's own
    start-up and shutdown lines too (they came as ``16:02:33: Starting worker ...`` text, which
    a log collector parsing JSON drops or garbles), and no progress bar comes between them
    (transformers' ``Loading weights: 100%|...`` did, as an hf worker loaded its model, and the
    bundled model's conversion at a machine's first start, ``Converting and de-quantizing GGUF
    tensors...``)."""
    if backend == "hf":
        model = str(request.getfixturevalue("tiny_llama"))
        w = workers(redis_url, model=model, backend="hf", log_format="json")
    elif backend == "hf-first-start":  # the default model, converted into an empty cache
        w = workers(redis_url, backend="hf", log_format="json", cache_dir=str(tmp_path / "c"))
    else:
        w = workers(redis_url, backend="mock", mock_vocab_size=300, log_format="json")
    assert w.terminate() == 0
    lines = [line for line in w.log(100_000).splitlines() if line.strip()]
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not JSON: {line!r}") from None
    messages = " | ".join(r["message"] for r in records)
    assert "Starting worker" in messages and "shutdown on SIGTERM" in messages, messages
    assert all(r["logger"] for r in records)


@pytest.mark.asyncio
async def test_requests_dropped_unrun_are_said_at_most_once_a_minute(
    redis_url: str, workers: Callable[..., Any]
) -> None:
    """Requests whose askers gave up before the worker reached them are answered ``Expired``
    and not computed: the operator is told (the log said nothing, and the pool looked idle to
    a producer timing out), in one warning for all of them, not one a request."""
    w = workers(redis_url, backend="mock", mock_vocab_size=300, mock_delay_ms=600, max_batch=1)

    def said() -> list[str]:
        return [x for x in w.log(1_000_000).splitlines() if "dropped unrun" in x]

    def errors() -> int:
        return int(w.info().get("errors", 0))

    async with await RemoteLM.connect(redis_url, model="mock-300", timeout_s=0.4) as lm:
        sent = iter(range(10, 1000))

        async def rounds_until(done: Callable[[], bool]) -> None:
            for _ in range(5):  # 4 requests a round, 0.6 s each: some wait past 0.4 s
                calls = [lm.next_token_logprobs([next(sent), 1]) for _ in range(4)]
                await asyncio.gather(*calls, return_exceptions=True)
                deadline = time.monotonic() + 3  # a heartbeat or more after the answers
                while not done() and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                if done():
                    return
            raise AssertionError(w.log())

        await rounds_until(lambda: bool(said()))
        before = errors()
        await rounds_until(lambda: errors() > before)  # more dropped, within the minute
    await asyncio.sleep(1.0)  # five heartbeats more
    lines = said()
    assert len(lines) == 1, lines
    assert "WARNING" in lines[0] and "LMPOOL_TIMEOUT_S" in lines[0], lines[0]
    count = int(lines[0].split(" request(s) dropped unrun")[0].rsplit(" ", 1)[-1])
    assert 1 <= count <= before, lines[0]
