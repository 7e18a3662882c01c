"""AUTH, ACL users per tenant, TLS: the pool works under least privilege and nothing leaks."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import redis
import torch
from poolkit import WorkerProcess, mock_row
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


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
@pytest.mark.asyncio
async def test_tls_refuses_a_certificate_for_another_host(
    workers: Callable[..., Any], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A certificate of the trusted CA made out to another host is refused on every path
    (redis-py 5 checks no host name unless told): producer, worker, lmpool-status, arq."""
    from producer.score import enqueue_score_file
    from worker import status

    with RedisServer(tls=True, tls_host="pool.elsewhere.test") as server:
        with pytest.raises(PoolUnreachable, match="certificate"):
            await RemoteLM.connect(server.url, model=MODEL, connect_timeout_s=1)
        assert await asyncio.to_thread(status.main, ["--redis-url", server.url]) == 1
        assert "certificate is not valid for '127.0.0.1'" in capsys.readouterr().err
        with pytest.raises(redis.ConnectionError, match="certificate"):
            await enqueue_score_file(server.url, "/nowhere/in.jsonl", "/nowhere/out.jsonl")
        with WorkerProcess(server.url, tmp_path, backend="mock", mock_vocab_size=V) as w:
            assert w.proc is not None and w.proc.wait(timeout=60) != 0
            assert "certificate is not valid" in w.log(), w.log()
        # the operator's way out: the URL itself turns the check off
        insecure = server.url + "&ssl_check_hostname=false"
        w = workers(insecure, backend="mock", mock_vocab_size=V)
        async with await RemoteLM.connect(insecure, model=MODEL) as lm:
            assert torch.equal(await lm.next_token_logprobs([6, 7]), reference([6, 7]))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
@pytest.mark.asyncio
async def test_a_client_certificate_in_the_url_reaches_every_path(
    workers: Callable[..., Any],
) -> None:
    """A server that wants client certificates (``--tls-auth-clients yes``): the URL's
    ``ssl_certfile`` / ``ssl_keyfile`` reach arq's connection too (the worker's queue, and the
    enqueuer's, whose arq ``from_dsn`` dropped every TLS option of the query)."""
    from producer.score import enqueue_score_file, read_job_progress
    from worker import status

    with RedisServer(tls=True, tls_clients=True) as server:
        assert "ssl_certfile=" in server.url
        workers(server.url, backend="mock", mock_vocab_size=V)
        async with await RemoteLM.connect(server.url, model=MODEL) as lm:
            assert torch.equal(await lm.next_token_logprobs([6, 7]), reference([6, 7]))
        assert await asyncio.to_thread(status.main, ["--redis-url", server.url, "--json"]) == 0
        job = await enqueue_score_file(server.url, "/nowhere/in.jsonl", "/nowhere/out.jsonl")
        assert isinstance(await read_job_progress(server.url, job), dict)


@pytest.mark.asyncio
async def test_a_password_that_is_not_percent_encoded_never_shows(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A password holding '/', '?' or '#' (``openssl rand -base64`` makes them) breaks the
    URL's parse: redis-py took its first half for the port and said so in its error, and the
    masking found no password to mask. Every entry point now refuses it, naming neither half."""
    from shared.errors import SettingsError
    from worker import status

    for url in (
        "redis://:SECRETa/SECRETb@127.0.0.1:6399/0",
        "redis://lmpool:SECRETa?SECRETb@127.0.0.1:6399/0",
        "redis://:SECRETa#SECRETb@127.0.0.1:6399/0",
    ):
        assert status.main(["--redis-url", url]) == 2
        err = capsys.readouterr().err
        assert "percent-encode" in err and "SECRET" not in err, err
        with pytest.raises(SettingsError, match="percent-encode") as caught:
            await RemoteLM.connect(url, model=MODEL, connect_timeout_s=1)
        assert "SECRET" not in str(caught.value)
    with WorkerProcess(url, tmp_path, backend="mock", mock_vocab_size=V) as w:
        assert w.proc is not None and w.proc.wait(timeout=60) == 2
        assert "percent-encode" in w.log() and "SECRET" not in w.log(), w.log()


@pytest.mark.asyncio
async def test_a_tenant_cannot_answer_another_tenants_requests(
    workers: Callable[..., Any],
) -> None:
    """Tenants read the whole pool, so alice finds the reply lists waiting for bob's requests
    (the members of the waiter sets); Redis refuses her pushing an answer of her own onto
    them, and bob gets the worker's answer. (Every tenant's rule let it write ``reply:*``:
    bob's call returned alice's tensor.)"""
    from shared import protocol

    rules = [
        worker_rule("w", "pw", "lab"),
        producer_rule("alice", "pa", "lab", tenant=True),
        producer_rule("bob", "pb", "lab", tenant=True),
    ]
    with RedisServer(password="admin", acl_lines=rules) as server:
        url = server.url_for("w", "pw")
        workers(url, backend="mock", mock_vocab_size=V, key_prefix="lab", mock_delay_ms=2000)
        from shared.settings import Settings

        bob = Settings(redis_url=server.url_for("bob", "pb"), key_prefix="lab")
        alice = redis.Redis.from_url(server.url_for("alice", "pa"))
        async with await RemoteLM.connect(model=MODEL, settings=bob, cache_size=0) as lm:
            asked = asyncio.create_task(lm.next_token_logprobs([1, 2]))
            waiting: list[tuple[str, bytes]] = []
            for _ in range(200):
                for key in alice.scan_iter("lab:*:wait:*"):
                    digest = key.decode().rsplit(":", 1)[1]
                    waiting += [(digest, r) for r in cast("set[bytes]", alice.smembers(key))]
                if waiting:
                    break
                await asyncio.sleep(0.01)
            assert waiting
            forged = protocol.encode_result(torch.zeros(V))
            for digest, reply in waiting:
                with pytest.raises(NoPermissionError):
                    alice.rpush(reply.decode(), protocol.encode_reply(digest, forged))
            assert torch.equal(await asked, reference([1, 2]))
        alice.close()
