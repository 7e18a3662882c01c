"""The hf backend on a CUDA device: the answers of float32 transformers on the CPU, pool included.

Run on a CUDA machine with ``make test-gpu`` (``pytest -m gpu``). Tolerances are max abs diffs
of log-probs against float32 transformers on the CPU (tiny random models); each test records the
diff it measured as a junit property (``pytest -m gpu --junitxml=gpu.xml``):
- float32 on CUDA: <= 1e-4 (different kernels, same precision);
- bfloat16 on CUDA: <= 0.1 (8 mantissa bits through 2 layers and a 1000-way softmax);
- the KV cache on CUDA against the no-cache path on CUDA, float32: <= 1e-4, as on the CPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from poolkit import build_tiny_llama, reference_logprobs, smc_batches
from transformers import AutoModelForCausalLM

from producer import RemoteLM
from shared.settings import Settings
from worker.backends.hf import HFBackend

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
VOCAB = 1000
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}
PROMPTS = [[1, 5, 9], [1, 7, 8, 9, 10, 11], [1, 3], list(range(40, 90))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert torch.cuda.is_available(), "the gpu-marked tests need a CUDA device"
    path = tmp_path_factory.mktemp("tiny-llama")
    return build_tiny_llama(path, VOCAB, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def cpu_model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def worst(rows: Any, model: Any, prompts: list[list[int]]) -> float:
    return max(
        float((row.float().cpu() - reference_logprobs(model, ids)).abs().max())
        for row, ids in zip(rows, prompts, strict=True)
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backend_on_cuda_matches_float32_on_cpu(
    model_dir: Path, cpu_model: Any, dtype: str, record_property: Callable[[str, Any], None]
) -> None:
    backend = HFBackend(Settings(model=str(model_dir), device="cuda", dtype=dtype, kv_cache_mb=0))
    try:
        assert backend.info["device"].startswith("cuda")
        assert backend.info["dtype"] == dtype
        rows = backend.logprobs(PROMPTS, None)
        assert rows.shape == (len(PROMPTS), VOCAB)
        diff = worst(rows, cpu_model, PROMPTS)
        record_property(f"max_abs_diff_{dtype}", diff)
        assert diff <= TOLERANCE[dtype], diff
        assert dtype == "float32" or diff > 0, "bfloat16 should differ from float32 somewhere"
    finally:
        backend.close()


def test_kv_cache_on_cuda_matches_no_cache(
    model_dir: Path, record_property: Callable[[str, Any], None]
) -> None:
    def make(kv_cache_mb: int) -> HFBackend:
        return HFBackend(Settings(model=str(model_dir), device="cuda", kv_cache_mb=kv_cache_mb))

    cached, plain = make(8), make(0)
    try:
        assert cached.kv_cache is not None and plain.kv_cache is None
        diff = 0.0
        for batch in smc_batches(VOCAB, seed=3, prefix=80, steps=8):
            got, want = cached.logprobs(batch, None), plain.logprobs(batch, None)
            diff = max(diff, float((got.float() - want.float()).abs().max()))
        record_property("max_abs_diff_kv", diff)
        assert diff <= TOLERANCE["float32"], diff
        stats = cached.kv_cache.stats()
        assert stats["tokens_reused"] > stats["tokens_computed"], stats
    finally:
        cached.close()
        plain.close()


@pytest.mark.parametrize("kv_cache_mb", [0, 64])
@pytest.mark.asyncio
async def test_pool_with_a_cuda_worker(
    redis_url: str,
    workers: Callable[..., Any],
    model_dir: Path,
    cpu_model: Any,
    kv_cache_mb: int,
    record_property: Callable[[str, Any], None],
) -> None:
    worker = workers(
        redis_url, model=str(model_dir), device="cuda", kv_cache_mb=kv_cache_mb, max_batch=8
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in range(1, 60, 4)]
    prompts += [prompts[-1] + [5], prompts[-1] + [6, 7]]
    async with await RemoteLM.connect(redis_url, model=str(model_dir)) as lm:
        assert str(lm.meta.get("device", "")).startswith("cuda"), lm.meta
        if kv_cache_mb:
            await lm.cache_kv(prompts[-1])
        got = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        diff = worst(got, cpu_model, prompts)
        record_property(f"max_abs_diff_pool_kv{kv_cache_mb}", diff)
        assert diff <= TOLERANCE["float32"], diff
        a = await lm.sample(prompts[2], 8, [VOCAB - 1], seed=11)
        lm.clear_cache()
        assert await lm.sample(prompts[2], 8, [VOCAB - 1], seed=11) == a
    assert worker.terminate() == 0, worker.log()
