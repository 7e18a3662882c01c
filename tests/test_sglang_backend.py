"""The SGLang backend around its engine boundary (CI has no CUDA), and the real engine on a GPU.

The engine stand-in answers ``batch_next_token_logprobs_sync`` with the hf backend's rows, so
what is checked here is the adaptation: model info, scoring from prefix rows, sampling rule,
errors, and how lmpool's settings become SGLang's server arguments. The gpu-marked tests run
SGLang itself, in the process and as a pool's worker, against float32 transformers on the CPU
(tolerance 0.1: SGLang computes in bfloat16 there) where ``pip install lmpool[sglang]`` and a
CUDA device are present.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from shared.errors import InvalidRequest, SettingsError
from shared.settings import Settings
from worker.backends import load_backend
from worker.backends.hf import HFBackend
from worker.backends.sglang import INSTALL_HINT, SGLangBackend, engine_options


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
    """The stand-in's rows: on the CPU, as the backend hands them out, on any machine."""
    return HFBackend(Settings(model=str(tiny_llama), device="cpu", kv_cache_mb=0))


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


def test_prompts_sglang_would_refuse_are_refused_first(tiny_llama: Path, hf: HFBackend) -> None:
    """SGLang's scheduler refuses a prompt of ``max_req_input_len`` tokens or more, and its
    refusal reaches genlm-backend's driver as the row after the one token 0 (the request is
    aborted, not failed): the worker publishes and checks the scheduler's limit instead of the
    model's ``max_position_embeddings`` (512 here), and the context of LMPOOL_MAX_MODEL_LEN."""

    def factory(path: Path, settings: Settings) -> Any:
        engine = EngineStandIn(hf)
        engine.model.model_config.context_len = 256  # SGLang's context_length, from the setting
        engine.model.max_req_input_len = 250
        return engine

    b = SGLangBackend(
        Settings(model=str(tiny_llama), device="cuda", max_model_len=256), engine_factory=factory
    )
    assert b.info["max_length"] == 256
    assert b.prompt_limit(0) == 249 and b.prompt_limit(10) == 10
    b.check_prompt(249, None, 0)
    with pytest.raises(InvalidRequest, match="exceeds the limit of 249"):
        b.check_prompt(250, None, 0)


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


def test_settings_become_server_arguments(tiny_llama: Path) -> None:
    def options(**settings: Any) -> dict[str, Any]:
        return engine_options(Settings(model=str(tiny_llama), device="cuda", **settings))

    assert options() == {
        "dtype": "auto",
        "mem_fraction_static": 0.9,
        "disable_radix_cache": False,
        "disable_cuda_graph": False,
    }
    got = options(
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        prefix_caching=False,
        enforce_eager="true",
        max_model_len=256,
        quantization="fp8",
        engine_options='{"mem_fraction_static": 0.2, "attention_backend": "triton"}',
    )
    assert got == {
        "dtype": "bfloat16",
        "mem_fraction_static": 0.2,  # LMPOOL_ENGINE_OPTIONS over lmpool's own
        "disable_radix_cache": True,
        "disable_cuda_graph": True,
        "context_length": 256,
        "quantization": "fp8",
        "attention_backend": "triton",
    }
    with pytest.raises(SettingsError, match="LMPOOL_QUANTIZATION=8bit"):
        options(quantization="8bit")
    with pytest.raises(SettingsError, match="LMPOOL_TENSOR_PARALLEL_SIZE must be 1"):
        options(tensor_parallel_size=2)


def test_settings_it_cannot_serve_fail_before_the_engine_loads(tiny_llama: Path) -> None:
    def never(path: Path, settings: Settings) -> Any:
        raise AssertionError("the engine must not start")

    with pytest.raises(SettingsError, match="bitsandbytes"):
        SGLangBackend(
            Settings(model=str(tiny_llama), device="cuda", quantization="bitsandbytes"),
            engine_factory=never,
        )


# -- SGLang itself, on a CUDA device --------------------------------------------------------------
# The model: head dim 64 (SGLang's FlashAttention-3 kernels on Hopper take 64, 128, 256). SGLang
# computes in bfloat16 here, so its rows are held to float32 transformers on the CPU at 0.1, as
# the hf backend's bfloat16 rows are in tests/test_gpu.py.
GPU_TOLERANCE = 0.1
GPU_PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [1, 2, 3], list(range(10, 200))]


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from poolkit import build_tiny_llama

    return build_tiny_llama(
        tmp_path_factory.mktemp("tiny-hd64"),
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


@pytest.fixture(scope="module")
def cpu_reference(gpu_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gpu_model, dtype=torch.float32).eval()


def gpu_settings(model: Path, share: float, **settings: Any) -> dict[str, Any]:
    """Two SGLang engines share the GPU in these tests. SGLang's ``mem_fraction_static``
    (LMPOOL_GPU_MEMORY_UTILIZATION) is the share of the device it may fill up to, whatever
    others hold: the module's engine takes 0.2, the worker started later 0.5."""
    return {
        "model": str(model),
        "backend": "sglang",
        "device": "cuda",
        "dtype": "bfloat16",
        "gpu_memory_utilization": share,
        **settings,
    }


def worst(rows: Any, reference: Any, prompts: list[list[int]]) -> float:
    from poolkit import reference_logprobs

    return max(
        float((torch.as_tensor(row).float().cpu() - reference_logprobs(reference, ids)).abs().max())
        for row, ids in zip(rows, prompts, strict=True)
    )


@pytest.fixture(scope="module")
def sglang(gpu_model: Path) -> Iterator[Any]:
    pytest.importorskip("sglang", reason="pip install lmpool[sglang] to run this test")
    assert torch.cuda.is_available(), "the gpu-marked tests need a CUDA device"
    b = load_backend(Settings(**gpu_settings(gpu_model, 0.2)))  # CUDA graphs on: the default
    yield b
    b.close()


@pytest.mark.gpu
def test_sglang_matches_float32_transformers(
    sglang: Any, cpu_reference: Any, record_property: Callable[[str, Any], None]
) -> None:
    assert sglang.info["device"] == "cuda" and sglang.info["vocab_size"] == 320
    rows = sglang.logprobs(GPU_PROMPTS, None)
    assert rows.shape == (len(GPU_PROMPTS), 320) and rows.dtype == torch.float32
    diff = worst(rows, cpu_reference, GPU_PROMPTS)
    record_property("max_abs_diff_sglang_bf16", diff)
    assert 0 < diff <= GPU_TOLERANCE, diff
    alone = torch.stack([sglang.logprobs([p], None)[0] for p in GPU_PROMPTS])
    batched = float((alone - rows).abs().max())
    record_property("max_abs_diff_batched_vs_alone", batched)
    assert batched <= GPU_TOLERANCE, batched


@pytest.mark.gpu
def test_sglang_scores_and_samples(sglang: Any, cpu_reference: Any) -> None:
    from poolkit import reference_logprobs

    prompt, continuation = [1, 2, 3], [40, 41, 42, 43]
    got = sglang.score(prompt, continuation, None)
    want = torch.stack(
        [
            reference_logprobs(cpu_reference, prompt + continuation[:i])[t]
            for i, t in enumerate(continuation)
        ]
    )
    assert float((got - want).abs().max()) <= GPU_TOLERANCE
    first = sglang.sample(prompt, 6, [319], 1.0, 5, None)
    assert sglang.sample(prompt, 6, [319], 1.0, 5, None) == first and 0 < len(first) <= 6


@pytest.mark.gpu
def test_sglang_reads_the_longest_prompt_it_publishes(
    sglang: Any, cpu_reference: Any, record_property: Callable[[str, Any], None]
) -> None:
    """The limit comes from SGLang's scheduler (``max_req_input_len`` less one: 505 for this
    512-position model) and a prompt that long is read whole. One token more, asked of the
    engine directly, is what the worker now refuses: its row (SGLang aborts the request and
    runs the one token 0 in its place) is recorded, not held to anything."""
    limit = sglang.prompt_limit(0)
    assert limit == sglang.engine.model.max_req_input_len - 1 < sglang.info["max_length"] == 512
    ids = [1 + i % 300 for i in range(limit + 1)]
    diff = worst(sglang.logprobs([ids[:limit]], None), cpu_reference, [ids[:limit]])
    assert diff <= GPU_TOLERANCE, diff
    try:
        over = worst(sglang.engine.batch_next_token_logprobs_sync([ids]), cpu_reference, [ids])
        record_property("max_abs_diff_one_token_over_the_limit", over)
    except Exception as e:  # what SGLang does there is recorded, whatever it is
        record_property("one_token_over_the_limit", f"{type(e).__name__}: {e}"[:200])


@pytest.mark.gpu
@pytest.mark.asyncio
@pytest.mark.timeout(600)
async def test_pool_with_an_sglang_worker(
    redis_url: str,
    workers: Callable[..., Any],
    gpu_model: Path,
    cpu_reference: Any,
    record_property: Callable[[str, Any], None],
) -> None:
    pytest.importorskip("sglang", reason="pip install lmpool[sglang] to run this test")
    from producer import RemoteLM

    worker = workers(redis_url, **gpu_settings(gpu_model, 0.5, enforce_eager="true", max_batch=8))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 319, (n,), generator=g).tolist() for n in range(1, 60, 4)]
    prompts += [prompts[-1] + [5], prompts[-1] + [6, 7]]
    async with await RemoteLM.connect(redis_url, model=str(gpu_model)) as lm:
        assert lm.meta.get("backend") == "sglang", lm.meta
        got = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
        diff = worst(got, cpu_reference, prompts)
        record_property("max_abs_diff_pool_sglang", diff)
        assert diff <= GPU_TOLERANCE, diff
        a = await lm.sample(prompts[2], 8, [319], seed=11)
        lm.clear_cache()
        assert await lm.sample(prompts[2], 8, [319], seed=11) == a
    assert worker.terminate() == 0, worker.log()


def test_a_quantized_engine_is_another_model_for_the_caches(
    hf: HFBackend, tiny_llama: Path
) -> None:
    """Weights quantized as SGLang loads them (``LMPOOL_QUANTIZATION=fp8``) give other rows: its
    fingerprint differs from the unquantized model's, so no cache entry is shared (it was the
    same: a quantized worker answered from, and into, the float model's entries)."""

    def factory(path: Path, settings: Settings) -> Any:
        return EngineStandIn(hf)

    q = SGLangBackend(
        Settings(model=str(tiny_llama), device="cuda", quantization="fp8"), engine_factory=factory
    )
    assert q.info["fingerprint"] == hf.info["fingerprint"] + "-fp8"
