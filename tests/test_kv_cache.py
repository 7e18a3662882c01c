"""worker.backends.hf.kv_cache through HFBackend on a tiny random Llama: exact results, reuse,
bytes, pins, the slot arena's cap and its work per step.

Every cached result is compared with the no-cache path (``kv_cache_mb=0``) at 1e-4 (float32).
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from poolkit import build_tiny_llama, smc_batches
from torch.overrides import TorchFunctionMode
from transformers import LlamaForCausalLM

from shared.settings import Settings
from worker.backends.hf import HFBackend, attention, kv_slots
from worker.backends.hf.kv_buffers import PassBuffers
from worker.backends.hf.kv_cache import (
    DEFER_MIN_ROWS,
    HEAD_MIN_TOKENS,
    SHARE_MIN_TOKENS,
    KVCache,
)
from worker.backends.hf.kv_trie import GROW_MAX_TOKENS
from worker.metrics import Metrics

VOCAB = 1000
ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    return build_tiny_llama(path, VOCAB, num_attention_heads=4, num_key_value_heads=2)


def make_backend(model_dir: Path, kv_cache_mb: int) -> HFBackend:
    return HFBackend(Settings(model=str(model_dir), kv_cache_mb=kv_cache_mb))


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> HFBackend:
    backend = make_backend(model_dir, 0)
    assert backend.kv_cache is None
    return backend


def cache_of(backend: HFBackend) -> KVCache:
    assert backend.kv_cache is not None
    return backend.kv_cache


def check(backend: HFBackend, reference: HFBackend, batch: list[list[int]]) -> torch.Tensor:
    got = backend.logprobs(batch, None)
    want = reference.logprobs(batch, None)
    assert got.shape == want.shape == (len(batch), VOCAB)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    return got


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


@pytest.mark.parametrize("settles_later", [False, True])
def test_cached_matches_uncached_over_smc_steps(
    model_dir: Path, reference: HFBackend, settles_later: bool
) -> None:
    """With ``settles_later`` (as in a worker), a step's stores wait for ``settle`` or the
    next call (``cached_length`` here, before the step: it settles first)."""
    backend = make_backend(model_dir, 4)
    backend.settles_later = settles_later
    cache = cache_of(backend)
    mixed = left = 0
    for batch in smc_batches(VOCAB, seed=1):
        lengths = {cache.cached_length(p) for p in batch}
        mixed = max(mixed, len(lengths))
        check(backend, reference, batch)
        left += backend.unsettled()
    assert mixed >= 3, "batches should mix rows with different cached lengths"
    assert bool(left) == settles_later
    backend.settle()
    assert not backend.unsettled()
    assert cache.measured_bytes() == cache.bytes_used > 0


def test_a_deferred_store_lands_with_settle_and_before_any_other_use(
    model_dir: Path, reference: HFBackend
) -> None:
    backend = make_backend(model_dir, 4)
    cache = cache_of(backend)
    rng = random.Random(17)
    n = DEFER_MIN_ROWS
    prompts = [tokens(rng, 30) for _ in range(n)]
    size = cache.layout.token_bytes()

    cache.last_logits(prompts[:1], defer=True)  # one row: stored at once (cheaper so)
    assert not cache.unsettled and cache.bytes_used == 30 * size
    got = cache.last_logits(prompts, defer=True)
    assert cache.unsettled and cache.bytes_used == 30 * size and cache.entries == 1
    cache.settle()
    assert not cache.unsettled and cache.bytes_used == 30 * n * size
    assert cache.measured_bytes() == cache.bytes_used

    # left for later, then another call: it stores them first and reuses them
    more = [p + tokens(rng, 2) for p in prompts]
    cache.last_logits(more, defer=True)
    assert cache.unsettled
    computed = cache.tokens_computed
    check(backend, reference, [p + tokens(rng, 1) for p in more])
    assert cache.tokens_computed - computed == n
    assert not cache.unsettled

    # a budget cut, a pin, a drop: each settles first
    cache.last_logits([[*p, 1] for p in prompts], defer=True)
    assert cache.pin(prompts[1]) == 30 * size and not cache.unsettled
    cache.last_logits([[*p, 2] for p in prompts], defer=True)
    cache.set_budget(cache.budget_bytes)
    assert not cache.unsettled
    cache.last_logits([[*p, 3] for p in prompts], defer=True)
    cache.drop(None)
    assert not cache.unsettled and cache.bytes_used == 0 and cache.arena.used_slots == 0
    cache.last_logits(prompts, defer=True)
    cache.clear()  # gives everything back, what was left for later too
    assert not cache.unsettled and cache.bytes_used == 0
    torch.testing.assert_close(got, cache.last_logits(prompts), atol=ATOL, rtol=0)


def test_eager_attention_matches_plain_forward(model_dir: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    cache = KVCache(model, 1 << 20, pad_id=0)
    rng = random.Random(2)
    base = tokens(rng, 30)
    for step in range(4):
        batch = [base + tokens(rng, step + 1), base[: 10 + step], tokens(rng, 7), base]
        got = cache.last_logits(batch)
        with torch.inference_mode():
            for row, prompt in enumerate(batch):
                want = model(input_ids=torch.tensor([prompt])).logits[0, -1]
                torch.testing.assert_close(got[row], want, atol=ATOL, rtol=0)


def test_reuse_counters(model_dir: Path, reference: HFBackend) -> None:
    backend = make_backend(model_dir, 4)
    cache = cache_of(backend)
    rng = random.Random(3)
    prefix = tokens(rng, 100)
    parts = [list(prefix) for _ in range(8)]
    check(backend, reference, [prefix])
    for _ in range(10):
        parts = [p + tokens(rng, 1) for p in parts]
        before = cache.tokens_computed
        check(backend, reference, parts)
        # Every parent is cached: one new token per distinct particle.
        assert cache.tokens_computed - before == len({tuple(p) for p in parts})
        parts = [list(rng.choice(parts)) for _ in parts]
    stats = backend.kv_stats()
    assert stats["tokens_requested"] == 100 + sum(8 * (100 + i) for i in range(1, 11))
    assert stats["tokens_computed"] <= 100 + 80
    assert stats["tokens_computed"] < stats["tokens_requested"] / 40
    assert stats["tokens_reused"] >= stats["tokens_requested"] - 180
    assert stats["entries"] > 0 and stats["bytes_used"] == cache.measured_bytes()


def stored_tokens(cache: KVCache) -> int:
    return sum(len(node.tokens) for node in cache._lru)


def test_eviction_stays_in_budget_and_exact(model_dir: Path, reference: HFBackend) -> None:
    backend = make_backend(model_dir, 1)
    cache = cache_of(backend)
    per_token = cache.layout.token_bytes()
    assert per_token == 2 * 2 * (16 + 16) * 4  # layers x kv heads x (key + value dim) x float32
    budget = 150 * per_token
    cache.set_budget(budget)
    for seed in (4, 5):
        for batch in smc_batches(VOCAB, seed=seed, prefix=80, steps=8):
            check(backend, reference, batch)
            assert cache.bytes_used <= budget
            # Real storage, measured by walking the trie, is exactly the stored positions.
            assert cache.measured_bytes() == cache.bytes_used == stored_tokens(cache) * per_token
    assert cache.evictions > 0
    # The budget is honoured when it shrinks, and what is left still serves exact results.
    cache.set_budget(40 * per_token)
    assert cache.measured_bytes() == cache.bytes_used <= 40 * per_token
    for batch in smc_batches(VOCAB, seed=4, prefix=80, steps=3):
        check(backend, reference, batch)
        assert cache.bytes_used <= 40 * per_token


def test_lru_evicts_dead_particles_not_the_live_prefix(
    model_dir: Path, reference: HFBackend
) -> None:
    backend = make_backend(model_dir, 1)
    cache = cache_of(backend)
    budget = 400 * cache.layout.token_bytes()
    cache.set_budget(budget)
    rng = random.Random(9)
    parts = [tokens(rng, 80)] * 8
    for step in range(60):
        parts = [p + tokens(rng, 1) for p in parts]
        before = cache.tokens_computed
        got = backend.logprobs(parts, None)
        if step % 15 == 0:
            torch.testing.assert_close(got, reference.logprobs(parts, None), atol=ATOL, rtol=0)
        if step:  # the shared prefix and live lineages stay: one token per distinct particle
            assert cache.tokens_computed - before == len({tuple(p) for p in parts})
        assert cache.bytes_used <= budget
        parts = [rng.choice(parts) for _ in parts]
    assert cache.evictions > 0


def test_prompts_sharing_a_prefix_all_stay_cached(model_dir: Path, reference: HFBackend) -> None:
    backend = make_backend(model_dir, 4)
    cache = cache_of(backend)
    rng = random.Random(6)
    system = tokens(rng, 40)
    assert len(system) >= SHARE_MIN_TOKENS
    # One batch of 16 prompts over an uncached shared prefix: the prefix runs once, is stored
    # once, and every one of the 16 stays cached (genlm-backend 0.3.1 kept 1 of 16).
    batch = [system + tokens(rng, 5) for _ in range(16)]
    check(backend, reference, batch)
    assert cache.tokens_computed == 40 + 16 * 5
    assert cache.bytes_used == (40 + 16 * 5) * cache.layout.token_bytes()
    assert all(cache.cached_length(p) == len(p) for p in batch)

    # Branches inside stored segments split them: every branch is kept, nothing stored twice.
    branches = [p[:42] + tokens(rng, 3) for p in batch] + [system[:20] + tokens(rng, 4)]
    before = cache.tokens_computed
    check(backend, reference, branches)
    assert cache.tokens_computed - before == 16 * 3 + 4
    assert all(cache.cached_length(p) == len(p) for p in batch + branches)
    stored = 40 + 16 * 5 + 16 * 3 + 4
    assert cache.measured_bytes() == cache.bytes_used == stored * cache.layout.token_bytes()

    # 16 producers run their own particles over the same prefix; their batches interleave
    # and arrive from 4 threads at once.
    runs = [[p] * 4 for p in batch]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(6):
            runs = [[p + tokens(rng, 1) for p in run] for run in runs]
            rows = [p for run in runs for p in run]
            rng.shuffle(rows)
            chunks = [rows[i : i + 8] for i in range(0, len(rows), 8)]
            results = pool.map(lambda c: backend.logprobs(c, None), chunks)
            for chunk, got in zip(chunks, results, strict=True):
                torch.testing.assert_close(got, reference.logprobs(chunk, None), atol=ATOL, rtol=0)
    for run in runs:
        assert all(cache.cached_length(p) == len(p) for p in run)
    # The next step of every producer computes one token per distinct particle, nothing more.
    nxt = [p + tokens(rng, 1) for run in runs for p in run]
    before = cache.tokens_computed
    check(backend, reference, nxt)
    assert cache.tokens_computed - before == len({tuple(p) for p in nxt})


def test_a_later_pass_reads_what_it_was_planned_from_though_an_earlier_one_split_it(
    model_dir: Path, reference: HFBackend
) -> None:
    # One batch, two forward passes (eight one-token rows first, then a ten-token row): the
    # first pass's rows branch inside the stored 40-token prompt, splitting its node eight
    # times, before the second pass gathers that node's positions for its own row.
    backend = make_backend(model_dir, 4)
    cache = cache_of(backend)
    rng = random.Random(16)
    prompt = tokens(rng, 40)
    check(backend, reference, [prompt])
    batch = [prompt[: 20 + i] + tokens(rng, 1) for i in range(8)] + [prompt + tokens(rng, 10)]
    passes = cache.forward_passes
    check(backend, reference, batch)
    assert cache.forward_passes - passes == 2
    assert all(cache.cached_length(p) == len(p) for p in batch)
    assert cache.measured_bytes() == cache.bytes_used


def test_pin_keeps_a_prefix(model_dir: Path, reference: HFBackend) -> None:
    backend = make_backend(model_dir, 1)
    cache = cache_of(backend)
    per_token = cache.layout.token_bytes()
    cache.set_budget(120 * per_token)
    rng = random.Random(7)
    prefix = tokens(rng, 50)

    def flood() -> None:
        for _ in range(6):
            check(backend, reference, [tokens(rng, 30) for _ in range(3)])
            assert cache.bytes_used <= 120 * per_token

    assert backend.pin_prefix(prefix)
    assert cache.pinned_bytes == 50 * per_token
    flood()
    assert cache.cached_length(prefix) == 50
    before = cache.tokens_computed
    check(backend, reference, [[*prefix, 3], [*prefix[:20], 4]])
    assert cache.tokens_computed - before == 2
    assert not backend.pin_prefix(tokens(rng, 100)), "pins beyond the budget are refused"
    assert cache.bytes_used <= 120 * per_token

    assert cache.unpin(prefix)
    flood()
    assert cache.cached_length(prefix) < 50
    cache.clear()
    assert cache.bytes_used == cache.entries == cache.measured_bytes() == 0
    check(backend, reference, [prefix])


def test_namespaces_and_off_switch(model_dir: Path, reference: HFBackend) -> None:
    backend = make_backend(model_dir, 4)
    cache = cache_of(backend)
    prompt = tokens(random.Random(8), 12)
    cache.last_logits([prompt], namespace="adapter-a")
    assert cache.cached_length(prompt, namespace="adapter-a") == 12
    assert cache.cached_length(prompt) == 0
    # namespaces share the arena; dropping one (an unloaded adapter) frees its slots only
    cache.last_logits([prompt, [*prompt[:5], 1, 2]])
    per_token = cache.layout.token_bytes()
    assert cache.measured_bytes() == cache.bytes_used == (12 + 12 + 2) * per_token
    cache.drop("adapter-a")
    assert cache.cached_length(prompt, namespace="adapter-a") == 0
    assert cache.measured_bytes() == cache.bytes_used == 14 * per_token
    assert cache.arena.used_slots == 14
    assert reference.kv_stats()["bytes_used"] == 0
    assert not reference.pin_prefix(prompt)


def test_a_sequence_decoded_token_by_token_keeps_a_short_path(
    model_dir: Path, reference: HFBackend
) -> None:
    """Each step's new position grows the sequence's leaf segment in place (up to
    GROW_MAX_TOKENS tokens) instead of hanging a one-token node under it: the path a request
    walks, and the pieces its past is gathered from, stay few however long the decoding runs.
    Two sequences that branch from one leaf split it, as before."""
    backend = make_backend(model_dir, 4)
    cache = cache_of(backend)
    rng = random.Random(11)
    prompt = tokens(rng, 40)
    check(backend, reference, [prompt])
    seq = list(prompt)
    for _ in range(GROW_MAX_TOKENS + 10):
        seq.append(rng.randrange(VOCAB))
        check(backend, reference, [seq])
    # the prompt's leaf grew to the cap, then a new segment started and grew: two nodes for
    # the 114 positions, where one node per step would have made 75
    lengths = sorted(len(node.tokens) for node in cache._lru)
    assert lengths == sorted([GROW_MAX_TOKENS, len(seq) - GROW_MAX_TOKENS])
    per_token = cache.layout.token_bytes()
    assert cache.measured_bytes() == cache.bytes_used == stored_tokens(cache) * per_token
    # two particles continuing one sequence: the grown leaf is split where they branch
    a, b = [*seq, 1], [*seq, 2]
    check(backend, reference, [a, b])
    assert cache.cached_length(a) == len(a) and cache.cached_length(b) == len(b)
    assert cache.measured_bytes() == cache.bytes_used == stored_tokens(cache) * per_token


def test_scores_reuse_the_shared_context(model_dir: Path, reference: HFBackend) -> None:
    """Multiple-choice scores through the cache: each question's context runs once, and every
    score (greedy flags too) equals the no-cache path's; choices of several lengths, some of
    one token (their row is the context alone), and duplicates in one batch."""
    backend = make_backend(model_dir, 4)
    cache = cache_of(backend)
    rng = random.Random(5)
    contexts = [tokens(rng, 40) for _ in range(3)]
    items = [(ctx, tokens(rng, n)) for ctx in contexts for n in (1, 3, 6, 2)]
    items.append(items[1])
    computed = cache.tokens_computed
    got = backend.score_many(items, None, greedy=True)
    want = reference.score_many(items, None, greedy=True)
    for g, w, (_, cont) in zip(got, want, items, strict=True):
        assert isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor)
        assert g.shape == (len(cont), 2)
        torch.testing.assert_close(g[:, 0], w[:, 0], atol=ATOL, rtol=0)
        assert torch.equal(g[:, 1], w[:, 1])
    # the contexts once, then each choice's own tokens (all but its last token run)
    once = sum(map(len, contexts)) + sum(len(c) - 1 for _, c in items[:-1])
    assert cache.tokens_computed - computed <= once + len(items)
    plain = backend.score(contexts[0], items[2][1], None)
    torch.testing.assert_close(plain, want[2][:, 0], atol=ATOL, rtol=0)  # type: ignore[index]


def test_a_prefix_every_row_shares_is_attended_in_place(
    model_dir: Path, reference: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows over one cached prompt of at least ``HEAD_MIN_TOKENS``: the prompt is attended in
    place (``attention.shared_prefix``), not copied into every row's past, and the results
    equal the no-cache path's: SMC steps with duplicates, rows of several new tokens padded
    beside one-token rows, and scores over the prompt."""
    heads: list[int] = []
    cascade = attention._cascade

    def counted(query: torch.Tensor, prefix: Any, *args: Any) -> torch.Tensor:
        heads.append(prefix[0].shape[1])
        return cascade(query, prefix, *args)

    monkeypatch.setattr(attention, "_cascade", counted)
    backend = make_backend(model_dir, 8)
    rng = random.Random(12)
    prompt = tokens(rng, HEAD_MIN_TOKENS + 20)
    check(backend, reference, [prompt])
    assert heads == []  # one row: nothing to share
    parts = [list(prompt) for _ in range(6)]
    for _ in range(4):
        parts = [p + tokens(rng, 1) for p in parts]
        check(backend, reference, parts)
        parts = [list(rng.choice(parts)) for _ in parts]
    assert heads and set(heads) == {len(prompt)}
    # several new tokens beside one: padded rows (a mask) over the same head
    before = len(heads)
    check(backend, reference, [parts[0] + tokens(rng, 1), parts[1] + tokens(rng, 5)])
    assert len(heads) > before
    items = [(parts[2], tokens(rng, 3)), (parts[3], tokens(rng, 1)), (prompt, tokens(rng, 4))]
    got = backend.score_many(items, None)
    want = reference.score_many(items, None)
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor)
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    # a short shared prompt is gathered as before
    before = len(heads)
    short = tokens(rng, HEAD_MIN_TOKENS // 2)
    check(backend, reference, [short])
    check(backend, reference, [short + tokens(rng, 1) for _ in range(4)])
    assert len(heads) == before


class _CountOps(TorchFunctionMode):
    """Counts the torch functions and tensor methods called while active, allocations aside
    (the pass's scratch buffer is allocated again when a pass is the largest yet)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += func is not torch.empty
        return func(*args, **(kwargs or {}))


def test_a_step_costs_the_same_tensor_operations_for_8_particles_as_for_64(
    model_dir: Path,
) -> None:
    """The cache's work per SMC step does not grow with the particles: the pasts are read, and
    the new positions written, in a fixed number of tensor operations for all rows (one arena
    gather and one write a side), so a step of 64 particles calls exactly as many torch
    operations as a step of 8, the model's included."""
    counts = {}
    for n in (8, 64):
        backend = make_backend(model_dir, 8)
        rng = random.Random(13)
        prompt = tokens(rng, HEAD_MIN_TOKENS + 8)
        backend.logprobs([prompt], None)
        parts = [prompt + tokens(rng, 1) for _ in range(n)]
        for _ in range(3):  # each particle's own leaf exists and grows from here on
            backend.logprobs(parts, None)
            parts = [p + tokens(rng, 1) for p in parts]
        with _CountOps() as ops:
            backend.logprobs(parts, None)
        counts[n] = ops.calls
        cache = cache_of(backend)
        assert (
            cache.measured_bytes()
            == cache.bytes_used
            == stored_tokens(cache) * (cache.layout.token_bytes())
        )
    assert counts[8] == counts[64], counts


def test_an_arena_at_its_cap_stores_what_fits_and_stays_exact(
    model_dir: Path, reference: HFBackend
) -> None:
    """The arena holds at most the budget and a quarter more; a pass with more new positions
    than that stores the rows that fit, answers every row exactly, and leaves the cache within
    its budget with every slot accounted for. ``clear`` gives the memory back."""
    backend = make_backend(model_dir, 1)
    cache = cache_of(backend)
    per_token = cache.layout.token_bytes()
    cache.set_budget(20 * per_token)
    assert cache.arena.max_slots == 25
    rng = random.Random(14)
    batch = [tokens(rng, 10) for _ in range(4)]  # 40 new positions, room for 25
    check(backend, reference, batch)
    assert cache.arena.capacity == 25
    assert backend.kv_stats()["arena_bytes"] == 26 * per_token  # and the zero slot
    assert sum(cache.cached_length(p) == len(p) for p in batch) == 2  # the third did not fit
    assert cache.measured_bytes() == cache.bytes_used == 20 * per_token
    for _ in range(3):
        batch = [p + tokens(rng, 2) for p in batch]
        check(backend, reference, batch)
        assert cache.bytes_used <= 20 * per_token
        assert cache.measured_bytes() == cache.bytes_used == stored_tokens(cache) * per_token
    cache.clear()
    assert cache.arena.capacity == cache.arena.used_slots == cache.bytes_used == 0
    assert cache.stats()["arena_bytes"] == per_token
    metrics = Metrics("m", "hf")
    metrics.observe_kv(backend.kv_stats())
    assert metrics.registry.get_sample_value(
        "lmpool_kv_arena_bytes", {"model": "m", "backend": "hf"}
    ) == float(per_token)
    check(backend, reference, batch)
    assert cache.measured_bytes() == cache.bytes_used > 0


def test_the_arena_gathers_every_vector_of_a_pass_into_its_place() -> None:
    """``SlotArena.gather``: position ``t`` of row ``r`` in layer ``l``, head ``h`` of the
    buffers holds slot ``slots[r, t]``'s vector of that layer and head (the zero slot's zeros
    where it is named), for keys and values of different widths."""
    layout = kv_slots.Layout(3, 2, 4, 5, torch.float32, torch.device("cpu"))
    arena = kv_slots.SlotArena(layout)
    arena.set_budget(1 << 20)
    got = arena.alloc(12)
    assert got is not None
    keys = torch.randn(12, 3, 2, 4)
    values = torch.randn(12, 3, 2, 5)
    arena.write(got, keys, values)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, 12, size=(4, 7))
    slots = got[picks]
    slots[1, 5:] = kv_slots.ZERO_SLOT
    buf_k, buf_v = torch.full((3, 4, 2, 7, 4), float("nan")), torch.full((3, 4, 2, 7, 5), 7.0)
    arena.gather(slots, buf_k, buf_v)
    for r in range(4):
        for t in range(7):
            named = r == 1 and t >= 5
            want_k = torch.zeros(3, 2, 4) if named else keys[picks[r, t]]
            want_v = torch.zeros(3, 2, 5) if named else values[picks[r, t]]
            assert torch.equal(buf_k[:, r, :, t], want_k), (r, t)
            assert torch.equal(buf_v[:, r, :, t], want_v), (r, t)
    with pytest.raises(ValueError, match="do not fit"):
        arena.gather(slots, buf_k[:, :3].contiguous(), buf_v[:, :3].contiguous())
    with pytest.raises(ValueError, match="do not fit"):
        arena.gather(slots, buf_k.transpose(3, 4), buf_v)


def test_a_pass_reads_its_rows_pasts_in_one_gather_a_pass(
    model_dir: Path, reference: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lone rows and batches alike fill their buffers with one ``gather``, with the same
    answers; nothing else reads the arena (no scratch copy in between)."""
    backend = make_backend(model_dir, 4)
    cache = cache_of(backend)
    gathers: list[tuple[int, int]] = []
    gather = cache.arena.gather

    def counted(slots: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
        gathers.append(slots.shape)
        gather(slots, keys, values)

    def no_read(slots: Any) -> Any:
        raise AssertionError("the pasts were read outside gather")

    monkeypatch.setattr(cache.arena, "gather", counted)
    monkeypatch.setattr(cache.arena, "read", no_read)
    batches = list(smc_batches(VOCAB, seed=15, prefix=20, steps=4))
    for batch in batches:
        check(backend, reference, batch)
        before = len(gathers)
        check(backend, reference, [[*batch[0], 5]])  # a lone row one token on
        assert len(gathers) == before + 1 and gathers[-1][0] == 1
    assert max(rows for rows, _ in gathers) > 1  # batches too, not only lone rows


def test_pass_buffers_grow_by_half_so_a_growing_smc_run_keeps_its_memory() -> None:
    """An SMC step's pasts are one position longer than the last step's: the buffers' memory
    grows by half when it must, instead of fresh memory (every page faulted in again) at every
    step; the views handed out have the shapes asked for."""
    buffers = PassBuffers(torch.device("cpu"), torch.float32)
    sizes = set()
    for width in range(10, 31):
        keys, values = buffers.take((2, 4, 3, width), 8, 6)
        assert keys.shape == (2, 4, 3, width, 8) and values.shape == (2, 4, 3, width, 6)
        assert keys.is_contiguous() and values.is_contiguous()
        assert keys.untyped_storage().data_ptr() == values.untyped_storage().data_ptr()
        sizes.add(keys.untyped_storage().nbytes())
    # 10, 15, 22 and 33 positions' worth: 4 allocations, not 21
    assert len(sizes) == 4


def test_the_counters_are_read_at_once_while_a_pass_runs(model_dir: Path) -> None:
    """The worker's heartbeat reads the counters in its event loop (``kv_stats``) while the
    compute thread runs a pass. The read waited for the pass: a pass of long prompts on a CPU
    froze the event loop and its heartbeats until the worker counted as dead (producers
    connecting got ``NoWorker``, its shards went to others, SIGTERM waited a minute). Now it
    returns at once, with the counters as the last pass left them."""
    backend = make_backend(model_dir, 4)
    before = backend.kv_stats()
    entered, release = threading.Event(), threading.Event()

    def slow_pass(*_: Any) -> None:  # a forward pass that lasts until released
        entered.set()
        release.wait(5)

    hook = backend.model.register_forward_pre_hook(slow_pass)
    with ThreadPoolExecutor(1) as pool:
        step = pool.submit(backend.logprobs, [[1, 2, 3]], None)
        try:
            assert entered.wait(30)
            t0 = time.monotonic()
            during = backend.kv_stats()
            took = time.monotonic() - t0
        finally:
            release.set()
            hook.remove()
        step.result(timeout=30)
    assert took < 1.0, f"kv_stats waited {took:.1f}s for the pass"
    assert during == before
    assert backend.kv_stats()["forward_passes"] == before["forward_passes"] + 1
