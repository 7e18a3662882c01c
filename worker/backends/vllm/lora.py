"""LoRA adapters on the vllm backend, checked before vLLM sees them: the rank the engine must
be started with, and the modules an adapter may adapt. Runs without vLLM imported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.errors import SettingsError

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""``max_lora_rank`` values vLLM accepts."""


def lora_rank(adapters: dict[str, str]) -> int:
    """Smallest ``max_lora_rank`` vLLM accepts that fits every adapter's ``r``."""
    rank = 1
    for name, path in adapters.items():
        config = adapter_config(name, path, "LMPOOL_LORA")
        check_lora_targets(name, config, "LMPOOL_LORA")
        rank = max(rank, int(config["r"]))
    for allowed in LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise SettingsError(
        f"LMPOOL_LORA: LoRA rank {rank} exceeds vLLM's largest max_lora_rank {LORA_RANKS[-1]}"
    )


def adapter_config(name: str, path: str, where: str) -> dict[str, Any]:
    """Adapter ``name``'s ``adapter_config.json`` in folder ``path``, with a readable rank ``r``;
    errors name ``where`` (the setting or call that gave it)."""
    config_file = Path(path).expanduser() / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
        int(config["r"])
        return dict(config)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SettingsError(
            f"{where}: LoRA adapter {name}: cannot read r from {config_file}: {e}"
        ) from None


LORA_LINEAR_MODULES = (
    # the linear layers of common decoder families (Llama, Mistral, Qwen, Gemma, Phi, GPT-2,
    # GPT-NeoX, Falcon, OPT...): what a LoRA may adapt on the vllm backend
    *("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj"),
    *("gate_up_proj", "dense", "dense_h_to_4h", "dense_4h_to_h", "query_key_value", "c_attn"),
    *("c_proj", "c_fc", "fc1", "fc2", "out_proj", "in_proj", "wqkv", "wo", "w1", "w2", "w3"),
)
"""Not ``lm_head`` nor the embeddings: with a LoRA on ``lm_head``, vLLM (0.32 and earlier)
computes prompt log-probs with a per-request adapter mapping where it needs one per prompt
position, and its engine dies as soon as two requests share a step with a ``score``
(vllm-project/vllm#16668). Leaving ``lm_head`` out of the engine's LoRA targets removes that
code path: scores batch like everything else."""
UNSUPPORTED_LORA_TARGETS = ("lm_head", "embed_tokens", "wte", "word_embeddings")


def check_lora_targets(name: str, config: dict[str, Any], where: str) -> None:
    """An adapter may adapt only :data:`LORA_LINEAR_MODULES` (``all-linear`` passes)."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [] if targets == "all-linear" else [targets]
    bad = sorted({str(t) for t in targets or []} - set(LORA_LINEAR_MODULES))
    if bad:
        fix = (
            "lm_head and embedding LoRAs break vLLM's prompt log-probs (scores)"
            if set(bad) & set(UNSUPPORTED_LORA_TARGETS)
            else f"the vllm backend adapts {', '.join(LORA_LINEAR_MODULES)}"
        )
        raise SettingsError(f"{where}: LoRA adapter {name} targets {', '.join(bad)}: {fix}")
