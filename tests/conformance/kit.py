"""Constants and helpers of the conformance suite (fixtures are in ``conftest.py``).

Tolerances: max abs difference of float32 log-probs from one unpadded transformers forward of
the same files, measured on 47 prompts of 1 to 60 tokens (2 CPU cores):
- reference (genlm-backend ``AsyncTransformer``): 1.9e-6 async (padded auto-batches), 0.0 sync;
- pool (hf worker, float32 on the CPU, 1 torch thread): 1.9e-6 async and sync;
- pool against reference, row for row: 1.9e-6;
- with the LoRA adapter, both subjects against the merged-weights forward: 2.4e-6;
- ``|logsumexp(row)|``: 4.8e-7 for both.
``TOL`` and ``LORA_TOL`` are about 5x those, ``LSE_TOL`` 10x.
"""

from __future__ import annotations

import copy
import gc
import inspect
import random
import secrets
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from poolkit import ALPHA, RANK, reference_logprobs

SUBJECTS = ("reference", "pool")
TOL = 1e-5
LORA_TOL = 1e-5
LSE_TOL = 5e-6
VOCAB = 1000
EOS = VOCAB - 1
"""The byte tokenizer's ``<|endoftext|>`` (the model's EOS)."""
PROMPTS = [[1, 5, 9], [1, 7, 8, 9, 10, 11], [1, 3], [1, 5, 9]]
MODEL_SHAPE: dict[str, Any] = {
    # poolkit.build_model's shape, so poolkit.build_adapter's LoRA fits; the tokenizer is the
    # byte-level one of poolkit.build_tiny_llama because genlm-backend's decode_vocab cannot
    # decode build_model's word-level tokenizer (ByteVocabError), so no AsyncTransformer could
    # be built on it.
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.05,
}
NO_ARRAY_IDS = (
    "genlm-backend 0.3.1 lacks it: AsyncTransformer takes a list of ids "
    "(`if not token_ids` raises on a 1-D array or tensor of more than one element)"
)


def skip_reference(subject: str, reason: str) -> None:
    """Skip this case for the reference: genlm-backend lacks the feature (``reason`` says how)."""
    if subject == "reference":
        pytest.skip(f"reference: {reason}")


def direct(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """One unpadded transformers forward: the last position's log-probs."""
    return reference_logprobs(model, [int(i) for i in ids])


def assert_row(row: Any, ids: Sequence[int], model: Any, tol: float = TOL) -> None:
    """A normalized float32 CPU row of ``VOCAB`` that equals the direct forward."""
    assert isinstance(row, torch.Tensor)
    assert row.dtype == torch.float32
    assert tuple(row.shape) == (VOCAB,)
    assert row.device.type == "cpu"
    assert abs(float(torch.logsumexp(row, dim=-1))) <= LSE_TOL
    diff = float((row - direct(model, ids)).abs().max())
    assert diff <= tol, f"max abs diff {diff:.3g} from the direct forward for {list(ids)}"


def assert_rows(rows: Any, prompts: Sequence[Sequence[int]], model: Any, tol: float = TOL) -> None:
    assert isinstance(rows, torch.Tensor)
    assert rows.dtype == torch.float32
    assert tuple(rows.shape) == (len(prompts), VOCAB)
    assert rows.device.type == "cpu"
    for row, ids in zip(rows, prompts, strict=True):
        assert_row(row, ids, model, tol)


def fresh_prompts(n: int, length: int = 6) -> list[list[int]]:
    """Prompts no earlier call asked for (so the pool answers them from a worker, not a cache)."""
    rng = random.Random(secrets.randbits(64))
    return [[1, *(rng.randrange(3, EOS) for _ in range(length - 1))] for _ in range(n)]


def no_coroutine_left(value: Any) -> None:
    """What a plain method returned is no coroutine, and no coroutine was dropped unawaited
    (collected now, with its "never awaited" RuntimeWarning an error)."""
    assert not inspect.iscoroutine(value), f"returned a coroutine: {value!r}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gc.collect()


def merged(model: Any, adapter: Path) -> Any:
    """``model`` with the PEFT LoRA adapter merged in: W + (alpha / r) * B @ A (as in
    tests/test_backend_suite.py)."""
    from safetensors.torch import load_file

    out = copy.deepcopy(model)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    for name, a in tensors.items():
        if not name.endswith("lora_A.weight"):
            continue
        b = tensors[name.replace("lora_A", "lora_B")]
        module = out.get_submodule(
            name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        )
        with torch.no_grad():
            module.weight += (ALPHA / RANK) * b @ a
    return out
