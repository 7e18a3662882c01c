"""bitsandbytes 8-bit and 4-bit loading on the hf backend (CPU here; the GPU test is marked).

Tolerances against the float32 model (max abs diff of log-probs on the tiny model): 8-bit
<= 0.05 (measured 3.6e-3), 4-bit NF4 <= 0.5 (measured ~0.1): quantization changes results,
which is why a quantized worker has its own fingerprint and cache entries.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.settings import Settings
from worker.backends.hf import HFBackend

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]


@pytest.fixture(scope="module")
def full(tiny_llama: Path) -> HFBackend:
    """The float32 reference, on the CPU also where a GPU is present."""
    return HFBackend(Settings(model=str(tiny_llama), device="cpu", kv_cache_mb=0))


@pytest.mark.parametrize(("mode", "tolerance"), [("8bit", 0.05), ("4bit", 0.5)])
def test_quantized_close_to_float(
    tiny_llama: Path, full: HFBackend, mode: str, tolerance: float
) -> None:
    q = HFBackend(Settings(model=str(tiny_llama), kv_cache_mb=0, quantization=mode))
    assert q.info["fingerprint"] != full.info["fingerprint"]
    assert q.info["fingerprint"].endswith(f"-bnb{mode}")
    diff = (q.logprobs(PROMPTS, None) - full.logprobs(PROMPTS, None)).abs().max().item()
    assert 0 < diff <= tolerance, diff


@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "tolerance"), [("8bit", 0.05), ("4bit", 0.5)])
def test_quantized_on_gpu(
    tiny_llama: Path,
    full: HFBackend,
    mode: str,
    tolerance: float,
    record_property: Callable[[str, Any], None],
) -> None:
    assert torch.cuda.is_available(), "the gpu-marked tests need a CUDA device"
    q = HFBackend(
        Settings(model=str(tiny_llama), device="cuda", dtype="float16", quantization=mode)
    )
    assert q.info["device"].startswith("cuda") and q.info["fingerprint"].endswith(f"-bnb{mode}")
    rows = q.logprobs(PROMPTS, None)
    diff = float((rows.float().cpu() - full.logprobs(PROMPTS, None)).abs().max())
    record_property(f"max_abs_diff_bnb{mode}_cuda", diff)
    assert 0 < diff <= tolerance, diff
