"""genlm-control runs unchanged on RemoteLM: SMC through the pool equals SMC in-process.

Both runs use the same tiny model (through the pool: a worker process; in-process:
genlm-backend's ``AsyncTransformer``) and the same seeds. Log-probs agree within 1e-5, so every
particle draws the same tokens and the particles' log weights agree within 1e-4.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

control = pytest.importorskip("genlm.control")
backend_llm = pytest.importorskip("genlm.backend.llm")

from producer import RemoteLM  # noqa: E402

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:Common vocabulary:RuntimeWarning"),
]


async def run_smc(lm: Any) -> tuple[list[Any], list[float]]:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    llm = control.PromptedLLM(lm, prompt_ids=[97, 98, 32], eos_byte_strings=[b"."])
    fsa = control.BoolFSA.from_regex(r"[ab]+")
    sampler = control.AWRS(llm, fsa.coerce(llm, f=b"".join))
    smc = control.SMC(sampler)
    seqs = await smc(n_particles=6, ess_threshold=0.5, max_tokens=6)
    return list(seqs.contexts), [float(w) for w in seqs.log_weights]


@pytest.mark.asyncio
async def test_smc_through_the_pool_matches_in_process(
    redis_url: str, workers: Callable[..., Any], tiny_llama: Path
) -> None:
    workers(redis_url, model=str(tiny_llama))
    local = backend_llm.AsyncTransformer.from_name(str(tiny_llama))
    expected_contexts, expected_weights = await run_smc(local)
    async with await RemoteLM.connect(redis_url, model=str(tiny_llama)) as lm:
        assert [bytes(t) for t in lm.byte_vocab] == [bytes(t) for t in local.byte_vocab]
        contexts, weights = await run_smc(lm)
    assert contexts == expected_contexts
    assert np.allclose(weights, expected_weights, atol=1e-4, equal_nan=True)
    assert any(np.isfinite(weights)), "the constraint should keep some particles alive"
