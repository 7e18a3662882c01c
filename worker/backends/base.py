"""The small interface every backend implements, and what they share.

Backends are synchronous: the consumer calls them from a worker thread so that Redis I/O for
the next batch overlaps the forward pass.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shared.errors import InvalidRequest, UnknownAdapter


@dataclass
class ModelInfo:
    """What a backend tells the pool about its model (published to Redis for producers)."""

    name_or_path: str
    fingerprint: str
    vocab_size: int
    max_length: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    dtype: str
    device: str
    tokenizer_json: str
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    adapters: list[str] = field(default_factory=list)


def describe_model(
    *,
    model_setting: str,
    source: Path,
    tokenizer: Any,
    dtype: torch.dtype,
    vocab_size: int,
    max_length: int,
    eos_token_ids: list[int],
    device: str,
    adapters: list[str],
    variant: str = "",
) -> ModelInfo:
    """The ``ModelInfo`` of a checkpoint loaded from ``source`` (a directory or a GGUF file).

    The fingerprint covers the weights and the compute dtype (and ``variant``, e.g. a
    quantization), not the engine: hf and vLLM results of one model share cache entries.
    """
    from shared.tokenizer import tokenizer_config
    from worker.model_files import files_fingerprint

    dtype_name = str(dtype).replace("torch.", "")
    return ModelInfo(
        name_or_path=str(model_setting or source.stem),
        fingerprint=f"{files_fingerprint(source)}-{dtype_name}{variant}",
        vocab_size=vocab_size,
        max_length=max_length,
        eos_token_ids=eos_token_ids,
        bos_token_id=tokenizer.bos_token_id,
        dtype=dtype_name,
        device=device,
        tokenizer_json=tokenizer.backend_tokenizer.to_str(),
        tokenizer_config=tokenizer_config(tokenizer),
        adapters=sorted(adapters),
    )


class Backend(ABC):
    """A model the pool can query. Subclasses set ``info`` in ``__init__``."""

    name: str = "base"
    info: ModelInfo

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rows_computed = 0
        """Prompt rows run through the model: the dedupe tests count these."""
        self.tokens_computed = 0

    # -- validation shared by every backend ---------------------------------------------
    def check_prompt(self, ids: list[int], lora: str | None, max_prompt_tokens: int) -> None:
        """Raise ``InvalidRequest`` for ids the model cannot take."""
        if not ids:
            raise InvalidRequest("empty prompt: at least one token id is needed")
        limit = min(max_prompt_tokens or self.info.max_length, self.info.max_length)
        if len(ids) > limit:
            raise InvalidRequest(f"prompt of {len(ids)} tokens exceeds the limit of {limit}")
        v = self.info.vocab_size
        for i in ids:
            if type(i) is not int or not 0 <= i < v:
                raise InvalidRequest(f"token id {i!r} is not an integer in [0, {v})")
        if lora is not None and lora not in self.info.adapters:
            known = ", ".join(self.info.adapters) or "none"
            raise UnknownAdapter(f"unknown LoRA adapter {lora!r}; loaded: {known}")

    def _count(self, prompts: list[list[int]]) -> None:
        with self._lock:
            self.rows_computed += len(prompts)
            self.tokens_computed += sum(map(len, prompts))

    # -- the interface ------------------------------------------------------------------
    @abstractmethod
    def logprobs(self, prompts: list[list[int]], lora: str | None) -> torch.Tensor:
        """Normalized next-token log-probs, ``[len(prompts), vocab_size]``."""

    @abstractmethod
    def score(self, prompt: list[int], continuation: list[int], lora: str | None) -> torch.Tensor:
        """Log-prob of each continuation token given all before it, ``[len(continuation)]``."""

    def sample(
        self,
        prompt: list[int],
        max_tokens: int,
        eos_token_ids: list[int],
        temperature: float,
        seed: int | None,
        lora: str | None,
    ) -> list[int]:
        """A generation with genlm-backend's semantics (EOS not appended).

        The default draws each token from ``softmax(logprobs / temperature)`` with a CPU
        generator seeded by ``seed``, so the same seed gives the same tokens on any worker.
        """
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        out: list[int] = []
        for _ in range(max_tokens):
            logp = self.logprobs([prompt + out], lora)[0].float().cpu()
            token = draw(logp, temperature, generator)
            if token in eos_token_ids:
                break
            out.append(token)
        return out

    def close(self) -> None:
        """Free the model and its device memory."""


def draw(logprobs: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """One token from ``softmax(logprobs / temperature)`` (genlm-backend's rule)."""
    probs = torch.softmax(logprobs.float().cpu() / temperature, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator).item())
