"""The hf backend's KV cache against the same model without one, over seeded random workloads:
SMC particles extending a shared prompt (resampled: duplicated and dropped), cold prompts,
prefixes of earlier rows and rows equal to cached ones in the same batch, shuffled batches,
scores, pins and unpins, budgets small enough to evict, stores deferred or not. Every row
within 1e-4 of the reference (float32; measured at most 1.9e-6 over 350 seeds), and after
every operation the cache's invariants: no slot lost or shared (``measured_bytes``), within
its budget unless what is left is pinned, the arena within its cap.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from poolkit import build_tiny_llama

from shared.settings import Settings
from worker.backends.hf import HFBackend
from worker.backends.hf.kv_trie import ancestry

VOCAB = 1000
ATOL = 1e-4
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kv-fuzz")
    fat = {"hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 4}
    return {
        "gqa": build_tiny_llama(root / "gqa", VOCAB, num_attention_heads=4, num_key_value_heads=2),
        # 4 layers x 8 key/value heads x 32 x 2 x 4 bytes: 8 KiB a token, so budgets evict
        "fat": build_tiny_llama(
            root / "fat", VOCAB, num_attention_heads=8, num_key_value_heads=8, **fat
        ),
    }


def check_invariants(backend: HFBackend, where: str) -> None:
    cache = backend.kv_cache
    assert cache is not None
    assert cache.measured_bytes() >= 0, f"{where}: a slot lost or shared"
    kept: set[object] = set()
    for node in cache._pinned:
        kept.update(ancestry(node))
    over = cache.bytes_used > cache.budget_bytes
    assert not (over and any(n not in kept for n in cache._lru)), f"{where}: over budget"
    assert cache.arena.capacity <= cache.arena.max_slots, f"{where}: arena past its cap"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("kind", "budget"), [("gqa", None), ("fat", 8192 * 40)])
def test_the_cache_answers_as_the_model_without_it(
    models: dict[str, Path], seed: int, kind: str, budget: int | None
) -> None:
    torch.set_num_threads(1)
    rng = random.Random(seed)
    cached = HFBackend(Settings(model=str(models[kind]), kv_cache_mb=1))
    plain = HFBackend(Settings(model=str(models[kind]), kv_cache_mb=0))
    assert cached.kv_cache is not None
    if budget is not None:
        cached.kv_cache.set_budget(budget)
    cached.settles_later = rng.random() < 0.5

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB - 1) for _ in range(n)]

    prefix = tokens(rng.choice([1, 5, 31, 32, 40, 70, 130]))
    particles = [list(prefix) for _ in range(rng.choice([1, 2, 8, 9, 16]))]
    history: list[list[int]] = []
    pins: list[list[int]] = []
    for step in range(rng.randrange(8, 30)):
        where = f"seed {seed}, {kind}, step {step}"
        op = rng.random()
        if op < 0.6:  # an SMC step, with company
            particles = [p + tokens(1) for p in particles]
            batch = [list(p) for p in particles]
            if rng.random() < 0.3:
                batch.append(tokens(rng.randrange(1, 80)))
            if history and rng.random() < 0.4:
                row = rng.choice(history)
                batch.append(row[: rng.randrange(1, len(row) + 1)])
            if history and rng.random() < 0.3:
                batch.append(list(rng.choice(history)))
            if rng.random() < 0.2:
                batch.append(prefix[: rng.randrange(1, len(prefix) + 1)])
            if rng.random() < 0.3:
                rng.shuffle(batch)
            error = (cached.logprobs(batch, None) - plain.logprobs(batch, None)).abs().max()
            assert float(error) <= ATOL, where
            history.extend(batch)
            particles = [list(rng.choice(particles)) for _ in particles]
        elif op < 0.8:  # scores
            items = []
            for _ in range(rng.randrange(1, 6)):
                base = rng.choice([*history, prefix]) if rng.random() < 0.6 else tokens(20)
                items.append((base[: rng.randrange(1, len(base) + 1)], tokens(rng.randrange(40))))
            for got, want in zip(
                cached.score_many(items, None), plain.score_many(items, None), strict=True
            ):
                assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor), where
                assert got.shape == want.shape, where
                assert len(got) == 0 or float((got - want).abs().max()) <= ATOL, where
            history.extend(p + c for p, c in items)
        elif pins and rng.random() < 0.5:
            cached.unpin_prefix(pins.pop(rng.randrange(len(pins))))
        else:
            base = rng.choice([*history, prefix])
            pin = base[: rng.randrange(1, len(base) + 1)]
            if cached.pin_prefix(pin):
                pins.append(pin)
        check_invariants(cached, where)
