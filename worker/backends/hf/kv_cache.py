"""Key/value cache of earlier prompts for the hf backend: compute only the tokens not seen yet.

The key/values live in an arena of token slots (:mod:`.kv_slots`), indexed by a token trie
(:mod:`.kv_trie`: one radix trie per namespace, shared prefixes stored once, LRU eviction in
bytes, pins); this module computes what they lack.

Every forward pass stores its new positions automatically. A request reuses the deepest cached
prefix (a match may end inside a segment) and runs only the rest; a batch mixes rows with
different cached lengths: pasts are gathered from the arena, one ``index_select`` per side for
all rows and layers, into a zero-padded ``[rows, past + new]`` buffer per side (a
``DynamicCache`` whose layers write the new positions into it in place, so pasts are copied
once, not concatenated again); the new positions go back with one ``index_copy_`` per side.
New tokens are right-padded after the past, and the attention mask and position ids
(``cached + j``) make each row see exactly its own tokens.
Rows are grouped by new length so a cold prompt does not pad the one-token SMC rows, and an
uncached prefix shared by several rows of a batch is run once first.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from transformers import DynamicCache

from worker.backends.hf import attention
from worker.backends.hf.kv_buffers import FilledLayer, PassBuffers
from worker.backends.hf.kv_slots import ZERO_SLOT, SlotArena, describe_model
from worker.backends.hf.kv_trie import NO_SLOTS, KVTrie, Node, Row, ancestry, lcp

SHARE_MIN_TOKENS = 16
"""An uncached prefix shared by rows of one batch is run once, first, when at least this long."""
PAD_WASTE = 2.0
"""A forward group's padded new tokens stay under ``PAD_WASTE`` x its real ones (plus slack)."""
PAD_SLACK = 32
DEFER_MIN_ROWS = 8
"""A pass's stores are left for ``settle`` (``defer``) only when it has at least this many rows:
a lone row's store takes tens of microseconds, less than handing it to the compute thread
again after the write would cost the next request."""
HEAD_MIN_TOKENS = 32
"""A cached prefix that every row of a pass shares is attended in place (not copied into each
row's past) when at least this long and the model's attention can (``attention.NAME``)."""


@dataclass(eq=False)
class _Plan:
    """One unique row of a batch: reuse ``cached`` tokens (``slots``), run the rest."""

    row: Row
    cached: int
    slots: np.ndarray
    """The arena slots of its cached positions, taken when planned: a group's inserts may split
    or grow the nodes a later group's rows were planned from, but free no slot."""
    first: Node | None
    """The node its first cached positions come from (None when nothing is cached)."""
    first_take: int
    """How many of them."""
    path: list[Node]
    """The trie nodes its match went through (touched as used)."""
    tail: int = 1
    """How many of its last positions' logits are wanted (a score's continuation)."""

    @property
    def new(self) -> int:
        return len(self.row) - self.cached


class KVCache(KVTrie):
    """Token-trie key/value cache wrapped around a causal LM; see the module docstring.

    ``last_logits`` and ``tail_logits`` (scores) are the compute entry points. Counters
    (cumulative unless noted): ``tokens_requested`` (prompt tokens asked for, duplicates
    included), ``tokens_reused`` (served from the cache or from a duplicate in the same batch),
    ``tokens_computed`` (run through the model, shared-prefix passes included), ``bytes_used``,
    ``arena_bytes`` (the arena's memory, free slots included) and ``entries`` (now).
    """

    STAT_NAMES = (
        "tokens_requested",
        "tokens_reused",
        "tokens_computed",
        "bytes_used",
        "arena_bytes",
        "budget_bytes",
        "pinned_bytes",
        "entries",
        "forward_passes",
        "evictions",
    )

    def __init__(self, model: Any, budget_bytes: int, pad_id: int) -> None:
        self.layout = describe_model(model)
        super().__init__(budget_bytes, SlotArena(self.layout))
        self.model = model
        self.config = model.config
        self._head: tuple[Node, np.ndarray, list[torch.Tensor], list[torch.Tensor]] | None = None
        self.pad_id = int(pad_id)
        self.tokens_requested = 0
        self.tokens_reused = 0
        self.tokens_computed = 0
        self.forward_passes = 0
        self._stats = dict.fromkeys(self.STAT_NAMES, 0)
        self.buffers = PassBuffers(self.layout.device, self.layout.dtype)

    # -- public API ---------------------------------------------------------------------
    def last_logits(
        self, prompts: Sequence[Sequence[int]], namespace: Hashable = None, defer: bool = False
    ) -> torch.Tensor:
        """Logits at the last position of each prompt, ``[len(prompts), vocab]``.

        The caller selects the adapter that ``namespace`` names before calling. ``defer``: a
        single pass leaves storing its new positions to :meth:`settle` (the worker calls it once
        the answers are written, so they leave without waiting for it; ``DEFER_MIN_ROWS``); any
        later call settles first.
        """
        rows = [tuple(p) for p in prompts]
        if not rows or not all(rows):
            raise ValueError("every prompt needs at least one token")
        with self._lock:
            self.settle()
            unique = list(dict.fromkeys(rows))
            self.tokens_requested += sum(map(len, rows))
            self.tokens_reused += sum(map(len, rows)) - sum(map(len, unique))
            logits = self._compute(self._root(namespace), unique, True, defer=defer)
        logits = logits[:, -1]
        if len(unique) == len(rows):
            return logits
        index = {row: i for i, row in enumerate(unique)}
        return logits[torch.tensor([index[r] for r in rows], device=logits.device)]

    def tail_logits(
        self,
        prompts: Sequence[Sequence[int]],
        tails: Sequence[int],
        namespace: Hashable = None,
        defer: bool = False,
    ) -> torch.Tensor:
        """Logits at the last ``tails[i]`` positions of each prompt, ``[len(prompts), T, vocab]``
        with ``T = max(tails)``, each row's positions right-aligned (``[i, T - tails[i]:]``).

        A score's rows: prompt + continuation but its last token, the continuation's length as
        tail. Only the positions past the deepest cached prefix run, so the choices of one
        multiple-choice question compute their shared context once. ``defer``: as for
        :meth:`last_logits`.
        """
        rows = [tuple(p) for p in prompts]
        if len(rows) != len(tails) or not all(
            0 < t <= len(r) for r, t in zip(rows, tails, strict=True)
        ):
            raise ValueError("every prompt needs at least its tail's number of tokens (>= 1)")
        with self._lock:
            self.settle()
            want: dict[Row, int] = {}
            for row, tail in zip(rows, tails, strict=True):
                want[row] = max(want.get(row, 0), tail)
            unique = list(want)
            self.tokens_requested += sum(map(len, rows))
            self.tokens_reused += sum(map(len, rows)) - sum(map(len, unique))
            logits = self._compute(
                self._root(namespace), unique, True, [want[r] for r in unique], defer
            )
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
            self.settle()
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
        """The counters named in ``STAT_NAMES`` (a pass's positions count in ``bytes_used`` and
        ``entries`` once stored: see :meth:`settle`). While a pass holds the cache, those of the
        last read: the worker's heartbeat reads them in its event loop, which never waits for
        a pass (one of long prompts on a CPU froze it until the worker counted as dead)."""
        if self._lock.acquire(blocking=False):
            try:
                self._stats = {name: int(getattr(self, name)) for name in self.STAT_NAMES}
            finally:
                self._lock.release()
        return dict(self._stats)

    # -- compute ------------------------------------------------------------------------
    def _compute(
        self,
        root: Node,
        rows: list[Row],
        count: bool = False,
        tails: Sequence[int] | None = None,
        defer: bool = False,
    ) -> torch.Tensor:
        """Logits of the last ``tails[i]`` positions (default 1) of unique ``rows``,
        ``[len(rows), max(tails), vocab]`` right-aligned; stores their key/values on the way.

        ``count``: add the reused tokens to ``tokens_reused`` (requests, not internal passes).
        ``defer``: when it is one pass of ``DEFER_MIN_ROWS`` or more, leave its stores (and the
        eviction) to ``settle``.
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
        # Eviction waits for the last group: a later group's plans read slots that an eviction
        # would free for an earlier group's new positions.
        if len(groups) == 1:  # the usual case: one pass (the rows in their own order)
            defer = defer and len(plans) >= DEFER_MIN_ROWS
            logits = self._forward(root, plans, defer)
            if not defer:
                self._evict()
            return logits
        position = {id(p): i for i, p in enumerate(plans)}
        width = max(tails)
        out: torch.Tensor | None = None
        for group in groups:
            logits = self._forward(root, group)
            if out is None:
                out = logits.new_empty((len(plans), width, logits.shape[-1]))
            index = torch.tensor([position[id(p)] for p in group], device=logits.device)
            out[index, width - logits.shape[1] :] = logits
        self._evict()
        assert out is not None
        return out

    def _plan(self, root: Node, row: Row, tail: int = 1) -> _Plan:
        depth, path = self._match(root, row)
        cached = min(depth, len(row) - tail)  # the tail runs anyway: its logits are needed
        mine, left = [], cached
        for node, k in path:
            if left <= 0:
                break
            take = min(k, left)
            mine.append(node.slots[:take])
            left -= take
        slots = NO_SLOTS if not mine else mine[0] if len(mine) == 1 else np.concatenate(mine)
        first, first_take = (path[0][0], len(mine[0])) if mine else (None, 0)
        return _Plan(row, cached, slots, first, first_take, [n for n, _ in path], tail)

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

    def _forward(self, root: Node, plans: list[_Plan], defer: bool = False) -> torch.Tensor:
        """One padded forward over ``plans``; stores the new key/values (or, ``defer``, leaves
        that to ``settle``: the pass buffers stay untouched until then, as every next pass
        settles first), returns the logits of their last ``T = max(tail)`` positions,
        ``[len(plans), T, vocab]`` (a row's positions right-aligned; where it has fewer new
        tokens than ``T``, the first are filler)."""
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
        if defer:
            self._later.append(
                functools.partial(self._store, root, plans, past - head, buf_k, buf_v)
            )
        else:
            self._store(root, plans, past - head, buf_k, buf_v)
        self.forward_passes += 1
        self.tokens_computed += sum(p.new for p in plans)
        logits = out.logits
        if column is None:
            return cast(torch.Tensor, logits)
        picked = torch.tensor([[column[j] for j in w] for w in wanted], device=logits.device)
        return cast(torch.Tensor, logits[torch.arange(rows, device=logits.device)[:, None], picked])

    def _store(
        self, root: Node, plans: list[_Plan], at: int, buf_k: torch.Tensor, buf_v: torch.Tensor
    ) -> None:
        """Enter the plans' new positions in the trie and copy their key/values (buffer
        positions ``at + j`` of row ``i``) into the slots it gave them, one copy per side."""
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        for i, p in enumerate(plans):
            placed = self._insert(root, p.row, p.cached)
            if placed is not None:
                off, where = placed
                rows.append(np.full(len(where), i))
                cols.append(np.arange(at + off, at + off + len(where)))
                slots.append(where)
        if not slots:
            return
        r = torch.from_numpy(np.concatenate(rows)).to(buf_k.device)
        c = torch.from_numpy(np.concatenate(cols)).to(buf_k.device)
        # indices at dims 1 and 3 around a slice: the result is [positions, layers, heads, dim]
        self.arena.write(np.concatenate(slots), buf_k[:, r, :, c], buf_v[:, r, :, c])

    def _shared_head(self, plans: list[_Plan]) -> int:
        """How many first positions every row takes from the same cached node, when the
        model's attention can attend to them in place (``attention.shared_prefix``: CPU
        models) and there are at least ``HEAD_MIN_TOKENS``; else 0."""
        if len(plans) < 2 or getattr(self.config, "_attn_implementation", None) != attention.NAME:
            return 0
        node = plans[0].first
        if node is None or any(p.first is not node for p in plans):
            return 0
        head = min(p.first_take for p in plans)
        return head if head >= HEAD_MIN_TOKENS else 0

    def _head_views(self, plan: _Plan, head: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each layer's ``[kv_heads, head, dim]`` keys and values of the shared head, read from
        the arena once and kept while the same node's first ``head`` slots are asked for (an
        SMC run's prompt, step after step)."""
        node = plan.first
        assert node is not None  # a shared head is cached
        slots = plan.slots[:head]
        kept = self._head
        if kept is None or kept[0] is not node or not np.array_equal(kept[1], slots):
            keys, values = self.arena.read(slots)  # [head, layers, kv_heads, dim]
            # copies of their own: the read's memory is the arena's scratch
            k = keys.permute(1, 2, 0, 3).clone(memory_format=torch.contiguous_format)
            v = values.permute(1, 2, 0, 3).clone(memory_format=torch.contiguous_format)
            kept = self._head = (node, slots.copy(), list(k), list(v))
        return kept[2], kept[3]

    def _gather(
        self,
        plans: list[_Plan],
        past: int,
        buf_k: torch.Tensor,
        buf_v: torch.Tensor,
        head: int = 0,
    ) -> None:
        """Copy each plan's cached positions but the first ``head`` (attended in place) into row
        ``i`` of the buffers, positions ``[0, cached - head)``, zeros up to ``past - head``: one
        read of the arena per side, for all rows and layers."""
        width = past - head
        if width <= 0:
            return
        # the new positions too (zeros, then the forward's): the buffers are filled in one copy
        index = np.full((len(plans), buf_k.shape[3]), ZERO_SLOT, dtype=np.int64)
        for i, p in enumerate(plans):
            if p.cached > head:
                index[i, : p.cached - head] = p.slots[head:]
        self.arena.gather(index, buf_k, buf_v)


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
