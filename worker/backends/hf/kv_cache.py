"""Key/value cache of earlier prompts for the hf backend: compute only the tokens not seen yet.

The key/values live in a token trie (:mod:`.kv_trie`: one radix trie per namespace, shared
prefixes stored once, LRU eviction in bytes, pins); this module computes what it lacks.

Every forward pass stores its new positions automatically. A request reuses the deepest cached
prefix (a match may end inside a segment) and runs only the rest; a batch mixes rows with
different cached lengths: pasts are gathered into a zero-padded ``[rows, past + new]`` buffer
per side (a ``DynamicCache`` whose layers write the new positions into it in place, so pasts
are copied once, not concatenated again), new tokens are right-padded after the past, and the
attention mask and position ids (``cached + j``) make each row see exactly its own tokens.
Rows are grouped by new length so a cold prompt does not pad the one-token SMC rows, and an
uncached prefix shared by several rows of a batch is run once first.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from worker.backends.hf import attention
from worker.backends.hf.kv_buffers import FilledLayer, PassBuffers, runs
from worker.backends.hf.kv_trie import KVTrie, Node, Row, ancestry, lcp

SHARE_MIN_TOKENS = 16
"""An uncached prefix shared by rows of one batch is run once, first, when at least this long."""
PAD_WASTE = 2.0
"""A forward group's padded new tokens stay under ``PAD_WASTE`` x its real ones (plus slack)."""
PAD_SLACK = 32
HEAD_MIN_TOKENS = 32
"""A cached prefix that every row of a pass shares is attended in place (not copied into each
row's past) when at least this long and the model's attention can (``attention.NAME``)."""


class UnsupportedModel(Exception):
    """The model's cache is not a plain full-attention ``DynamicCache`` of uniform layers."""


@dataclass(frozen=True)
class _Layout:
    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device

    def token_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.layers * self.kv_heads * (self.key_dim + self.value_dim) * itemsize


@dataclass
class _Plan:
    """One unique row of a batch: reuse ``cached`` tokens from ``pieces``, run the rest."""

    row: Row
    cached: int
    pieces: list[tuple[torch.Tensor, torch.Tensor, int]]
    path: list[Node]
    """The trie nodes its match went through (touched as used)."""
    tail: int = 1
    """How many of its last positions' logits are wanted (a score's continuation)."""

    @property
    def new(self) -> int:
        return len(self.row) - self.cached


def describe_model(model: Any) -> _Layout:
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
    return _Layout(len(layers), heads, key_dim, value_dim, dtype, layers[0].keys.device)


class KVCache(KVTrie):
    """Token-trie key/value cache wrapped around a causal LM; see the module docstring.

    ``last_logits`` and ``tail_logits`` (scores) are the compute entry points. Counters
    (cumulative unless noted): ``tokens_requested`` (prompt tokens asked for, duplicates
    included), ``tokens_reused`` (served from the cache or from a duplicate in the same batch),
    ``tokens_computed`` (run through the model, shared-prefix passes included), ``bytes_used``
    and ``entries`` (now).
    """

    STAT_NAMES = (
        "tokens_requested",
        "tokens_reused",
        "tokens_computed",
        "bytes_used",
        "budget_bytes",
        "pinned_bytes",
        "entries",
        "forward_passes",
        "evictions",
    )

    def __init__(self, model: Any, budget_bytes: int, pad_id: int) -> None:
        super().__init__(budget_bytes)
        self.model = model
        self.config = model.config
        self.layout = describe_model(model)
        self.pad_id = int(pad_id)
        self.tokens_requested = 0
        self.tokens_reused = 0
        self.tokens_computed = 0
        self.forward_passes = 0
        self.buffers = PassBuffers(self.layout.device, self.layout.dtype)

    # -- public API ---------------------------------------------------------------------
    def last_logits(
        self, prompts: Sequence[Sequence[int]], namespace: Hashable = None
    ) -> torch.Tensor:
        """Logits at the last position of each prompt, ``[len(prompts), vocab]``.

        The caller selects the adapter that ``namespace`` names before calling.
        """
        rows = [tuple(p) for p in prompts]
        if not rows or not all(rows):
            raise ValueError("every prompt needs at least one token")
        with self._lock:
            unique = list(dict.fromkeys(rows))
            self.tokens_requested += sum(map(len, rows))
            self.tokens_reused += sum(map(len, rows)) - sum(map(len, unique))
            logits = self._compute(self._root(namespace), unique, count=True)
        logits = logits[:, -1]
        if len(unique) == len(rows):
            return logits
        index = {row: i for i, row in enumerate(unique)}
        return logits[torch.tensor([index[r] for r in rows], device=logits.device)]

    def tail_logits(
        self, prompts: Sequence[Sequence[int]], tails: Sequence[int], namespace: Hashable = None
    ) -> torch.Tensor:
        """Logits at the last ``tails[i]`` positions of each prompt, ``[len(prompts), T, vocab]``
        with ``T = max(tails)``, each row's positions right-aligned (``[i, T - tails[i]:]``).

        A score's rows: prompt + continuation but its last token, the continuation's length as
        tail. Only the positions past the deepest cached prefix run, so the choices of one
        multiple-choice question compute their shared context once.
        """
        rows = [tuple(p) for p in prompts]
        if len(rows) != len(tails) or not all(
            0 < t <= len(r) for r, t in zip(rows, tails, strict=True)
        ):
            raise ValueError("every prompt needs at least its tail's number of tokens (>= 1)")
        with self._lock:
            want: dict[Row, int] = {}
            for row, tail in zip(rows, tails, strict=True):
                want[row] = max(want.get(row, 0), tail)
            unique = list(want)
            self.tokens_requested += sum(map(len, rows))
            self.tokens_reused += sum(map(len, rows)) - sum(map(len, unique))
            logits = self._compute(self._root(namespace), unique, True, [want[r] for r in unique])
        width = max(tails)
        logits = logits[:, logits.shape[1] - width :]
        if len(unique) == len(rows):
            return logits
        index = {row: i for i, row in enumerate(unique)}
        return logits[torch.tensor([index[r] for r in rows], device=logits.device)]

    def pin(self, prefix_ids: Sequence[int], namespace: Hashable = None) -> int:
        """Compute ``prefix_ids`` if needed and keep it from eviction; returns its bytes.

        Pins nest (one ``unpin`` per ``pin``). Raises ``ValueError`` when the pinned prefixes
        would not fit in the budget.
        """
        row = tuple(prefix_ids)
        if not row:
            raise ValueError("cannot pin an empty prefix")
        with self._lock:
            root = self._root(namespace)
            if self._match(root, row)[0] < len(row):
                self._compute(root, [row])
            node = self._node_at(root, row)
            if node is None:
                raise ValueError(f"a {len(row)}-token prefix does not fit in the kv cache budget")
            node.pins += 1
            self._pinned.add(node)
            if self.pinned_bytes > self.budget_bytes:
                self._unpin_node(node)
                raise ValueError("pinned prefixes would exceed the kv cache budget")
            return sum(n.nbytes for n in ancestry(node))

    def stats(self) -> dict[str, int]:
        """The counters named in ``STAT_NAMES``."""
        with self._lock:
            return {name: int(getattr(self, name)) for name in self.STAT_NAMES}

    # -- compute ------------------------------------------------------------------------
    def _compute(
        self,
        root: Node,
        rows: list[Row],
        count: bool = False,
        tails: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Logits of the last ``tails[i]`` positions (default 1) of unique ``rows``,
        ``[len(rows), max(tails), vocab]`` right-aligned; stores their key/values on the way.

        ``count``: add the reused tokens to ``tokens_reused`` (requests, not internal passes).
        """
        tails = tails or [1] * len(rows)

        def plan_all() -> list[_Plan]:
            return [self._plan(root, row, tail) for row, tail in zip(rows, tails, strict=True)]

        plans = plan_all()
        # A row with this much to run may share an uncached prefix with another: such prefixes
        # are computed once first, then the rows are planned again.
        long = len(rows) > 1 and any(p.new >= SHARE_MIN_TOKENS for p in plans)
        if long and self._prefill_shared(root, rows):
            plans = plan_all()
        for p in plans:
            self._touch(p.path)
        if count:
            self.tokens_reused += sum(p.cached for p in plans)
        groups = _groups(plans)
        if len(groups) == 1 and groups[0] == plans:  # the usual case: one pass, rows in order
            logits = self._forward(root, plans)
            self._evict()
            return logits
        position = {id(p): i for i, p in enumerate(plans)}
        width = max(tails)
        out: torch.Tensor | None = None
        for group in groups:
            logits = self._forward(root, group)
            self._evict()
            if out is None:
                out = logits.new_empty((len(plans), width, logits.shape[-1]))
            index = torch.tensor([position[id(p)] for p in group], device=logits.device)
            out[index, width - logits.shape[1] :] = logits
        assert out is not None
        return out

    def _plan(self, root: Node, row: Row, tail: int = 1) -> _Plan:
        depth, path = self._match(root, row)
        cached = min(depth, len(row) - tail)  # the tail runs anyway: its logits are needed
        pieces, left = [], cached
        for node, k in path:
            if left <= 0:
                break
            assert node.keys is not None and node.values is not None
            take = min(k, left)
            pieces.append((node.keys, node.values, take))
            left -= take
        return _Plan(row, cached, pieces, [n for n, _ in path], tail)

    def _prefill_shared(self, root: Node, rows: list[Row]) -> bool:
        """Run once the uncached prefixes that several rows share, before the rows themselves;
        True if there were any."""
        if len(rows) < 2:
            return False
        shared: set[Row] = set()
        ordered = sorted(rows)
        for a, b in itertools.pairwise(ordered):
            n = lcp(a, b)
            if n >= SHARE_MIN_TOKENS and n - self._match(root, a[:n])[0] >= SHARE_MIN_TOKENS:
                shared.add(a[:n])
        if shared:
            # Their own shared prefixes are handled by the same rule, one level down.
            self._compute(root, sorted(shared))
        return bool(shared)

    def _forward(self, root: Node, plans: list[_Plan]) -> torch.Tensor:
        """One padded forward over ``plans``; stores the new key/values, returns the logits of
        their last ``T = max(tail)`` positions, ``[len(plans), T, vocab]`` (a row's positions
        right-aligned; where it has fewer new tokens than ``T``, the first are filler)."""
        lay = self.layout
        rows, past, width = len(plans), max(p.cached for p in plans), max(p.new for p in plans)
        head = self._shared_head(plans)  # positions [0, head) attended in place, not gathered
        # Built for all rows at once (a loop over rows cost ~20 us a row, 1.3 ms of an SMC
        # step of 64 particles): each row's new tokens left-aligned, then padding.
        cached = torch.tensor([p.cached for p in plans])
        news = torch.tensor([p.new for p in plans])
        steps = torch.arange(width)
        fresh = steps < news[:, None]
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        ids[fresh] = torch.tensor([t for p in plans for t in p.row[p.cached :]])
        span = torch.arange(head, past + width)
        seen = (span < cached[:, None]) | ((span >= past) & (span < past + news[:, None]))
        mask = seen.long()
        # Padding after a row's tokens repeats its last position (never attended to).
        positions = torch.minimum(steps + cached[:, None], (cached + news - 1)[:, None])
        # One buffer per side holds the gathered pasts and receives the new positions in place
        # (a plain DynamicLayer would concatenate, copying every past a second time); the new
        # positions are all written by the forward pass.
        shape = (lay.layers, rows, lay.kv_heads, past - head + width)
        buf_k, buf_v = self.buffers.take(shape, lay.key_dim, lay.value_dim)
        self._gather(plans, past, buf_k, buf_v, head)
        cache = DynamicCache(config=self.config)
        cache.layers = [FilledLayer(buf_k[n], buf_v[n], past - head) for n in range(lay.layers)]
        prefix = attention.shared_prefix(*self._head_views(plans[0], head)) if head else None
        tail = max(p.tail for p in plans)
        # the positions whose logits are wanted, per row (clamped at 0: filler)
        wanted = [[max(p.new - tail + t, 0) for t in range(tail)] for p in plans]
        kept = sorted({j for w in wanted for j in w})
        same = all(p.new == width for p in plans)  # then the last ``tail`` columns, as they are
        keep: int | torch.Tensor = tail if same else torch.tensor(kept)
        column = {pos: j for j, pos in enumerate(kept)} if isinstance(keep, torch.Tensor) else None
        with torch.inference_mode(), prefix or contextlib.nullcontext():
            out = self.model(
                input_ids=ids.to(lay.device),
                attention_mask=mask.to(lay.device),
                position_ids=positions.to(lay.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=keep if isinstance(keep, int) else keep.to(lay.device),
            )
        if out.past_key_values is not cache or any(
            not isinstance(layer, FilledLayer) or not layer.filled for layer in cache.layers
        ):
            raise RuntimeError("the model did not store its key/values in the cache it was given")
        for i, p in enumerate(plans):
            new = slice(past - head, past - head + p.new)
            self._insert(root, p.row, p.cached, buf_k[:, i, :, new], buf_v[:, i, :, new])
        self.forward_passes += 1
        self.tokens_computed += sum(p.new for p in plans)
        logits = out.logits
        if column is None:
            return cast(torch.Tensor, logits)
        picked = torch.tensor([[column[j] for j in w] for w in wanted], device=logits.device)
        return cast(torch.Tensor, logits[torch.arange(rows, device=logits.device)[:, None], picked])

    def _shared_head(self, plans: list[_Plan]) -> int:
        """How many first positions every row takes from the same cached piece, when the
        model's attention can attend to them in place (``attention.shared_prefix``: CPU
        models) and there are at least ``HEAD_MIN_TOKENS``; else 0."""
        if len(plans) < 2 or getattr(self.config, "_attn_implementation", None) != attention.NAME:
            return 0
        if not all(p.pieces for p in plans):
            return 0
        keys = plans[0].pieces[0][0]
        if any(p.pieces[0][0] is not keys for p in plans):
            return 0
        head = min(p.pieces[0][2] for p in plans)
        return head if head >= HEAD_MIN_TOKENS else 0

    def _head_views(self, plan: _Plan, head: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each layer's ``[kv_heads, head, dim]`` keys and values of the shared head (views)."""
        keys, values, _ = plan.pieces[0]
        return [k[:, :head] for k in keys], [v[:, :head] for v in values]

    def _gather(
        self,
        plans: list[_Plan],
        past: int,
        buf_k: torch.Tensor,
        buf_v: torch.Tensor,
        head: int = 0,
    ) -> None:
        """Copy each plan's cached pieces, but their first ``head`` positions (attended in
        place), into row ``i`` of the buffers, positions ``[0, cached - head)``, and zero
        ``[cached - head, past - head)``: one copy per distinct piece and offset, for all the
        rows that use it (the shared prompt of N particles is one copy, not N)."""
        uses: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, list[int]]] = {}
        short: dict[int, list[int]] = {}
        for i, p in enumerate(plans):
            at = 0
            for keys, values, take in p.pieces:
                use = uses.get((id(keys), at, take))
                if use is None:
                    uses[(id(keys), at, take)] = (keys, values, [i])
                else:
                    use[2].append(i)
                at += take
            if at < past:
                short.setdefault(at, []).append(i)
        # Rows that use a piece come in runs of consecutive rows (the shared prompt: all of
        # them): one broadcast copy per run. An index tensor instead (index_put) took 42% of
        # the worker's time at SmolLM2-135M's shape on the CPU (docs/performance.md).
        for (_, at, take), (keys, values, index) in uses.items():
            skip = max(head - at, 0)  # the part of the piece inside the shared head
            if skip >= take:
                continue
            to = slice(at + skip - head, at + take - head)
            for lo, hi in runs(index):
                buf_k[:, lo:hi, :, to] = keys[:, None, :, skip:take]
                buf_v[:, lo:hi, :, to] = values[:, None, :, skip:take]
        # Padding in the past is zeroed: masked slots get weight 0, and 0 * NaN would poison
        # the row.
        for at, index in short.items():
            for lo, hi in runs(index):
                buf_k[:, lo:hi, :, at - head : past - head] = 0
                buf_v[:, lo:hi, :, at - head : past - head] = 0


def _groups(plans: list[_Plan]) -> list[list[_Plan]]:
    """Split rows into forward passes so that short rows are not padded to a long one."""
    groups: list[list[_Plan]] = []
    current: list[_Plan] = []
    real = 0
    for p in sorted(plans, key=lambda p: p.new):
        if current and (len(current) + 1) * p.new > PAD_WASTE * (real + p.new) + PAD_SLACK:
            groups.append(current)
            current, real = [], 0
        current.append(p)
        real += p.new
    if current:
        groups.append(current)
    return groups
