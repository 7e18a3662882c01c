"""One behavioural suite for every backend that can run here, against transformers in-process.

Per-backend tolerances (float32, max abs diff of log-probs), as measured on this model:
- hf:   reference 1e-5 (measured ~1e-6), batched vs one-by-one 1e-5, LoRA 1e-5
- vllm: reference 1e-5 (measured 1.9e-6), batched vs one-by-one 1e-5, LoRA 2e-5 (1.9e-6)
- hf-cuda (hf on a CUDA device, float32; gpu-marked): reference 1e-4, batched 1e-4, LoRA 1e-4
- vllm-cuda (a CUDA build of vLLM, float32): hf-cuda's bounds, passed on an H200 (2026-11-28,
  bench/results/gpu-tests-h200-vllm.txt; the differences were not printed); vLLM's
  ``auto`` dtype turns a float32 checkpoint into bfloat16 on CUDA (4e-2 off, seen on an H100),
  so every backend here runs with ``dtype="float32"``. vLLM's LoRA kernels on CUDA take float16
  or bfloat16 only: there the engine has no adapter and the LoRA test is skipped
  (tests/test_vllm_backend.py checks vLLM's LoRA on CUDA in float16)
vLLM runs only where it is installed (``make test-vllm`` runs this file in .venv-vllm).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from poolkit import ALPHA, EOS, RANK, build_adapter, build_model, reference_logprobs

from shared.errors import InvalidRequest, UnknownAdapter
from shared.settings import Settings

TOLERANCE = {"hf": 1e-5, "vllm": 1e-5, "hf-cuda": 1e-4, "vllm-cuda": 1e-4}
BATCH_TOLERANCE = {"hf": 1e-5, "vllm": 1e-5, "hf-cuda": 1e-4, "vllm-cuda": 1e-4}
LORA_TOLERANCE = {"hf": 1e-5, "vllm": 2e-5, "hf-cuda": 1e-4}
BACKENDS = [
    "hf",
    pytest.param("hf-cuda", marks=pytest.mark.gpu),
    pytest.param(
        "vllm",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("vllm") is None, reason="vLLM not installed here"
        ),
    ),
]
PROMPTS = [[1, 5, 9], [1, 7, 8, 9, 10, 11], [1, 3], [1, 5, 9]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("suite")
    return build_model(root / "model"), build_adapter(root / "lora")


@pytest.fixture(scope="module", params=BACKENDS)
def kind(request: pytest.FixtureRequest) -> str:
    """A backend name, ``-cuda`` when it runs on a CUDA device (vLLM: where its build does)."""
    if request.param.endswith("-cuda"):
        assert torch.cuda.is_available(), "the gpu-marked tests need a CUDA device"
    if request.param == "vllm":
        from vllm.platforms import current_platform

        if current_platform.device_type == "cuda":
            return "vllm-cuda"
    return str(request.param)


@pytest.fixture(scope="module")
def backend(kind: str, files: tuple[Path, Path]) -> Iterator[Any]:
    from worker.backends import load_backend

    name, _, device = kind.partition("-")
    model, lora = files
    b = load_backend(
        Settings(
            backend=name,
            model=str(model),
            lora="" if kind == "vllm-cuda" else f"a={lora}",
            kv_cache_mb=0,
            device=device or "auto",
            dtype="float32",
        )
    )
    yield b
    b.close()


@pytest.fixture(scope="module")
def reference(files: tuple[Path, Path]) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(files[0], dtype=torch.float32).eval()


def merged(reference: Any, lora: Path) -> Any:
    """The reference with the adapter merged in: W + (alpha / r) * B @ A."""
    import copy

    from safetensors.torch import load_file

    model = copy.deepcopy(reference)
    for name, a in load_file(str(lora / "adapter_model.safetensors")).items():
        if not name.endswith("lora_A.weight"):
            continue
        b = load_file(str(lora / "adapter_model.safetensors"))[name.replace("lora_A", "lora_B")]
        module = model.get_submodule(
            name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        )
        with torch.no_grad():
            module.weight += (ALPHA / RANK) * b @ a
    return model


def test_logprobs_match_the_reference(kind: str, backend: Any, reference: Any) -> None:
    rows = backend.logprobs(PROMPTS, None).float().cpu()
    for row, ids in zip(rows, PROMPTS, strict=True):
        assert (row - reference_logprobs(reference, ids)).abs().max() <= TOLERANCE[kind]
    assert torch.equal(rows[0], rows[3]), "duplicates in a batch give the same row"


def test_batched_equals_one_by_one(kind: str, backend: Any) -> None:
    batched = backend.logprobs(PROMPTS, None).float().cpu()
    for row, ids in zip(batched, PROMPTS, strict=True):
        alone = backend.logprobs([ids], None)[0].float().cpu()
        assert (row - alone).abs().max() <= BATCH_TOLERANCE[kind]


def test_score_matches_next_token_rows(kind: str, backend: Any, reference: Any) -> None:
    prompt, cont = [1, 4], [6, 7, 8]
    scores = backend.score(prompt, cont, None).float().cpu()
    expect = torch.stack(
        [reference_logprobs(reference, prompt + cont[:i])[t] for i, t in enumerate(cont)]
    )
    assert (scores - expect).abs().max() <= TOLERANCE[kind]


def test_greedy_scores_flag_each_argmax(kind: str, backend: Any, reference: Any) -> None:
    """``greedy=True``: ``[n, 2]``, the same log-probs and 1.0 where the token is the argmax."""
    prompt: list[int] = [1, 4]
    cont: list[int] = []
    for _ in range(3):  # the reference's greedy continuation, then its least likely token
        cont.append(int(reference_logprobs(reference, prompt + cont).argmax()))
    cont.append(int(reference_logprobs(reference, prompt + cont).argmin()))
    out = backend.score(prompt, cont, None, greedy=True).float().cpu()
    assert out.shape == (4, 2) and out[:, 1].tolist() == [1.0, 1.0, 1.0, 0.0]
    plain = backend.score(prompt, cont, None).float().cpu()
    assert (out[:, 0] - plain).abs().max() <= TOLERANCE[kind]


def test_seeded_sampling_is_reproducible(backend: Any) -> None:
    a = backend.sample([1, 5], 12, [EOS], 1.0, 123, None)
    b = backend.sample([1, 5], 12, [EOS], 1.0, 123, None)
    assert a == b and len(a) <= 12 and EOS not in a


def test_lora_matches_the_merged_reference(
    kind: str, backend: Any, reference: Any, files: tuple[Path, Path]
) -> None:
    if kind == "vllm-cuda":
        pytest.skip("vLLM's LoRA kernels on CUDA take float16 or bfloat16, the suite float32")
    with_lora = merged(reference, files[1])
    rows = backend.logprobs(PROMPTS[:2], "a").float().cpu()
    for row, ids in zip(rows, PROMPTS[:2], strict=True):
        assert (row - reference_logprobs(with_lora, ids)).abs().max() <= LORA_TOLERANCE[kind]
        assert (row - reference_logprobs(reference, ids)).abs().max() > 1e-3  # the adapter matters
    with pytest.raises(UnknownAdapter):
        backend.check_prompt(1, "b", 0)
    with pytest.raises(InvalidRequest, match="exceeds the limit"):
        backend.check_prompt(backend.info["max_length"] + 1, None, 0)
