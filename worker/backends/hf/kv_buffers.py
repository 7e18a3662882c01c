"""The buffers of one forward pass of the hf KV cache (:mod:`.kv_cache`): where the rows' pasts
are gathered and the pass's new key/values written, and the cache layer that writes them."""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


class PassBuffers:
    """Key and value buffers for each pass. On the CPU they share one scratch storage, kept
    between passes: memory fresh from the system for every pass (hundreds of MB for 64
    particles) cost a page fault per 4 KB at its first write, 187 ms against 29 ms for the copy
    into reused memory at SmolLM2-135M's shape (docs/performance.md). It is a pass's peak memory
    anyway (and up to half more: it grows by half when a pass needs more); kept, the process
    holds it between passes too. On a GPU, torch's caching allocator reuses memory itself."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._scratch: torch.Tensor | None = None

    def take(
        self, shape: tuple[int, ...], key_dim: int, value_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialized ``shape + (key_dim,)`` and ``shape + (value_dim,)`` buffers, valid
        until the next ``take``."""
        n_k, n_v = math.prod(shape) * key_dim, math.prod(shape) * value_dim
        if self.device.type != "cpu":
            return (
                torch.empty((*shape, key_dim), dtype=self.dtype, device=self.device),
                torch.empty((*shape, value_dim), dtype=self.dtype, device=self.device),
            )
        have = 0 if self._scratch is None else self._scratch.numel()
        if have < n_k + n_v:
            # grown by half at least: an SMC step's pasts are one position longer than the
            # last step's, and fresh memory at every step faulted all of it in again
            size = max(n_k + n_v, have * 3 // 2)
            self._scratch = None  # the old storage goes first: one at a time
            self._scratch = torch.empty(size, dtype=self.dtype)
        flat = self._scratch
        assert flat is not None
        keys = flat[:n_k].view(*shape, key_dim)
        return keys, flat[n_k : n_k + n_v].view(*shape, value_dim)


class FilledLayer(DynamicLayer):
    """A ``DynamicLayer`` over preallocated ``[rows, heads, past + width, dim]`` buffers that
    already hold the pasts: ``update`` writes the new positions in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, past: int) -> None:
        # named rather than super(): mypy checks a super() call against no untyped_calls_exclude
        DynamicLayer.__init__(self)
        self._keys_buf, self._values_buf = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.keys, self.values = keys[:, :, :past], values[:, :, :past]
        self.is_initialized = True
        self.filled = False
        self._past = past

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self._past
        end = start + key_states.shape[-2]
        if self.filled or end > self._keys_buf.shape[-2]:
            raise RuntimeError("one update per forward pass, of at most the planned width")
        self._keys_buf[:, :, start:end] = key_states
        self._values_buf[:, :, start:end] = value_states
        self.keys, self.values = self._keys_buf[:, :, :end], self._values_buf[:, :, :end]
        self.filled = True
        return self.keys, self.values
