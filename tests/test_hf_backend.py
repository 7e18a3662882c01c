"""The hf backend in-process: batched against one-by-one, scoring and sampling rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.errors import InvalidRequest
from shared.settings import Settings
from worker.backends.hf import HFBackend
from worker.backends.hf.backend import score_passes
from worker.backends.rows import draw


@pytest.fixture(scope="module")
def backend(tiny_llama: Path) -> HFBackend:
    return HFBackend(Settings(model=str(tiny_llama), kv_cache_mb=0))


def single(b: HFBackend, ids: list[int], keep: int = 0) -> torch.Tensor:
    """Reference: one prompt alone (``keep=1``: LM head on the last position only)."""
    with torch.inference_mode():
        logits = b.model(torch.tensor([ids]), logits_to_keep=keep).logits[0, -1]
    return torch.log_softmax(logits.float(), -1)


def test_equal_length_batch_matches_one_by_one(backend: HFBackend) -> None:
    # genlm-backend checks batched == sequential at max_rel_err == 0; on this machine's BLAS a
    # 3-row and a 1-row GEMM round differently, so the bound is 1e-6 (measured: ~1e-7).
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4]]
    rows = backend.logprobs(prompts, None)
    for row, ids in zip(rows, prompts, strict=True):
        assert (row - single(backend, ids, keep=1)).abs().max().item() <= 1e-6
        assert (row - single(backend, ids)).abs().max().item() <= 1e-6


def test_mixed_length_batch_within_tolerance(backend: HFBackend) -> None:
    prompts = [[1], [2, 3, 4, 5, 6, 7], [8, 9]]
    rows = backend.logprobs(prompts, None)
    for row, ids in zip(rows, prompts, strict=True):
        assert (row - single(backend, ids)).abs().max().item() <= 1e-5
    assert torch.allclose(rows.exp().sum(-1), torch.ones(3), atol=1e-5)


def test_score_is_one_forward_equal_to_next_token_rows(backend: HFBackend) -> None:
    rows_before = backend.rows_computed
    s = backend.score([10, 11], [12, 13, 14], None)
    assert backend.rows_computed == rows_before + 1
    expect = [single(backend, [10, 11, 12, 13][: 2 + i])[t] for i, t in enumerate([12, 13, 14])]
    assert torch.allclose(s, torch.stack(expect), atol=1e-5)


def test_score_passes_bound_each_pass_and_cover_every_position_once() -> None:
    lengths = [2, 0, 10, 1, 3, 4, 7]
    most = 4
    passes = score_passes(lengths, most)
    covered: dict[int, list[tuple[int, int]]] = {}
    for group in passes:
        assert len(group) * max(end - start for _, start, end in group) <= most
        for k, start, end in group:
            covered.setdefault(k, []).append((start, end))
    for k, n in enumerate(lengths):
        spans = covered.get(k, [])
        assert [p for s, e in spans for p in range(s, e)] == list(range(n)), (k, spans)
    assert [k for k, _, _ in passes[-3]] == [2]  # the long one alone, its pieces in order
    assert score_passes([5, 5], 100) == [[(0, 0, 5), (1, 0, 5)]]  # within the bound: one pass
    assert score_passes([], 4) == [] and score_passes([0, 0], 4) == []


@pytest.mark.parametrize("kv_cache_mb", [0, 64])
@pytest.mark.parametrize("greedy", [False, True])
def test_long_continuations_run_in_bounded_passes_with_the_same_scores(
    tiny_llama: Path, kv_cache_mb: int, greedy: bool
) -> None:
    """At most 3 logit positions a pass (LMPOOL_MAX_LOGITS_MB at its smallest is far more for
    this vocabulary: the bound is set on the backend): a 10-token continuation runs in four
    pieces, two short ones beside it in passes of their own, and each score equals the one
    computed in a single pass (<= 1e-5), empty continuations give empty scores; with the KV
    cache every position runs once (each piece only its own tokens)."""
    b = HFBackend(Settings(model=str(tiny_llama), kv_cache_mb=kv_cache_mb))
    items = [([10, 11, 12], list(range(20, 30))), ([5], [6, 7]), ([8, 9], []), ([4, 4], [3])]
    whole = b.score_many(items, None, greedy)
    b.close()
    b = HFBackend(Settings(model=str(tiny_llama), kv_cache_mb=kv_cache_mb))
    b.score_positions = 3
    passes: list[int] = []
    forward = b.model.forward

    def counted(*args: object, **kwargs: object) -> object:
        passes.append(1)
        return forward(*args, **kwargs)

    b.model.forward = counted
    pieces = b.score_many(items, None, greedy)
    assert len(passes) == len(score_passes([10, 2, 0, 1], 3)) == 6
    for got, want, (_, cont) in zip(pieces, whole, items, strict=True):
        assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
        assert got.shape == want.shape == ((len(cont), 2) if greedy else (len(cont),))
        if cont:
            assert (got - want).abs().max().item() <= 1e-5
        if greedy:
            assert torch.equal(got[:, 1], want[:, 1])  # the argmax flags, exactly
    if kv_cache_mb:
        b.settle()
        assert b.kv_stats()["tokens_computed"] == sum(len(p) + len(c) - 1 for p, c in items if c)
    b.close()


def test_sample_follows_the_seeded_rule(backend: HFBackend) -> None:
    """The KV-cached generation draws what genlm-backend's loop would draw."""
    out = backend.sample([3, 4], 6, [319], 0.7, 5, None)
    g = torch.Generator().manual_seed(5)
    ids: list[int] = [3, 4]
    expect: list[int] = []
    for _ in range(6):
        t = draw(single(backend, ids + expect), 0.7, g)
        if t == 319:
            break
        expect.append(t)
    assert out == expect


def test_check_prompt_rejects_bad_prompts(backend: HFBackend) -> None:
    with pytest.raises(InvalidRequest, match="empty prompt"):
        backend.check_prompt(0, None, 0)
    with pytest.raises(InvalidRequest, match="exceeds the limit of 4"):
        backend.check_prompt(5, None, 4)
    with pytest.raises(InvalidRequest, match=f"exceeds the limit of {backend.info['max_length']}"):
        backend.check_prompt(backend.info["max_length"] + 1, None, 0)


def test_cpu_attention_reads_grouped_heads_in_place(tiny_llama: Path) -> None:
    """On the CPU the backend's models use worker.backends.hf.attention, which equals
    transformers' own SDPA (grouped heads copied) on masked grouped-query batches (<= 1e-6)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from worker.backends.hf import attention

    b = HFBackend(Settings(model=str(tiny_llama), device="cpu", kv_cache_mb=0))
    assert b.model.config._attn_implementation == attention.NAME
    g = torch.Generator().manual_seed(0)
    query = torch.randn(3, 6, 5, 16, generator=g)  # 6 query heads over 2 key/value heads
    key, value = torch.randn(3, 2, 9, 16, generator=g), torch.randn(3, 2, 9, 16, generator=g)
    mask = torch.ones(3, 1, 5, 9, dtype=torch.bool).tril(diagonal=4)
    mask[1, :, :, :3] = False  # a row with a padded past
    module = torch.nn.Module()
    module.num_key_value_groups = 3  # type: ignore[assignment]
    module.is_causal = True  # type: ignore[assignment]
    got, _ = attention.cpu_gqa_sdpa(module, query, key, value, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert got.shape == want.shape == (3, 5, 6, 16)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
