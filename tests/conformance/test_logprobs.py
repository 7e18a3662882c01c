"""Next-token log-probs, async / sync / batched: float32 ``[V]`` / ``[N, V]`` rows on the CPU,
normalized, equal to a direct transformers forward and to the other subject (``kit.TOL``);
every integer-like id genlm-backend accepts; bad ids raise ``ValueError`` (where genlm-backend
raises something else, both behaviours are asserted and named)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from .kit import NO_ARRAY_IDS, PROMPTS, TOL, VOCAB, assert_row, assert_rows, skip_reference

pytestmark = pytest.mark.timeout(30)


@pytest.mark.asyncio
async def test_next_token_logprobs(lm: Any, hf_model: Any) -> None:
    for ids in PROMPTS:
        assert_row(await lm.next_token_logprobs(ids), ids, hf_model)


def test_next_token_logprobs_sync(lm: Any, hf_model: Any) -> None:
    for ids in PROMPTS:
        assert_row(lm.next_token_logprobs_sync(ids), ids, hf_model)


@pytest.mark.asyncio
async def test_batch_next_token_logprobs(lm: Any, hf_model: Any) -> None:
    rows = await lm.batch_next_token_logprobs(PROMPTS)
    assert_rows(rows, PROMPTS, hf_model)
    assert torch.equal(rows[0], rows[3]), "a duplicate prompt gives the same row"


def test_batch_next_token_logprobs_sync(lm: Any, hf_model: Any) -> None:
    rows = lm.batch_next_token_logprobs_sync(PROMPTS)
    assert_rows(rows, PROMPTS, hf_model)
    assert torch.equal(rows[0], rows[3]), "a duplicate prompt gives the same row"


@pytest.mark.asyncio
async def test_async_sync_and_batched_agree(lm: Any) -> None:
    one = torch.stack([await lm.next_token_logprobs(ids) for ids in PROMPTS])
    for rows in (
        await lm.batch_next_token_logprobs(PROMPTS),
        lm.batch_next_token_logprobs_sync(PROMPTS),
        torch.stack([lm.next_token_logprobs_sync(ids) for ids in PROMPTS]),
    ):
        assert float((rows - one).abs().max()) <= TOL


@pytest.mark.asyncio
async def test_equal_to_the_other_subject(lm: Any, other: Any) -> None:
    mine = await lm.batch_next_token_logprobs(PROMPTS)
    theirs = await other.batch_next_token_logprobs(PROMPTS)
    assert float((mine - theirs).abs().max()) <= TOL
    assert float((lm.next_token_logprobs_sync(PROMPTS[1]) - theirs[1]).abs().max()) <= TOL


# -- integer-like ids ------------------------------------------------------------------------------
IDS = [1, 5, 9, 12]
ID_KINDS: dict[str, tuple[Callable[[list[int]], Any], str | None]] = {
    "python-ints": (lambda ids: list(ids), None),
    "numpy-int64": (lambda ids: list(np.array(ids, dtype=np.int64)), None),
    "numpy-int32": (lambda ids: list(np.array(ids, dtype=np.int32)), None),
    "torch-0d": (lambda ids: [torch.tensor(i) for i in ids], None),
    "numpy-1d": (lambda ids: np.array(ids, dtype=np.int64), NO_ARRAY_IDS),
    "torch-1d": (lambda ids: torch.tensor(ids), NO_ARRAY_IDS),
}


def test_np_random_choice_gives_numpy_int64() -> None:
    """What programs that draw tokens from an array of ids with numpy pass (the case above)."""
    tokens = np.arange(VOCAB)
    assert isinstance(np.random.choice(tokens, p=np.full(VOCAB, 1 / VOCAB)), np.int64)
    assert isinstance(np.random.default_rng(0).choice(tokens), np.int64)


@pytest.mark.parametrize("kind", ID_KINDS)
@pytest.mark.asyncio
async def test_integer_like_ids(lm: Any, subject: str, kind: str, hf_model: Any) -> None:
    make, lacking = ID_KINDS[kind]
    if lacking:
        skip_reference(subject, lacking)
    lm.clear_cache()
    assert_row(await lm.next_token_logprobs(make(IDS)), IDS, hf_model)
    lm.clear_cache()
    assert_row(lm.next_token_logprobs_sync(make(IDS)), IDS, hf_model)
    lm.clear_cache()
    rows = await lm.batch_next_token_logprobs([make(IDS), make(IDS[:2])])
    assert_rows(rows, [IDS, IDS[:2]], hf_model)
    lm.clear_cache()
    rows = lm.batch_next_token_logprobs_sync([make(IDS), make(IDS[:2])])
    assert_rows(rows, [IDS, IDS[:2]], hf_model)


@pytest.mark.asyncio
async def test_numpy_ids_drawn_with_np_random_choice(lm: Any, hf_model: Any) -> None:
    """A prompt extended one drawn token at a time, as sampling code does."""
    rng = np.random.default_rng(7)
    ids: list[Any] = [1]
    for _ in range(4):
        row = await lm.next_token_logprobs(ids)
        assert_row(row, ids, hf_model)
        probs = torch.softmax(row.double(), -1).numpy()
        ids.append(rng.choice(np.arange(VOCAB), p=probs))
    assert all(isinstance(i, np.int64) for i in ids[1:])


# -- bad ids ---------------------------------------------------------------------------------------
Raised = type[BaseException] | tuple[type[BaseException], ...]
BAD_IDS: dict[str, tuple[Any, Raised]] = {
    # name: (ids, what genlm-backend 0.3.1's AsyncTransformer raises, async and sync alike)
    "empty": ([], ValueError),  # "Token ids must not be empty"
    "out-of-vocabulary": ([1, VOCAB], IndexError),  # the embedding: "index out of range in self"
    "far-out-of-vocabulary": ([1, 10**9], IndexError),
    "negative": ([1, -1], IndexError),  # the embedding: "index out of range in self"
    "float": ([1, 2.5], RuntimeError),  # embedding: "Expected tensor ... Long, Int"
    "integral-float": ([1.0, 2.0], RuntimeError),  # the same (unless [1, 2] is cached: then
    # its trie, where 1.0 == 1, answers with that row)
    # torch.tensor: alone "too many dimensions 'str'" (ValueError); padded into a batch with
    # other prompts "new(): invalid data type 'str'" (TypeError)
    "string": (["w1"], (ValueError, TypeError)),
    "nested": ([[1, 2]], TypeError),  # its token trie: "unhashable type: 'list'"
}
GOOD = [3, 4]
"""A prompt batched with the bad one (no prefix of any bad case, cached or not)."""


def expected_error(subject: str, case: str) -> Raised:
    """The pool raises ``ValueError`` (lmpool's ``InvalidRequest``) for every bad id, before
    sending anything; the reference raises what its model or trie raises."""
    return BAD_IDS[case][1] if subject == "reference" else ValueError


@pytest.mark.parametrize("case", BAD_IDS)
@pytest.mark.asyncio
async def test_bad_ids_raise(lm: Any, subject: str, case: str) -> None:
    ids, _ = BAD_IDS[case]
    error = expected_error(subject, case)
    with pytest.raises(error):
        await lm.next_token_logprobs(ids)
    with pytest.raises(error):
        lm.next_token_logprobs_sync(ids)
    with pytest.raises(error):
        await lm.batch_next_token_logprobs([GOOD, ids])
    with pytest.raises(error):
        lm.batch_next_token_logprobs_sync([GOOD, ids])
    if subject == "pool":
        from shared.errors import InvalidRequest

        with pytest.raises(InvalidRequest):
            await lm.next_token_logprobs(ids)


@pytest.mark.asyncio
async def test_still_serves_after_bad_ids(lm: Any, subject: str, hf_model: Any) -> None:
    for case in BAD_IDS:
        with pytest.raises(expected_error(subject, case)):
            await lm.next_token_logprobs(BAD_IDS[case][0])
    assert_rows(await lm.batch_next_token_logprobs(PROMPTS), PROMPTS, hf_model)
