"""genlm-control runs unchanged on RemoteLM: SMC through the pool equals SMC in-process.

Both runs use the same tiny model (through the pool: a worker process; in-process:
genlm-backend's ``AsyncTransformer``) and the same seeds. Rows agree within a few float32 ulps
(1.1e-5 measured on rows of magnitude ~15), so every particle draws the same tokens and the
particles' log weights agree within 1e-4, unless a run sits on a tie: an ESS exactly at the
resampling threshold (see ``ESS``) is decided by that noise.
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


# -- a real BPE vocabulary: character-level samplers, critics, canonical tokens, bytes --------

PROMPT = "The cat said"
WORDS = r" [a-z]+( [a-z]+)*"
ESS = 0.45
"""Off the ties: at 0.5, three equal survivors of six give an ESS of exactly half, and rows
that differ by 1e-6 (another batch, another padding) decide alone whether to resample."""


@pytest.fixture(scope="module")
def tiny_bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from poolkit import build_tiny_bpe_llama

    return build_tiny_bpe_llama(tmp_path_factory.mktemp("tiny-bpe"))


def seeded() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def prompted(lm: Any) -> Any:
    return control.PromptedLLM(lm, prompt_ids=lm.tokenizer.encode(PROMPT), eos_byte_strings=[b"."])


def outcome(seqs: Any) -> tuple[list[list[Any]], list[float]]:
    return [list(c) for c in seqs.contexts], [float(w) for w in seqs.log_weights]


async def character_level(lm: Any) -> tuple[list[list[Any]], list[float]]:
    """Tokens drawn through genlm-backend's token-character trie under a character-level FSA."""
    seeded()
    sampler = control.eager_token_sampler(prompted(lm), control.BoolFSA.from_regex(WORDS))
    try:
        return outcome(await control.SMC(sampler)(n_particles=6, ess_threshold=ESS, max_tokens=6))
    finally:
        await sampler.cleanup()


async def token_level_with_critic(lm: Any) -> tuple[list[list[Any]], list[float]]:
    seeded()
    llm = prompted(lm)
    critic = control.BoolFSA.from_regex(WORDS).coerce(llm, f=b"".join)
    smc = control.SMC(control.direct_token_sampler(llm), critic=critic)
    return outcome(await smc(n_particles=6, ess_threshold=ESS, max_tokens=6))


async def canonical_tokens(lm: Any) -> tuple[list[list[Any]], list[float]]:
    """The canonicality critic reads the BPE merges of ``lm.tokenizer``."""
    seeded()
    llm = prompted(lm)
    critic = control.CanonicalTokenization.from_llm(llm)
    smc = control.SMC(control.direct_token_sampler(llm), critic=critic)
    return outcome(await smc(n_particles=3, ess_threshold=ESS, max_tokens=3))


async def byte_level(lm: Any) -> float:
    """genlm-bytes' beam over token paths (``ByteLLM``): the prefix log-prob of some bytes."""
    from genlm.bytes import BeamParams

    byte_llm = control.ByteLLM(lm, BeamParams(K=2, eos_byte_strings=[b"."]))
    byte_llm.set_prompt_from_str(PROMPT)
    try:
        return float(await byte_llm.prefix([b" ", b"s", b"a", b"t"]))
    finally:
        await byte_llm.cleanup()


async def rows_of(lm: Any, contexts: list[list[Any]]) -> torch.Tensor:
    """Next-token log-probs of every prefix the runs went through."""
    prompt = lm.tokenizer.encode(PROMPT)
    ids = {tuple(t.token_id for t in c if t is not control.EOS) for c in contexts}
    prefixes = sorted({(*prompt, *c[:i]) for c in ids for i in range(len(c) + 1)})
    return await lm.batch_next_token_logprobs([list(p) for p in prefixes])


@pytest.mark.asyncio
async def test_character_level_programs_through_the_pool_match_in_process(
    redis_url: str, workers: Callable[..., Any], tiny_bpe: Path
) -> None:
    """SmolLM2's real tokenizer (merges, multi-byte tokens) on a tiny random model: each program,
    same seeds, gives the same particles through the pool as in-process, log weights and every
    row the runs read within 1e-4 (rows of magnitude ~15: a few float32 ulps apart)."""
    workers(redis_url, model=str(tiny_bpe))
    local = backend_llm.AsyncTransformer.from_name(str(tiny_bpe))
    programs = [character_level, token_level_with_critic, canonical_tokens]
    expected = [await program(local) for program in programs]
    expected_bytes = await byte_level(local)
    async with await RemoteLM.connect(redis_url, model=str(tiny_bpe)) as lm:
        got = [await program(lm) for program in programs]
        got_bytes = await byte_level(lm)
        contexts = [c for run in expected for c in run[0]]
        have_rows, want_rows = await rows_of(lm, contexts), await rows_of(local, contexts)
    assert torch.allclose(have_rows, want_rows, atol=1e-4, rtol=0)  # measured: 1.1e-5
    for program, (contexts, weights), (want_contexts, want_weights) in zip(
        programs, got, expected, strict=True
    ):
        assert contexts == want_contexts, program.__name__
        assert np.allclose(weights, want_weights, atol=1e-4, equal_nan=True), program.__name__
    assert got_bytes == pytest.approx(expected_bytes, abs=1e-4)
    # not a degenerate run: particles differ, words of several bytes were drawn as one token
    chars = expected[0][0]
    assert len({tuple(c) for c in chars}) > 1
    assert any(t is not control.EOS and len(t.byte_string) > 1 for c in chars for t in c)
    assert any(np.isfinite(expected[0][1]))
