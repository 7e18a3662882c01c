"""The hf backend's draws against the model's exact next-token distributions.

Statistics run on a tiny Llama whose LM head is scaled up (x30: entropy 2.7 nats, top
probability 0.22 at the prompt used), so that a wrong distribution shows; seeds are fixed, so
every figure is the same on every run. Each chi-square merges the bins expected below 5 draws
and must stay under ``dof + 6 * sqrt(2 * dof)``: a correct sampler exceeds that with
probability below 1e-5 (chi-square tail), while a draw at the wrong temperature (1 for 0.5)
puts it in the hundreds.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from producer import RemoteLM
from shared.settings import Settings
from worker.backends.base import Work
from worker.backends.hf import HFBackend
from worker.backends.rows import draw

PROMPT = [1, 5, 9]


@pytest.fixture(scope="module")
def sharp(tiny_llama: Path) -> HFBackend:
    b = HFBackend(Settings(model=str(tiny_llama), kv_cache_mb=64))
    with torch.no_grad():
        b.model.lm_head.weight.mul_(30)
    return b


def exact(b: HFBackend, ids: list[int]) -> torch.Tensor:
    """float64 log-probs of the next token after ``ids``, the prompt alone through the model."""
    with torch.inference_mode():
        logits = b.model(torch.tensor([ids])).logits[0, -1]
    return torch.log_softmax(logits.double(), -1)


def chi_square(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def assert_fits(counts: np.ndarray, probs: np.ndarray, what: str) -> None:
    chi, dof = chi_square(counts, probs * counts.sum())
    assert dof >= 5, "too few bins to say anything"
    assert chi < dof + 6 * math.sqrt(2 * dof), f"{what}: chi2 {chi:.1f} on {dof} dof"


def run_samples(
    b: HFBackend, prompt: list[int], n: int, max_tokens: int, t: float
) -> list[list[int]]:
    params = {"max_tokens": max_tokens, "eos": [], "temperature": t}
    works = [Work("sample", prompt, None, {**params, "seed": s}) for s in range(n)]
    b.run(works)
    return [[int(x) for x in w.result.tolist()] for w in works if w.result is not None]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_one_token_draws_follow_the_tempered_softmax(sharp: HFBackend, temperature: float) -> None:
    """4000 one-token draws (seeds 0..3999, 16 decoded together) against
    softmax(logprobs / temperature). Measured chi2 (dof, bound): 49.8 (33, 81.7) at 1.0,
    9.7 (14, 45.7) at 0.5, 101.3 (104, 190.5) at 2.0; against twice the temperature 3455,
    1712 and 2868 (TV distances 0.40, 0.29, 0.33 against 0.048, 0.012, 0.074)."""
    draws = run_samples(sharp, PROMPT, 4000, 1, temperature)
    counts = np.bincount([d[0] for d in draws], minlength=sharp.info["vocab_size"])
    probs = torch.softmax(exact(sharp, PROMPT) / temperature, -1).numpy()
    assert_fits(counts, probs, f"temperature {temperature}")
    wrong = torch.softmax(exact(sharp, PROMPT) / (temperature * 2), -1).numpy()
    chi, dof = chi_square(counts, wrong * counts.sum())
    assert chi > dof + 6 * math.sqrt(2 * dof), "the test tells temperatures apart"


def test_two_token_draws_follow_the_product_of_conditionals(sharp: HFBackend) -> None:
    """3000 two-token generations (the second token through the KV cache) against
    p(a | prompt) * p(b | prompt, a), over the pairs (measured chi2 58.0 on 44 dof, bound
    100.3)."""
    draws = run_samples(sharp, PROMPT, 3000, 2, 1.0)
    first = exact(sharp, PROMPT).exp()
    pairs: dict[tuple[int, int], int] = {}
    for a, b in draws:
        pairs[(a, b)] = pairs.get((a, b), 0) + 1
    heads = [int(a) for a in torch.argsort(first, descending=True)[:12]]  # 0.88 of the mass
    keys, probs = [], []
    for a in heads:
        second = exact(sharp, [*PROMPT, a]).exp()
        for b in range(len(second)):
            keys.append((a, b))
            probs.append(float(first[a] * second[b]))
    rest = 1 - sum(probs)
    counts = np.array(
        [pairs.get(k, 0) for k in keys] + [len(draws) - sum(pairs.get(k, 0) for k in keys)]
    )
    assert_fits(counts, np.array([*probs, rest]), "pairs")


@pytest.fixture(scope="module")
def bf16(tiny_llama: Path) -> HFBackend:
    return HFBackend(Settings(model=str(tiny_llama), kv_cache_mb=64, dtype="bfloat16"))


def test_bfloat16_greedy_takes_the_models_argmax(bf16: HFBackend) -> None:
    """temperature=0 takes the most likely token of the model's logits (HF's greedy, and what
    ``score(greedy=True)`` calls greedy). Rows rounded to bfloat16 tie tokens whose logits
    differ (this random model's logits are small, its log-probs near -5.8: 2^-6 apart in
    bfloat16), and greedy took the lower id of the tie (measured: 2 of these 40 prompts)."""
    wrong = []
    for first in range(1, 41):
        prompt = [first, 7, 9]
        with torch.inference_mode():
            logits = bf16.model(torch.tensor([prompt])).logits[0, -1].float()
        (token,) = bf16.sample(prompt, 1, [], 0.0, None, None)
        flag = bf16.score(prompt, [token], None, greedy=True)[0, 1].item()
        if token != int(logits.argmax()) or flag != 1.0:
            wrong.append((prompt, token, int(logits.argmax()), flag))
    assert not wrong


def test_bfloat16_seeded_draws_follow_genlms_rule(bf16: HFBackend) -> None:
    """A seeded draw equals genlm-backend's: torch.multinomial over softmax(float32
    log_softmax(logits) / temperature) with a generator of that seed. With rows rounded to
    bfloat16, 42 of these 2000 draws at temperature 0.25 (8 at 1.0) were other tokens."""
    with torch.inference_mode():
        logits = bf16.model(torch.tensor([PROMPT])).logits[0, -1]
    row = torch.log_softmax(logits.float(), -1)
    for temperature in (1.0, 0.25):
        draws = run_samples(bf16, PROMPT, 2000, 1, temperature)
        expect = [draw(row, temperature, torch.Generator().manual_seed(s)) for s in range(2000)]
        assert [d[0] for d in draws] == expect, f"temperature {temperature}"


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_tiny_temperature_is_greedy_and_fails_no_batch_mate(
    redis_url: str, workers: Any, tiny_llama: Path
) -> None:
    """temperature=1e-39 passes every check (>= 0) but overflowed logprobs / temperature to
    -inf everywhere: torch.multinomial raised inside the decode step, and the worker answered
    every request it held "the model failed" (a 200-token generation decoded beside it too).
    Its limit, the argmax, is drawn instead; the batch mate is untouched."""
    workers(redis_url, model=str(tiny_llama), kv_cache_mb=64, max_batch=8)
    prompt = [4, 5, 6]
    async with await RemoteLM.connect(redis_url, model=str(tiny_llama)) as lm:
        alone = await lm.sample(PROMPT, 200, [], seed=3)
        greedy = await lm.sample(prompt, 5, [], temperature=0.0)
        lm.clear_cache()
        await lm.clear_shared_cache()
        mate = asyncio.create_task(lm.sample(PROMPT, 200, [], seed=3))
        await asyncio.sleep(0.05)
        tiny = await lm.sample(prompt, 5, [], temperature=1e-39, seed=1)
        assert tiny == greedy
        assert await mate == alone


def test_a_generation_that_cannot_draw_fails_alone(sharp: HFBackend) -> None:
    """A draw that raises (a NaN temperature, which the worker's checks refuse before this)
    fails its own generation, not the others of its decode step (before: the step raised,
    and the worker answered every request it held with that error)."""
    params = {"max_tokens": 20, "eos": [], "seed": 2}
    mate = Work("sample", PROMPT, None, {**params, "temperature": 1.0})
    bad = Work("sample", [4, 5], None, {**params, "temperature": float("nan")})
    sharp.submit([mate, bad])
    done: list[Work] = []
    while sharp.has_work():
        done += sharp.step()
    assert bad in done and "no distribution" in str(bad.error)
    assert mate.error is None and mate.result is not None
    assert mate.result.tolist() == sharp.sample(PROMPT, 20, [], 1.0, 2, None)


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_cancelled_generation_stops(redis_url: str, workers: Any) -> None:
    """A 60,000-token sample (~3 ms a token on this mock: minutes) whose caller cancels it
    after 1 s, long before its 30 s deadline: nobody waits for it any more, and the worker
    stops it, so a SIGTERM right after stops the worker in seconds (it runs a generation in
    hand to its end or its deadline)."""
    w = workers(redis_url, backend="mock", mock_vocab_size=300, mock_delay_ms=3)
    async with await RemoteLM.connect(redis_url, model="mock-300", timeout_s=30.0) as lm:
        task = asyncio.create_task(lm.sample([1, 2], 60_000, [], seed=1))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(2.0)
    started = time.monotonic()
    assert await asyncio.to_thread(w.terminate, 40) == 0, w.log()
    assert time.monotonic() - started < 10
