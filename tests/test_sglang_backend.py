"""The SGLang backend around its engine boundary (CI has no CUDA), and the real engine on a GPU.

The engine stand-in answers ``batch_next_token_logprobs_sync`` with the hf backend's rows, so
what is checked here is the adaptation: model info, scoring from prefix rows, sampling rule,
errors. ``test_sglang_on_gpu`` runs SGLang itself against transformers (tolerance 1e-2 in
bf16/fp16) where ``pip install lmpool[sglang]`` and a CUDA device are present.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shared.errors import SettingsError
from shared.settings import Settings
from worker.backends import load_backend
from worker.backends.hf import HFBackend
from worker.backends.sglang import INSTALL_HINT, SGLangBackend


class EngineStandIn:
    """What SGLangBackend uses of genlm-backend's AsyncSGLTransformer."""

    def __init__(self, hf: HFBackend) -> None:
        self.hf = hf
        self.tokenizer = hf.tokenizer
        self.model = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf.model.config))
        self.calls: list[list[list[int]]] = []
        self.cleaned = False

    def batch_next_token_logprobs_sync(self, prompts: list[list[int]]) -> torch.Tensor:
        self.calls.append(prompts)
        return self.hf.logprobs(prompts, None)

    def _cleanup_engine(self) -> None:
        self.cleaned = True


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> HFBackend:
    return HFBackend(Settings(model=str(tiny_llama), kv_cache_mb=0))


@pytest.fixture
def backend(tiny_llama: Path, hf: HFBackend) -> tuple[SGLangBackend, EngineStandIn]:
    engines: list[EngineStandIn] = []

    def factory(path: Path, settings: Settings) -> Any:
        engines.append(EngineStandIn(hf))
        return engines[-1]

    b = SGLangBackend(Settings(model=str(tiny_llama), device="cuda"), engine_factory=factory)
    return b, engines[0]


def test_model_info_comes_from_the_engine(backend: Any, hf: HFBackend) -> None:
    b, _ = backend
    assert b.info["vocab_size"] == hf.info["vocab_size"] == 320
    assert b.info["eos_token_ids"] == hf.info["eos_token_ids"] == [319]
    assert b.info["fingerprint"] == hf.info["fingerprint"]  # same weights, same dtype: shared cache
    assert b.info["max_length"] == 512 and b.info["device"] == "cuda"


def test_logprobs_and_score(backend: Any, hf: HFBackend) -> None:
    b, engine = backend
    rows = b.logprobs([[1, 2], [3]], None)
    assert torch.equal(rows, hf.logprobs([[1, 2], [3]], None))
    engine.calls.clear()
    s = b.score([1, 2], [3, 4, 5], None)
    assert engine.calls == [[[1, 2], [1, 2, 3], [1, 2, 3, 4]]], "one engine call for all prefixes"
    expect = torch.stack(
        [hf.logprobs([[1, 2, 3, 4][: 2 + i]], None)[0][t] for i, t in enumerate([3, 4, 5])]
    )
    assert torch.allclose(s, expect, atol=1e-6)


def test_sample_is_the_seeded_rule_and_close_frees_the_engine(backend: Any, hf: HFBackend) -> None:
    b, engine = backend
    assert b.sample([1, 2], 5, [319], 1.0, 3, None) == hf.sample([1, 2], 5, [319], 1.0, 3, None)
    b.close()
    assert engine.cleaned


def test_unsupported_settings_fail_at_start_up(tiny_llama: Path) -> None:
    def never(path: Path, settings: Settings) -> Any:
        raise AssertionError("the engine must not start")

    with pytest.raises(SettingsError, match="CUDA only"):
        SGLangBackend(Settings(model=str(tiny_llama), device="cpu"), engine_factory=never)
    with pytest.raises(SettingsError, match="LMPOOL_LORA"):
        SGLangBackend(Settings(model=str(tiny_llama), lora="a=/x"), engine_factory=never)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang installed")
def test_missing_sglang_names_the_extra(tiny_llama: Path) -> None:
    with pytest.raises(ImportError, match=r"pip install lmpool\[sglang\]") as info:
        load_backend(Settings(model=str(tiny_llama), backend="sglang", device="cuda"))
    assert str(info.value) == INSTALL_HINT


@pytest.mark.gpu
def test_sglang_on_gpu(tiny_llama: Path) -> None:
    pytest.importorskip("sglang", reason="pip install lmpool[sglang] to run this test")
    b = load_backend(Settings(model=str(tiny_llama), backend="sglang", device="cuda"))
    ref = HFBackend(Settings(model=str(tiny_llama), device="cuda", kv_cache_mb=0))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [1, 2, 3]]
    diff = b.logprobs(prompts, None).float().cpu() - ref.logprobs(prompts, None).float().cpu()
    assert diff.abs().max() <= 1e-2
    b.close()
