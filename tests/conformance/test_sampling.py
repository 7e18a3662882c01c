"""Seeded ``sample`` / ``batch_sample``: reproducible, EOS never appended, ``max_tokens``
respected, plain ``list[int]`` / ``list[list[int]]``.

Both subjects draw each token from ``softmax(logprobs / temperature)`` with a CPU
``torch.Generator`` seeded by ``seed`` (the pool on its worker); their log-probs agree within
``kit.TOL``, and so, checked here, do their draws: the same seed gives the same tokens.
"""

from __future__ import annotations

from typing import Any

import pytest

from .kit import EOS

pytestmark = pytest.mark.timeout(30)
PROMPT = [1, 5, 9]
SEEDS = (0, 1, 123)


def assert_tokens(tokens: Any, max_tokens: int, eos: list[int]) -> None:
    assert type(tokens) is list
    assert all(type(t) is int for t in tokens), [type(t) for t in tokens]
    assert len(tokens) <= max_tokens
    assert not set(tokens) & set(eos), "EOS is never appended"


@pytest.mark.asyncio
async def test_seeded_sample_is_reproducible(lm: Any) -> None:
    for seed in SEEDS:
        a = await lm.sample(PROMPT, max_tokens=12, eos_token_ids=[EOS], seed=seed)
        lm.clear_cache()
        b = await lm.sample(PROMPT, max_tokens=12, eos_token_ids=[EOS], seed=seed)
        assert a == b
        assert_tokens(a, 12, [EOS])
    draws = {tuple(await lm.sample(PROMPT, max_tokens=8, eos_token_ids=[], seed=s)) for s in SEEDS}
    assert len(draws) == len(SEEDS), "different seeds draw differently"


@pytest.mark.parametrize("max_tokens", [0, 1, 7])
@pytest.mark.asyncio
async def test_max_tokens_is_respected(lm: Any, max_tokens: int) -> None:
    tokens = await lm.sample(PROMPT, max_tokens=max_tokens, eos_token_ids=[], seed=3)
    assert_tokens(tokens, max_tokens, [])
    assert len(tokens) == max_tokens, "without EOS ids every token is drawn"


@pytest.mark.asyncio
async def test_eos_stops_and_is_not_appended(lm: Any) -> None:
    """The seed's draws without EOS ids, then with the third drawn token as EOS: the same draws
    up to it, and it is not returned."""
    free = await lm.sample(PROMPT, max_tokens=6, eos_token_ids=[], seed=11)
    stop = free[2]
    assert stop not in free[:2], "choose another seed: the stop token is drawn earlier"
    cut = await lm.sample(PROMPT, max_tokens=6, eos_token_ids=[stop, EOS], seed=11)
    assert cut == free[:2]
    assert_tokens(cut, 6, [stop, EOS])


@pytest.mark.asyncio
async def test_temperature(lm: Any) -> None:
    cold = await lm.sample(PROMPT, 10, [EOS], temperature=0.25, seed=5)
    assert cold == await lm.sample(PROMPT, 10, [EOS], temperature=0.25, seed=5)
    assert_tokens(cold, 10, [EOS])
    hot = await lm.sample(PROMPT, 10, [EOS], temperature=4.0, seed=5)
    assert_tokens(hot, 10, [EOS])
    assert hot != cold


@pytest.mark.asyncio
async def test_batch_sample(lm: Any) -> None:
    prompts = [PROMPT, [1, 7], PROMPT]
    out = await lm.batch_sample(prompts, max_tokens=5, eos_token_ids=[EOS], seed=9)
    assert type(out) is list and len(out) == len(prompts)
    for tokens in out:
        assert_tokens(tokens, 5, [EOS])
    assert out[0] == out[2], "the same prompt and seed draw the same tokens"
    alone = [await lm.sample(p, max_tokens=5, eos_token_ids=[EOS], seed=9) for p in prompts]
    assert out == alone, "each prompt of a batch draws as it would alone with that seed"
    again = await lm.batch_sample(prompts, max_tokens=5, eos_token_ids=[EOS], seed=9)
    assert again == out


@pytest.mark.asyncio
async def test_sample_prompt_not_modified(lm: Any) -> None:
    prompt = list(PROMPT)
    await lm.sample(prompt, max_tokens=4, eos_token_ids=[EOS], seed=2)
    assert prompt == PROMPT


@pytest.mark.asyncio
async def test_same_tokens_as_the_other_subject(lm: Any, other: Any) -> None:
    for seed in SEEDS:
        for temperature in (1.0, 0.5):
            mine = await lm.sample(PROMPT, 16, [EOS], temperature=temperature, seed=seed)
            theirs = await other.sample(PROMPT, 16, [EOS], temperature=temperature, seed=seed)
            assert mine == theirs, f"seed {seed}, temperature {temperature}"
    prompts = [PROMPT, [1, 7, 8]]
    assert await lm.batch_sample(prompts, 6, [EOS], seed=4) == await other.batch_sample(
        prompts, 6, [EOS], seed=4
    )
