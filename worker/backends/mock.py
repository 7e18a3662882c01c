"""Deterministic mock backend: any vocabulary size, no model, seeded by the prompt itself.

Like genlm-backend's ``MockAsyncLM``, the distribution for a prompt is a pure function of its
token ids (and adapter), so every worker process returns the same tensor for the same prompt:
one fixed random logit vector, rotated and sharpened by a hash of the prompt.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time

import torch

from shared.tokenizer import byte_tokenizer
from worker.backends.base import Backend, ModelInfo


class MockBackend(Backend):
    name = "mock"

    def __init__(
        self,
        vocab_size: int,
        fail_on: frozenset[int] = frozenset(),
        crash_on: frozenset[int] = frozenset(),
        delay_ms: float = 0.0,
    ) -> None:
        super().__init__()
        tokenizer = byte_tokenizer(vocab_size)
        self.fail_on = fail_on
        self.crash_on = crash_on
        self.delay_ms = delay_ms
        self.info = ModelInfo(
            name_or_path=f"mock-{vocab_size}",
            fingerprint=f"mock-v1-{vocab_size}",
            vocab_size=vocab_size,
            max_length=1 << 16,
            eos_token_ids=[vocab_size - 1],
            bos_token_id=None,
            dtype="float32",
            device="cpu",
            tokenizer_json=tokenizer.backend_tokenizer.to_str(),
            tokenizer_config={"eos_token": tokenizer.eos_token},
        )

    def _row(self, ids: list[int], lora: str | None) -> torch.Tensor:
        if self.crash_on.intersection(ids):
            os._exit(70)  # a model that takes the whole process down (segfault, OOM kill)
        if self.fail_on.intersection(ids):
            raise RuntimeError(f"mock model fails on token ids {sorted(self.fail_on)}")
        seed_src = repr((ids, lora)).encode()
        seed = int.from_bytes(hashlib.blake2b(seed_src, digest_size=8).digest(), "little")
        # one random logit vector, turned and sharpened per prompt: as cheap as a model that
        # answers in a few microseconds (drawing V normal numbers per row cost ~0.2 ms)
        shift, scale = seed % self.info.vocab_size, 0.5 + ((seed >> 32) & 0xFFFF) / 0xFFFF
        return torch.log_softmax(torch.roll(self._logits, shift) * scale, dim=-1)

    @functools.cached_property
    def _logits(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        return torch.randn(self.info.vocab_size, generator=g) * 3

    def add_lora(self, name: str, path: str) -> None:
        """Adapters change nothing here but the rows' seed (``_row`` hashes the name)."""
        self.info.adapters = sorted({*self.info.adapters, name})

    def remove_lora(self, name: str) -> bool:
        if name not in self.info.adapters:
            return False
        self.info.adapters = [a for a in self.info.adapters if a != name]
        return True

    def logprobs(self, prompts: list[list[int]], lora: str | None) -> torch.Tensor:
        if self.delay_ms:
            time.sleep((self.delay_ms + 0.1 * len(prompts)) / 1000)
        self._count(prompts)
        return torch.stack([self._row(p, lora) for p in prompts])

    def score(self, prompt: list[int], continuation: list[int], lora: str | None) -> torch.Tensor:
        rows = [prompt + continuation[:i] for i in range(len(continuation))]
        self._count(rows[:1])
        lp = torch.stack([self._row(r, lora) for r in rows])
        return lp.gather(1, torch.tensor(continuation).unsqueeze(1)).squeeze(1)
