"""LoRA adapters per request on the hf backend, built locally with peft."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from poolkit import reference_logprobs
from transformers import AutoModelForCausalLM

from producer import RemoteLM
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
