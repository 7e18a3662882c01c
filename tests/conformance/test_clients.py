"""What genlm's own clients check and use: ``isinstance`` against genlm-backend's classes, the
vocabularies and tokenizer, and llamppl 0.2.3's ``CachedCausalLM`` (the documented way to give
llamppl an existing ``AsyncLM``): it must accept the object, and its ``next_token_logprobs``,
``next_token_logprobs_unbatched``, ``cache_kv``, ``clear_kv_cache``, ``clear_cache`` and
``reset_async_queries`` must work on it."""

from __future__ import annotations

import asyncio
from typing import Any

import llamppl  # llamppl==0.2.3, in the dev extra
import numpy as np
import pytest
from genlm.backend import llm as genlm_llm
from genlm.backend.tokenization import Token, decode_vocab

from .kit import PROMPTS, TOL, VOCAB, direct, fresh_prompts, no_coroutine_left

# llamppl's import sets warning filters ("once" for RuntimeWarning) for the rest of the process:
# imported here, at collection, pytest restores its own filters afterwards; an import inside a
# test would let an un-awaited coroutine's RuntimeWarning pass in that test.

pytestmark = pytest.mark.timeout(30)


def test_isinstance_of_genlm_classes(lm: Any) -> None:
    assert isinstance(lm, genlm_llm.AsyncLM)
    assert isinstance(lm, genlm_llm.AsyncTransformer)


def test_vocabularies_and_tokenizer(lm: Any, tokenizer: Any) -> None:
    byte_vocab, str_vocab = decode_vocab(tokenizer)
    assert len(lm.byte_vocab) == VOCAB
    assert all(isinstance(t, Token) for t in lm.byte_vocab)
    assert [bytes(t) for t in lm.byte_vocab] == [bytes(t) for t in byte_vocab]
    assert [t.token_id for t in lm.byte_vocab] == list(range(VOCAB))
    assert lm.str_vocab == str_vocab
    assert lm.tokenizer.eos_token_id == tokenizer.eos_token_id
    assert lm.tokenizer.encode("Hello, world") == tokenizer.encode("Hello, world")
    assert lm.tokenizer.decode([72, 105, 33]) == tokenizer.decode([72, 105, 33])


def check_numpy_row(row: Any, ids: list[int], model: Any) -> None:
    assert isinstance(row, np.ndarray)
    assert row.dtype == np.float32 and row.shape == (VOCAB,)
    assert float(np.abs(row - direct(model, ids).numpy()).max()) <= TOL


def test_llamppl_accepts_it(lm: Any) -> None:
    clm = llamppl.CachedCausalLM(lm)
    assert clm.backend == "hf"
    assert clm.model is lm
    assert len(clm.str_vocab) == len(clm.byte_vocab) == VOCAB
    assert {lm.tokenizer.eos_token_id} == clm.masks.EOS


@pytest.mark.asyncio
async def test_llamppl_next_token_logprobs(lm: Any, hf_model: Any) -> None:
    clm = llamppl.CachedCausalLM(lm)
    rows = await asyncio.gather(*(clm.next_token_logprobs(ids) for ids in PROMPTS))
    for row, ids in zip(rows, PROMPTS, strict=True):
        check_numpy_row(row, ids, hf_model)
    check_numpy_row(clm.next_token_logprobs_unbatched(PROMPTS[1]), PROMPTS[1], hf_model)


@pytest.mark.asyncio
async def test_llamppl_cache_methods_in_a_loop(lm: Any, hf_model: Any) -> None:
    """llamppl's hard-constraints example: ``lm.cache_kv(prompt)`` inside a coroutine."""
    clm = llamppl.CachedCausalLM(lm)
    prefix = fresh_prompts(1, length=8)[0]
    no_coroutine_left(clm.cache_kv(prefix))
    for tail in ([3], [3, 4], [5]):
        check_numpy_row(await clm.next_token_logprobs(prefix + tail), prefix + tail, hf_model)
    no_coroutine_left(clm.clear_kv_cache())
    no_coroutine_left(clm.clear_cache())
    no_coroutine_left(clm.reset_async_queries())
    check_numpy_row(await clm.next_token_logprobs([*prefix, 6]), [*prefix, 6], hf_model)


def test_llamppl_cache_methods_without_a_loop(lm: Any, hf_model: Any) -> None:
    clm = llamppl.CachedCausalLM(lm)
    prefix = fresh_prompts(1, length=8)[0]
    no_coroutine_left(clm.cache_kv(prefix))
    check_numpy_row(asyncio.run(clm.next_token_logprobs([*prefix, 3])), [*prefix, 3], hf_model)
    no_coroutine_left(clm.clear_kv_cache())
    no_coroutine_left(clm.clear_cache())
    no_coroutine_left(clm.reset_async_queries())
    check_numpy_row(clm.next_token_logprobs_unbatched([*prefix, 4]), [*prefix, 4], hf_model)
