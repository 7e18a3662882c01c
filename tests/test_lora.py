"""LoRA adapters per request on the hf backend, built locally with peft."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from poolkit import reference_logprobs
from transformers import AutoModelForCausalLM

from producer import RemoteLM
from producer.adapters import RESOLVE_TTL_S
from shared.errors import UnknownAdapter

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(300)


def build_adapter(base: Path, out: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


def reference(base: Path, adapter: Path | None, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    return reference_logprobs(model, ids)


@pytest.mark.asyncio
async def test_requests_pick_their_adapter(
    redis_url: str, workers: Callable[..., Any], tiny_llama: Path, tmp_path: Path
) -> None:
    a = build_adapter(tiny_llama, tmp_path / "a", 1)
    b = build_adapter(tiny_llama, tmp_path / "b", 2)
    w = workers(redis_url, model=str(tiny_llama), lora=f"alpha={a},beta={b}", max_batch=8)
    ids = [5, 6, 7, 8]
    async with await RemoteLM.connect(redis_url, model=str(tiny_llama)) as lm:
        base_row, a_row, b_row = await asyncio.gather(
            lm.next_token_logprobs(ids),
            lm.next_token_logprobs(ids, lora_name="alpha"),
            lm.next_token_logprobs(ids, lora_name="beta"),
        )
        with pytest.raises(UnknownAdapter, match=r"'gamma'.*alpha, beta"):
            await lm.next_token_logprobs(ids, lora_name="gamma")
        a_score = await lm.score(ids[:2], ids[2:], lora_name="alpha")
    assert (base_row - reference(tiny_llama, None, ids)).abs().max() <= 1e-5
    assert (a_row - reference(tiny_llama, a, ids)).abs().max() <= 1e-5
    assert (b_row - reference(tiny_llama, b, ids)).abs().max() <= 1e-5
    assert (a_row - base_row).abs().max() > 1e-3, "the adapter must change the result"
    expect = torch.stack(
        [reference(tiny_llama, a, ids[:2])[ids[2]], reference(tiny_llama, a, ids[:3])[ids[3]]]
    )
    assert torch.allclose(a_score, expect, atol=1e-5)
    assert await w.wait_counter("rows", 4) == 4  # three cache keys of one prompt, plus the score


@pytest.mark.asyncio
async def test_adapters_added_at_run_time_serve_the_whole_pool(
    redis_url: str, workers: Callable[..., Any], tiny_llama: Path, tmp_path: Path
) -> None:
    """add_new_lora on one producer: every worker loads it on first use, every producer can
    use it, a replacement under the same name is never answered from the old one's cache,
    and remove_lora unloads it everywhere."""
    a = build_adapter(tiny_llama, tmp_path / "a", 1)
    b = build_adapter(tiny_llama, tmp_path / "b", 2)
    w = workers(redis_url, model=str(tiny_llama), max_batch=8, heartbeat_s=0.2)
    ids = [5, 6, 7, 8]
    model = str(tiny_llama)
    async with (
        await RemoteLM.connect(redis_url, model=model) as one,
        await RemoteLM.connect(redis_url, model=model) as two,
    ):
        with pytest.raises(UnknownAdapter):
            await one.next_token_logprobs(ids, lora_name="mine")
        assert (await one.add_new_lora(a, "mine")).startswith("mine@")
        got = await two.next_token_logprobs(ids, lora_name="mine")  # the other producer
        assert (got - reference(tiny_llama, a, ids)).abs().max() <= 1e-5
        score = await one.score(ids[:2], ids[2:], lora_name="mine")
        assert torch.allclose(score[0], reference(tiny_llama, a, ids[:2])[ids[2]], atol=1e-5)
        await wait_for_adapters(w, loaded=True)
        # the same name, other weights: a new id, so no cache answers with the old rows; the
        # producer that replaced it sees that at once, others within RESOLVE_TTL_S
        await one.add_new_lora(b, "mine")
        replaced = await one.next_token_logprobs(ids, lora_name="mine")
        assert (replaced - reference(tiny_llama, b, ids)).abs().max() <= 1e-5
        await asyncio.sleep(RESOLVE_TTL_S)
        assert torch.equal(await two.next_token_logprobs(ids, lora_name="mine"), replaced)
        await two.remove_lora("mine")
        with pytest.raises(UnknownAdapter, match="mine"):
            await one.next_token_logprobs([9, 9], lora_name="mine")
        with pytest.raises(UnknownAdapter):
            await one.remove_lora("mine")
        await wait_for_adapters(w, loaded=False)  # unloaded at the worker's next heartbeat
        assert torch.equal(await one.next_token_logprobs(ids), await two.next_token_logprobs(ids))


async def wait_for_adapters(w: Any, loaded: bool, timeout_s: float = 10) -> None:
    """Until the worker's heartbeat lists a run-time adapter (or none)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any("@" in a for a in w.info().get("adapters") or []) == loaded:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"run-time adapters never {'loaded' if loaded else 'unloaded'}")


def test_adapter_uploads_are_checked_before_sending(tmp_path: Path, tiny_llama: Path) -> None:
    from producer.adapters import adapter_files

    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        adapter_files(tmp_path, 1 << 20)
    a = build_adapter(tiny_llama, tmp_path / "a", 1)
    with pytest.raises(ValueError, match="LMPOOL_MAX_LORA_MB"):
        adapter_files(a, 100)
    (a / "adapter_model.safetensors").rename(a / "adapter_model.bin")
    with pytest.raises(ValueError, match="pickled"):
        adapter_files(a, 1 << 30)


@pytest.mark.asyncio
async def test_an_adapter_that_fails_to_load_leaves_the_base_model_as_it_was(
    redis_url: str, workers: Callable[..., Any], tiny_llama: Path, tmp_path: Path
) -> None:
    """An adapter made for another model's shapes is refused with the reason, and the
    worker's base model (and its other adapters) still give the reference's rows: peft had
    injected the adapter's layers before its weights failed to load."""
    from poolkit import build_tiny_llama

    wide = build_tiny_llama(tmp_path / "wide", hidden_size=96)
    bad = build_adapter(wide, tmp_path / "bad", 3)
    a = build_adapter(tiny_llama, tmp_path / "a", 1)
    workers(redis_url, model=str(tiny_llama), max_batch=8, kv_cache_mb=0)
    async with await RemoteLM.connect(redis_url, model=str(tiny_llama)) as lm:
        await lm.add_new_lora(bad, "bad")
        for _ in range(2):  # a second request tries again, and fails the same way
            with pytest.raises(
                UnknownAdapter, match=r"(?s)'bad' could not be loaded.*size mismatch"
            ):
                await lm.next_token_logprobs([5, 6, 7, 8], lora_name="bad")
        base_row = await lm.next_token_logprobs([5, 6, 7, 9])
        await lm.add_new_lora(a, "a")
        a_row = await lm.next_token_logprobs([5, 6, 7, 10], lora_name="a")
        with pytest.raises(UnknownAdapter, match="size mismatch"):
            await lm.next_token_logprobs([5, 6, 7, 8], lora_name="bad")
        base_again = await lm.next_token_logprobs([5, 6, 7, 11])
    assert (base_row - reference(tiny_llama, None, [5, 6, 7, 9])).abs().max() <= 1e-5
    assert (a_row - reference(tiny_llama, a, [5, 6, 7, 10])).abs().max() <= 1e-5
    assert (base_again - reference(tiny_llama, None, [5, 6, 7, 11])).abs().max() <= 1e-5


@pytest.mark.asyncio
async def test_replacing_and_removing_an_adapter_leaves_none_of_its_files_in_redis(
    redis_url: str, workers: Callable[..., Any], tiny_llama: Path, tmp_path: Path
) -> None:
    import redis as redis_lib

    a = build_adapter(tiny_llama, tmp_path / "a", 1)
    b = build_adapter(tiny_llama, tmp_path / "b", 2)
    workers(redis_url, backend="mock", mock_vocab_size=320)
    admin = redis_lib.Redis.from_url(redis_url)
    async with await RemoteLM.connect(redis_url, model="mock-320") as lm:
        await lm.add_new_lora(a, "mine")
        await lm.add_new_lora(b, "mine")  # the same name, other weights
        await lm.add_new_lora(a, "other")
        files = sorted(admin.scan_iter(match="lmpool:lorafile:*"))
        assert len(files) == 4, files  # two adapters of two files each, a's old weights gone
        await lm.remove_lora("mine")
        await lm.remove_lora("other")
    assert list(admin.scan_iter(match="lmpool:lora*")) == []
    admin.close()


@pytest.mark.asyncio
async def test_tenants_under_the_acl_rules_add_use_and_remove_adapters(
    workers: Callable[..., Any], tiny_llama: Path, tmp_path: Path
) -> None:
    """README's least-privilege rules let a producer name adapters, add and remove them."""
    from localpool.redis_server import RedisServer
    from shared.acl import producer_rule, worker_rule
    from shared.settings import Settings

    a = build_adapter(tiny_llama, tmp_path / "a", 1)
    rules = [
        worker_rule("w", "pw", "lab"),
        producer_rule("alice", "pa", "lab", tenant=True),
        producer_rule("p", "pp", "lab"),
    ]
    ids, model = [5, 6, 7, 8], str(tiny_llama)
    with RedisServer(password="admin", acl_lines=rules) as server:
        workers(server.url_for("w", "pw"), model=model, lora=f"static={a}", key_prefix="lab")
        for user, password in (("alice", "pa"), ("p", "pp")):
            settings = Settings(redis_url=server.url_for(user, password), key_prefix="lab")
            async with await RemoteLM.connect(model=model, settings=settings) as lm:
                static = await lm.next_token_logprobs(ids, lora_name="static")
                await lm.add_new_lora(a, f"mine-{user}")
                mine = await lm.next_token_logprobs(ids, lora_name=f"mine-{user}")
                await lm.remove_lora(f"mine-{user}")
            assert (static - reference(tiny_llama, a, ids)).abs().max() <= 1e-5
            assert (mine - reference(tiny_llama, a, ids)).abs().max() <= 1e-5


@pytest.mark.asyncio
async def test_a_start_up_adapters_name_with_other_weights_is_another_adapter(
    redis_url: str, workers: Callable[..., Any], tiny_llama: Path, tmp_path: Path
) -> None:
    """LMPOOL_LORA names an adapter; its weights decide its rows. A worker restarted with other
    weights under the same adapter name (a retrained adapter) never answers from the old
    weights' cached rows, and a worker whose adapter of that name differs from a live worker's
    is refused at start-up."""
    a = build_adapter(tiny_llama, tmp_path / "a", 1)
    b = build_adapter(tiny_llama, tmp_path / "b", 2)
    ids = [5, 6, 7, 8]
    first = workers(redis_url, model=str(tiny_llama), lora=f"style={a}")
    async with await RemoteLM.connect(redis_url, model=str(tiny_llama)) as lm:
        old = await lm.next_token_logprobs(ids, lora_name="style")
    assert (old - reference(tiny_llama, a, ids)).abs().max() <= 1e-5
    assert first.terminate() == 0
    workers(redis_url, model=str(tiny_llama), lora=f"style={b}")
    async with await RemoteLM.connect(redis_url, model=str(tiny_llama)) as lm:
        row = await lm.next_token_logprobs(ids, lora_name="style")
    assert (row - reference(tiny_llama, b, ids)).abs().max() <= 1e-5
    with pytest.raises(RuntimeError, match="fingerprint"):
        workers(redis_url, model=str(tiny_llama), lora=f"style={a}")
