"""Worker logs: JSON lines with request digests when asked for."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from producer import RemoteLM
from shared.settings import Settings

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
