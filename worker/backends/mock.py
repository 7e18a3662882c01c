"""Deterministic mock backend: any vocabulary size, no model, seeded by the prompt itself.

Like genlm-backend's ``MockAsyncLM``, the distribution for a prompt is a pure function of its
token ids (and adapter), so every worker process returns the same tensor for the same prompt:
one fixed random logit vector, sharpened to one of ``SHARPNESS_LEVELS`` levels and rotated,
both chosen by a hash of the prompt. The normalized rows of every level are computed once, so a
row costs one copy: the mock stands for a model whose own time is negligible, and benchmarks
of the pool's overhead (``bench/overhead.py``) measure the pool, not the mock.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time

import torch

from shared.registry import ModelDescription
from shared.tokenizer import byte_tokenizer
from worker.backends.base import Backend
from worker.backends.rows import with_greedy

SHARPNESS_LEVELS = 16
"""Distinct sharpness levels (temperatures 1/0.5 .. 1/1.5) of the mock's rows."""


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
        self.info = ModelDescription(
            name_or_path=f"mock-{vocab_size}",
            fingerprint=f"mock-v2-{vocab_size}",
            vocab_size=vocab_size,
            max_length=1 << 16,
            eos_token_ids=[vocab_size - 1],
            bos_token_id=None,
            dtype="float32",
            device="cpu",
            tokenizer_json=tokenizer.backend_tokenizer.to_str(),
            tokenizer_config={"eos_token": tokenizer.eos_token},
            adapters=[],
        )

    def _fill(self, out: torch.Tensor, ids: list[int], lora: str | None) -> None:
        """Write the row of ``ids`` into ``out`` (one row of ``vocab_size``)."""
        if self.crash_on.intersection(ids):
            os._exit(70)  # a model that takes the whole process down (segfault, OOM kill)
        if self.fail_on.intersection(ids):
            raise RuntimeError(f"mock model fails on token ids {sorted(self.fail_on)}")
        seed_src = repr((ids, lora)).encode()
        seed = int.from_bytes(hashlib.blake2b(seed_src, digest_size=8).digest(), "little")
        size = self.info["vocab_size"]
        shift, level = seed % size, (seed >> 32) % SHARPNESS_LEVELS
        source = self._levels[level]
        out[shift:] = source[: size - shift]  # torch.roll(source, shift), into out
        out[:shift] = source[size - shift :]

    def _row(self, ids: list[int], lora: str | None) -> torch.Tensor:
        out = torch.empty(self.info["vocab_size"])
        self._fill(out, ids, lora)
        return out

    @functools.cached_property
    def _levels(self) -> torch.Tensor:
        """``[SHARPNESS_LEVELS, vocab_size]`` normalized log-probs of one random logit vector."""
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(self.info["vocab_size"], generator=g) * 3
        scales = 0.5 + torch.arange(SHARPNESS_LEVELS) / (SHARPNESS_LEVELS - 1)
        return torch.log_softmax(logits * scales[:, None], dim=-1)

    def add_lora(self, name: str, path: str) -> None:
        """Adapters change nothing here but the rows' seed (``_row`` hashes the name)."""
        self.info["adapters"] = sorted({*self.info["adapters"], name})

    def remove_lora(self, name: str) -> bool:
        if name not in self.info["adapters"]:
            return False
        self.info["adapters"] = [a for a in self.info["adapters"] if a != name]
        return True

    def logprobs(self, prompts: list[list[int]], lora: str | None) -> torch.Tensor:
        if self.delay_ms:
            time.sleep((self.delay_ms + 0.1 * len(prompts)) / 1000)
        self._count(prompts)
        out = torch.empty(len(prompts), self.info["vocab_size"])
        for row, prompt in zip(out, prompts, strict=True):
            self._fill(row, prompt, lora)
        return out

    def score(
        self, prompt: list[int], continuation: list[int], lora: str | None, greedy: bool = False
    ) -> torch.Tensor:
        rows = [prompt + continuation[:i] for i in range(len(continuation))]
        self._count(rows[:1])
        lp = torch.stack([self._row(r, lora) for r in rows])
        if greedy:
            return with_greedy(lp, continuation)
        return lp.gather(1, torch.tensor(continuation).unsqueeze(1)).squeeze(1)
