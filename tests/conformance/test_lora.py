"""LoRA adapters added at run time: ``add_new_lora(path, name)`` (a plain method, called without
``await`` as with genlm-backend), then ``lora_name=name`` requests equal a forward of the model
with the adapter merged into its weights (``kit.merged``, ``kit.LORA_TOL``); ``remove_lora(name)``,
then a request naming it raises ``ValueError``; ``set_lora`` / ``clear_lora`` raise
``RuntimeError`` as genlm-backend 0.3.1's do. The adapter is a tiny PEFT one made by the test
(``poolkit.build_adapter``). The reference's adapters go into a model of its own."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import Files, Subjects
from .kit import (
    EOS,
    LORA_TOL,
    PROMPTS,
    assert_row,
    assert_rows,
    direct,
    merged,
    no_coroutine_left,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def merged_model(hf_model: Any, files: Files) -> Any:
    return merged(hf_model, files.adapter)


@pytest.fixture
def lora_lm(subject: str, subjects: Subjects) -> Any:
    return subjects.make(subject, own_model=True)


@pytest.fixture
def name() -> Iterator[str]:
    """A name of this test's own (the pool's adapters are registered for the whole pool)."""
    yield f"conformance-{uuid.uuid4().hex[:8]}"


@pytest.mark.asyncio
async def test_add_new_lora_then_lora_requests(
    lora_lm: Any, files: Files, hf_model: Any, merged_model: Any, name: str
) -> None:
    lm = lora_lm
    no_coroutine_left(lm.add_new_lora(str(files.adapter), name))
    prompts = PROMPTS[:2]
    rows = await lm.batch_next_token_logprobs(prompts, lora_name=name)
    assert_rows(rows, prompts, merged_model, LORA_TOL)
    for row, ids in zip(rows, prompts, strict=True):
        assert float((row - direct(hf_model, ids)).abs().max()) > 1e-3, "the adapter matters"
    ids = [1, 7, 9]
    assert_row(await lm.next_token_logprobs(ids, lora_name=name), ids, merged_model, LORA_TOL)
    assert_row(lm.next_token_logprobs_sync([*ids, 2], name), [*ids, 2], merged_model, LORA_TOL)
    assert_row(await lm.next_token_logprobs(ids), ids, hf_model)  # the base model is untouched
    tokens = await lm.sample(ids, 5, [EOS], seed=3, lora_name=name)
    assert tokens == await lm.sample(ids, 5, [EOS], seed=3, lora_name=name)


@pytest.mark.asyncio
async def test_remove_lora_then_requests_naming_it_raise(
    lora_lm: Any, files: Files, hf_model: Any, merged_model: Any, name: str
) -> None:
    lm = lora_lm
    no_coroutine_left(lm.add_new_lora(str(files.adapter), name))
    ids = [1, 5, 9]
    assert_row(await lm.next_token_logprobs(ids, lora_name=name), ids, merged_model, LORA_TOL)
    no_coroutine_left(lm.remove_lora(name))
    with pytest.raises(ValueError):
        await lm.next_token_logprobs(ids, lora_name=name)  # asked before: no cached answer
    with pytest.raises(ValueError):
        lm.next_token_logprobs_sync([1, 4], lora_name=name)
    with pytest.raises(ValueError):
        await lm.batch_next_token_logprobs([[1, 4], [1, 6]], lora_name=name)
    assert_row(await lm.next_token_logprobs(ids), ids, hf_model)


def test_lora_without_a_loop(
    lora_lm: Any, files: Files, hf_model: Any, merged_model: Any, name: str
) -> None:
    lm = lora_lm
    no_coroutine_left(lm.add_new_lora(str(files.adapter), name))
    rows = lm.batch_next_token_logprobs_sync(PROMPTS[:3], lora_name=name)
    assert_rows(rows, PROMPTS[:3], merged_model, LORA_TOL)
    ids = [1, 8]
    row = asyncio.run(lm.next_token_logprobs(ids, lora_name=name))
    assert_row(row, ids, merged_model, LORA_TOL)
    no_coroutine_left(lm.remove_lora(name))
    with pytest.raises(ValueError):
        lm.next_token_logprobs_sync([1, 3, 3], lora_name=name)
    with pytest.raises(ValueError):
        asyncio.run(lm.next_token_logprobs([1, 3, 4], lora_name=name))


@pytest.mark.asyncio
async def test_add_new_lora_again_under_the_same_name(
    lora_lm: Any, files: Files, merged_model: Any, name: str
) -> None:
    """Loading under an existing name replaces that adapter (genlm's docstring)."""
    lm = lora_lm
    no_coroutine_left(lm.add_new_lora(str(files.adapter), name))
    no_coroutine_left(lm.add_new_lora(str(files.adapter), name))
    ids = [1, 6, 6]
    assert_row(await lm.next_token_logprobs(ids, lora_name=name), ids, merged_model, LORA_TOL)


@pytest.mark.asyncio
async def test_an_adapter_never_added_raises_value_error(lm: Any, name: str) -> None:
    with pytest.raises(ValueError):
        await lm.next_token_logprobs([1, 2], lora_name=name)
    with pytest.raises(ValueError):
        lm.next_token_logprobs_sync([1, 2], lora_name=name)
    with pytest.raises(ValueError):
        await lm.sample([1, 2], 3, [EOS], seed=0, lora_name=name)


def test_set_lora_and_clear_lora_raise_runtime_error(lm: Any, files: Files) -> None:
    with pytest.raises(RuntimeError, match="set_lora"):
        lm.set_lora(str(files.adapter), "a")
    with pytest.raises(RuntimeError, match="clear_lora"):
        lm.clear_lora()
