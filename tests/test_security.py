"""AUTH, ACL users per tenant, TLS: the pool works under least privilege and nothing leaks."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from typing import Any, cast

import pytest
import redis
import torch
from poolkit import mock_row
from redis.exceptions import AuthenticationError, NoPermissionError

from localpool.redis_server import RedisServer
from producer import RemoteLM
from shared.acl import producer_rule, worker_rule
from shared.errors import PoolUnreachable

V = 300
MODEL = f"mock-{V}"
pytestmark = pytest.mark.timeout(180)


def reference(ids: list[int]) -> torch.Tensor:
    return mock_row(V, ids)


@pytest.mark.asyncio
async def test_tenants_under_acl_rules_cannot_read_each_other(
    workers: Callable[..., Any],
) -> None:
    rules = [
        worker_rule("wa", "pwa", "ta"),
        producer_rule("pa", "ppa", "ta"),
        worker_rule("wb", "pwb", "tb"),
        producer_rule("pb", "ppb", "tb"),
    ]
    with RedisServer(password="admin", acl_lines=rules) as server:
        workers(server.url_for("wa", "pwa"), backend="mock", mock_vocab_size=V, key_prefix="ta")
        workers(server.url_for("wb", "pwb"), backend="mock", mock_vocab_size=V, key_prefix="tb")
        from shared.settings import Settings

        a = Settings(redis_url=server.url_for("pa", "ppa"), key_prefix="ta")
        async with await RemoteLM.connect(model=MODEL, settings=a) as lm:
            assert torch.equal(await lm.next_token_logprobs([1, 2]), reference([1, 2]))
            assert torch.equal(lm.next_token_logprobs_sync([3]), reference([3]))
        # answered from the shared cache: SUBMIT pushes its own marker (RPUSH) for a lone request
        async with await RemoteLM.connect(model=MODEL, settings=a, cache_size=0) as lm:
            assert torch.equal(await lm.next_token_logprobs([1, 2]), reference([1, 2]))
            assert torch.equal(lm.next_token_logprobs_sync([3]), reference([3]))
        b = Settings(redis_url=server.url_for("pb", "ppb"), key_prefix="tb")
        async with await RemoteLM.connect(model=MODEL, settings=b) as lm:
            assert torch.equal(await lm.next_token_logprobs([1, 2]), reference([1, 2]))

        admin = redis.Redis.from_url(server.url)
        b_keys = list(cast("list[bytes]", admin.keys("tb:*")))
        assert any(b":res:" in k for k in b_keys)
        admin.close()
        intruder = redis.Redis.from_url(server.url_for("pa", "ppa"))
        for key in b_keys:
            with pytest.raises(NoPermissionError):
                intruder.get(key)
        with pytest.raises(NoPermissionError):
            intruder.keys("*")
        with pytest.raises(NoPermissionError):
            intruder.flushall()
        with pytest.raises(NoPermissionError):  # producers cannot write results directly
            intruder.hset("ta:meta:x", "a", "b")
        intruder.close()


@pytest.mark.asyncio
async def test_password_from_the_url_and_a_wrong_one_fails_clearly(
    workers: Callable[..., Any],
) -> None:
    with RedisServer(password="s3cret") as server:
        workers(server.url, backend="mock", mock_vocab_size=V)
        async with await RemoteLM.connect(server.url, model=MODEL) as lm:
            assert torch.equal(await lm.next_token_logprobs([5]), reference([5]))
        bad = server.url.replace("s3cret", "wrong")
        with pytest.raises(PoolUnreachable, match="invalid username-password pair") as caught:
            await RemoteLM.connect(bad, model=MODEL, connect_timeout_s=1)
        assert isinstance(caught.value.__cause__, AuthenticationError)
        assert ":***@" in str(caught.value) and "wrong" not in str(caught.value)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
@pytest.mark.asyncio
async def test_tls_end_to_end(workers: Callable[..., Any]) -> None:
    with RedisServer(tls=True) as server:
        assert server.url.startswith("rediss://")
        workers(server.url, backend="mock", mock_vocab_size=V)
        async with await RemoteLM.connect(server.url, model=MODEL) as lm:
            assert torch.equal(await lm.next_token_logprobs([6, 7]), reference([6, 7]))
            assert torch.equal(lm.next_token_logprobs_sync([6]), reference([6]))


def test_readme_shows_the_acl_rules_the_tests_use() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert worker_rule("tenant_a-worker", "WORKER_PASSWORD", "tenant_a") in readme
    assert producer_rule("tenant_a-producer", "PRODUCER_PASSWORD", "tenant_a") in readme


@pytest.mark.asyncio
async def test_a_listener_killed_by_an_error_ends_its_state_as_a_close_does(
    workers: Callable[..., Any],
) -> None:
    """A producer whose ACL user may not pop its replies (BLMPOP: NOPERM, not a transient
    error) has its reply listener die: its requests fail with the reason, and its state ends
    as a close ends it: the housekeeping task stops, its reply list leaves the waiter sets, and
    its connections close; the next call starts a new state."""
    rules = [
        worker_rule("w", "pw"),
        producer_rule("p", "pp") + " -blmpop",
    ]
    with RedisServer(password="admin", acl_lines=rules) as server:
        w = workers(server.url_for("w", "pw"), backend="mock", mock_vocab_size=V, mock_delay_ms=300)
        from shared.errors import LMPoolError
        from shared.settings import Settings

        admin = redis.Redis.from_url(server.url)

        def producer_connections() -> int:
            clients = cast("list[dict[str, Any]]", admin.client_list())
            return sum(c["user"] == "p" for c in clients)

        settings = Settings(redis_url=server.url_for("p", "pp"))
        lm = await RemoteLM.connect(model=MODEL, settings=settings)
        state = lm._client._state()
        with pytest.raises(LMPoolError, match=r"reply listener stopped: NoPermissionError.*blmpop"):
            await lm.batch_next_token_logprobs([[1, 2], [3]])
        done, _ = await asyncio.wait([state.keeper, state.listener], timeout=10)
        assert state.keeper in done and state.listener in done
        assert state.closing and lm._client._state() is not state
        assert await w.wait_counter("requests", 2) == 2  # the worker answers nobody
        assert not admin.keys("lmpool:*:wait:*") and not admin.exists(state.reply_key)
        await lm.close()
        deadline = asyncio.get_running_loop().time() + 10
        while producer_connections() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert producer_connections() == 0
        admin.close()
