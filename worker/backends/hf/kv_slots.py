"""Where the hf KV cache's key/values live (:mod:`.kv_trie`): one arena of token slots, and the
model's key/value layout it is shaped by (``describe_model``).

Every cached position is one *slot*: a row of ``keys`` (``[slots, layers, kv_heads, key_dim]``)
and the same row of ``values``. A trie node holds the slot numbers of its positions, not tensors
of its own, so that the cache's work per step is a handful of tensor operations whatever the
number of rows: the pasts of a pass are read into its buffers with one ``index_select`` per
side for all rows and layers, a pass's new positions are written with one ``index_copy_`` per
side, and splitting, growing or duplicating a sequence moves slot numbers, never key/values.
Slot 0 holds zeros, the filler of a short row's past (never handed out: masked positions get
weight 0, and 0 x NaN from uninitialized memory would poison the row).

The arena grows by doubling up to ``max_slots`` (the budget, and a quarter more for a pass's new
positions before the trie evicts); freed slots are reused last-freed first. ``release`` gives
its memory back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

ZERO_SLOT = 0
GROW_FIRST = 1024
"""Slots of the first allocation (or fewer, if the cap is lower)."""
SLACK = 0.25
"""Slots past the budget the arena may take for one pass's new positions before eviction."""


class UnsupportedModel(Exception):
    """The model's cache is not a plain full-attention ``DynamicCache`` of uniform layers."""


@dataclass(frozen=True)
class Layout:
    """A model's key/values: per position, ``layers x kv_heads`` keys and values."""

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device

    def token_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.layers * self.kv_heads * (self.key_dim + self.value_dim) * itemsize


def describe_model(model: Any) -> Layout:
    """Check that the cache can serve ``model`` and return its key/value layout.

    Raises ``UnsupportedModel`` for sliding-window, chunked, linear-attention or KV-sharing
    layers, and for layers of different shapes.
    """
    cache = DynamicCache(config=model.config)
    odd = sorted(
        {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    )
    if odd:
        raise UnsupportedModel(f"cache layers {odd} are not plain full attention")
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(
            input_ids=torch.zeros((1, 2), dtype=torch.long, device=device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    layers = out.past_key_values.layers
    shapes = {
        (
            tuple(layer.keys.shape[:2]),
            layer.keys.shape[-1],
            layer.values.shape[-1],
            layer.keys.shape[-2],
            layer.keys.dtype,
        )
        for layer in layers
        if getattr(layer, "is_initialized", False)
    }
    if len(shapes) != 1 or not all(getattr(layer, "is_initialized", False) for layer in layers):
        raise UnsupportedModel("layers hold key/values of different shapes")
    (_, heads), key_dim, value_dim, _, dtype = next(iter(shapes))
    return Layout(len(layers), heads, key_dim, value_dim, dtype, layers[0].keys.device)


class SlotArena:
    """Key and value rows in two tensors, handed out by slot number; not thread-safe (the trie
    holds its lock)."""

    def __init__(self, layout: Layout) -> None:
        self.shape_k = (layout.layers, layout.kv_heads, layout.key_dim)
        self.shape_v = (layout.layers, layout.kv_heads, layout.value_dim)
        self.dtype, self.device = layout.dtype, layout.device
        self.slot_bytes = layout.token_bytes()
        self.max_slots = 0
        layers, heads = layout.layers, layout.kv_heads
        self._vectors = torch.arange(layers * heads, device=self.device).view(layers, 1, heads, 1)
        """``layer * kv_heads + head`` for every layer and head, as ``gather`` adds it."""
        self.release()

    def release(self) -> None:
        """Forget every slot and give the memory back (the zero slot stays)."""
        self.keys = torch.zeros((1, *self.shape_k), dtype=self.dtype, device=self.device)
        self.values = torch.zeros((1, *self.shape_v), dtype=self.dtype, device=self.device)
        self._free = np.empty(0, dtype=np.int64)
        self._nfree = 0
        self._scratch = torch.empty(0, dtype=self.dtype)

    def set_budget(self, budget_bytes: int) -> None:
        """Cap the slots at the budget's worth and ``SLACK`` more."""
        self.max_slots = int(budget_bytes // self.slot_bytes * (1 + SLACK))

    @property
    def capacity(self) -> int:
        """Slots the arena has room for now (the zero slot not counted)."""
        return int(self.keys.shape[0]) - 1

    @property
    def used_slots(self) -> int:
        return self.capacity - self._nfree

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` free slot numbers, or None when the cap leaves fewer."""
        if n > self._nfree and not self._grow(n - self._nfree):
            return None
        self._nfree -= n
        return self._free[self._nfree : self._nfree + n][::-1].copy()

    def free(self, slots: np.ndarray) -> None:
        """Give ``slots`` back (their contents are left as they are)."""
        n = len(slots)
        self._free[self._nfree : self._nfree + n] = slots[::-1]
        self._nfree += n

    def write(self, slots: np.ndarray, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` (``[len(slots), layers, kv_heads, dim]``) in ``slots``."""
        index = torch.from_numpy(slots).to(self.device)
        self.keys.index_copy_(0, index, keys.to(self.dtype))
        self.values.index_copy_(0, index, values.to(self.dtype))

    def gather(self, slots: np.ndarray, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy the keys and values of ``slots`` (``[rows, T]``) into a pass's buffers ``keys``
        / ``values`` (contiguous, ``[layers, rows, kv_heads, T, dim]``), one ``index_select`` a
        side: each ``dim``-long vector is read from its slot and written in the buffers' own
        order, with no memory in between (a read in the arena's order and a permuted copy
        moved every byte twice: 14.3 against 9.9 ms a side for 64 rows of 28 positions at
        SmolLM2-135M's shape, one thread)."""
        layers, heads = self.shape_k[0], self.shape_k[1]
        rows, width = slots.shape
        if tuple(keys.shape[:4]) != (layers, rows, heads, width) or not (
            keys.is_contiguous() and values.is_contiguous()
        ):
            raise ValueError(f"buffers of shape {tuple(keys.shape)} do not fit slots {slots.shape}")
        first = torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.device)
        # vector (slot, layer, head) of the arena viewed as [slots * layers * heads, dim]
        index = (first.view(1, rows, 1, width) * (layers * heads) + self._vectors).view(-1)
        torch.index_select(
            self.keys.view(-1, self.shape_k[2]), 0, index, out=keys.view(-1, self.shape_k[2])
        )
        torch.index_select(
            self.values.view(-1, self.shape_v[2]), 0, index, out=values.view(-1, self.shape_v[2])
        )

    def read(self, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of ``slots`` (any shape ``S``): ``[*S, layers, kv_heads, dim]``,
        valid until the next ``read``. On the CPU they are written into scratch memory kept
        between reads (fresh memory every pass costs a page fault per 4 KB)."""
        flat = np.ascontiguousarray(slots).reshape(-1)
        n = len(flat)
        if self.device.type != "cpu":
            index = torch.from_numpy(flat).to(self.device)
            keys, values = self.keys.index_select(0, index), self.values.index_select(0, index)
        else:
            size_k, size_v = n * math.prod(self.shape_k), n * math.prod(self.shape_v)
            if self._scratch.numel() < size_k + size_v:
                self._scratch = torch.empty(0, dtype=self.dtype)  # the old one goes first
                self._scratch = torch.empty(size_k + size_v, dtype=self.dtype)
            keys = self._scratch[:size_k].view(n, *self.shape_k)
            values = self._scratch[size_k : size_k + size_v].view(n, *self.shape_v)
            self.read_into(flat, keys, values)
        return keys.view(*slots.shape, *self.shape_k), values.view(*slots.shape, *self.shape_v)

    def read_into(self, slots: np.ndarray, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy the keys and values of ``slots`` (1-D) straight into ``keys`` / ``values``
        (``[len(slots), layers, kv_heads, dim]`` views of any strides, as one row of a pass's
        buffers is), with no memory in between; for the CPU."""
        index = torch.from_numpy(slots).to(self.device)
        torch.index_select(self.keys, 0, index, out=keys)
        torch.index_select(self.values, 0, index, out=values)

    def _grow(self, more: int) -> bool:
        """Room for at least ``more`` further slots within the cap; False if there is none."""
        old = self.capacity
        if old + more > self.max_slots:
            return False
        new = min(self.max_slots, max(2 * old, old + more, GROW_FIRST))
        keys = torch.empty((new + 1, *self.shape_k), dtype=self.dtype, device=self.device)
        values = torch.empty((new + 1, *self.shape_v), dtype=self.dtype, device=self.device)
        keys[: old + 1] = self.keys
        values[: old + 1] = self.values
        self.keys, self.values = keys, values
        free = np.empty(new, dtype=np.int64)
        # the new slots below the old free ones, highest first: handed out lowest first
        added = np.arange(new, old, -1, dtype=np.int64)
        free[: len(added)] = added
        free[len(added) : len(added) + self._nfree] = self._free[: self._nfree]
        self._free, self._nfree = free, self._nfree + len(added)
        return True
