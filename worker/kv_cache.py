"""Key/value cache of earlier prompts for the hf backend: compute only the tokens not seen yet.

Layout: a radix trie per namespace (LoRA adapter, ``None`` for the base model). Each node holds
a *segment* of tokens and, for those positions only, one key tensor and one value tensor of shape
``[layers, kv_heads, len(segment), head_dim]`` in storage of its own. A prefix is the
concatenation of the segments along its path, so a shared prefix is stored once however many
prompts extend it (no per-prompt copies), and one node costs two tensors, not two per layer.
A branch in the middle of a segment splits it into two nodes (copied so that neither keeps the
other's storage alive, which keeps ``bytes_used`` equal to the real tensor bytes).

Every forward pass stores its new positions automatically. A request reuses the deepest cached
prefix (a match may end inside a segment) and runs only the rest; a batch mixes rows with
different cached lengths: pasts are gathered into a zero-padded ``[rows, past + new]`` buffer
per side (a ``DynamicCache`` whose layers write the new positions into it in place, so pasts
are copied once, not concatenated again), new tokens are right-padded after the past, and the
attention mask and position ids (``cached + j``) make each row see exactly its own tokens.
Rows are grouped by new length so a cold prompt does not pad the one-token SMC rows, and an
uncached prefix shared by several rows of a batch is run once first.

Eviction is least-recently-used in bytes: only leaves go, and a request touches its whole path,
deepest node first, so the order always lists a node after all its descendants and the oldest
entry is a leaf. Pinned prefixes (and their ancestors) are never evicted.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

log = logging.getLogger("lmpool.worker")

SHARE_MIN_TOKENS = 16
"""An uncached prefix shared by rows of one batch is run once, first, when at least this long."""
PAD_WASTE = 2.0
"""A forward group's padded new tokens stay under ``PAD_WASTE`` x its real ones (plus slack)."""
PAD_SLACK = 32

Row = tuple[int, ...]


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


class _Node:
    __slots__ = ("children", "keys", "nbytes", "parent", "pins", "tokens", "values")

    def __init__(
        self,
        tokens: Row,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        parent: _Node | None,
    ) -> None:
        self.tokens = tokens
        self.keys = keys
        self.values = values
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.pins = 0
        self.nbytes = _nbytes(keys) + _nbytes(values)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy in storage of its own (a view would keep its base alive)."""
    return t.clone(memory_format=torch.contiguous_format)


def _lcp(a: Row, b: Row) -> int:
    """Length of the common prefix, by binary search over C-speed slice comparisons."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class _Plan:
    """One unique row of a batch: reuse ``cached`` tokens from ``pieces``, run the rest."""

    row: Row
    cached: int
    pieces: list[tuple[torch.Tensor, torch.Tensor, int]]

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


class KVCache:
    """Token-trie key/value cache wrapped around a causal LM; see the module docstring.

    ``last_logits`` is the only compute entry point. Counters (cumulative unless noted):
    ``tokens_requested`` (prompt tokens asked for, duplicates included), ``tokens_reused``
    (served from the cache or from a duplicate in the same batch), ``tokens_computed`` (run
    through the model, shared-prefix passes included), ``bytes_used`` and ``entries`` (now).
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
        self.model = model
        self.config = model.config
        self.layout = describe_model(model)
        self.budget_bytes = int(budget_bytes)
        self.pad_id = int(pad_id)
        self._lock = threading.RLock()
        self._roots: dict[Hashable, _Node] = {}
        self._lru: OrderedDict[_Node, None] = OrderedDict()
        self._pinned: set[_Node] = set()
        self.bytes_used = 0
        self.tokens_requested = 0
        self.tokens_reused = 0
        self.tokens_computed = 0
        self.forward_passes = 0
        self.evictions = 0

    # -- public API ---------------------------------------------------------------------
    @property
    def entries(self) -> int:
        return len(self._lru)

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
        index = {row: i for i, row in enumerate(unique)}
        stacked = torch.stack(logits)
        if len(unique) == len(rows):
            return stacked
        return stacked[torch.tensor([index[r] for r in rows], device=stacked.device)]

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
            return sum(n.nbytes for n in _ancestry(node))

    def unpin(self, prefix_ids: Sequence[int], namespace: Hashable = None) -> bool:
        """Undo one ``pin``; False when the prefix is not pinned."""
        with self._lock:
            node = self._node_at(self._root(namespace), tuple(prefix_ids))
            if node is None or not node.pins:
                return False
            self._unpin_node(node)
            self._evict()
            return True

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned prefixes (their paths counted once)."""
        with self._lock:
            protected: set[_Node] = set()
            for node in self._pinned:
                protected.update(_ancestry(node))
            return sum(n.nbytes for n in protected)

    def set_budget(self, budget_bytes: int) -> None:
        with self._lock:
            self.budget_bytes = int(budget_bytes)
            self._evict()

    def clear(self) -> None:
        """Drop every entry, pinned ones included; counters other than sizes are kept."""
        with self._lock:
            self._roots.clear()
            self._lru.clear()
            self._pinned.clear()
            self.bytes_used = 0

    def stats(self) -> dict[str, int]:
        """The counters named in ``STAT_NAMES``."""
        with self._lock:
            return {name: int(getattr(self, name)) for name in self.STAT_NAMES}

    def measured_bytes(self) -> int:
        """Bytes of the distinct tensor storages the trie holds, found by walking it."""
        with self._lock:
            seen: dict[int, int] = {}
            for node in self._lru:
                for t in (node.keys, node.values):
                    if t is not None:
                        storage = t.untyped_storage()
                        seen[storage.data_ptr()] = storage.nbytes()
            return sum(seen.values())

    def cached_length(self, ids: Sequence[int], namespace: Hashable = None) -> int:
        """How many leading tokens of ``ids`` the cache holds now."""
        with self._lock:
            return self._match(self._root(namespace), tuple(ids))[0]

    # -- the trie -----------------------------------------------------------------------
    def _root(self, namespace: Hashable) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node((), None, None, None)
        return root

    def _match(self, root: _Node, row: Row) -> tuple[int, list[tuple[_Node, int]]]:
        """Deepest cached prefix of ``row``: its length and the (node, tokens used) path."""
        node, pos, path = root, 0, []
        n = len(row)
        while pos < n:
            child = node.children.get(row[pos])
            if child is None:
                break
            seg = child.tokens
            if row[pos : pos + len(seg)] == seg:
                k = len(seg)
            else:
                k, limit = 1, min(len(seg), n - pos)
                while k < limit and row[pos + k] == seg[k]:
                    k += 1
            path.append((child, k))
            pos += k
            if k < len(seg):
                break
            node = child
        return pos, path

    def _node_at(self, root: _Node, row: Row) -> _Node | None:
        """The node ending exactly after ``row`` (splitting a segment if needed), or None."""
        depth, path = self._match(root, row)
        if depth < len(row) or not path:
            return None
        node, k = path[-1]
        if k < len(node.tokens):
            node = self._split(node, k)
        self._touch([n for n, _ in path[:-1]] + [node])
        return node

    def _touch(self, nodes: Sequence[_Node]) -> None:
        # Deepest first, so that every node ends up after all its descendants.
        for node in reversed(nodes):
            self._lru.move_to_end(node)

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node`` after its first ``k`` tokens; returns the new parent (head) node."""
        assert node.parent is not None and node.keys is not None and node.values is not None
        head = _Node(
            node.tokens[:k], _own(node.keys[:, :, :k]), _own(node.values[:, :, :k]), node.parent
        )
        node.parent.children[head.tokens[0]] = head
        before = node.nbytes
        node.tokens = node.tokens[k:]
        node.keys = _own(node.keys[:, :, k:])
        node.values = _own(node.values[:, :, k:])
        node.nbytes = _nbytes(node.keys) + _nbytes(node.values)
        node.parent = head
        head.children[node.tokens[0]] = node
        self.bytes_used += head.nbytes + node.nbytes - before
        self._lru[head] = None
        return head

    def _insert(
        self, root: _Node, row: Row, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store key/values of ``row[start:]`` (``keys``: ``[layers, heads, len - start, dim]``)."""
        depth, path = self._match(root, row)
        nodes = [n for n, _ in path]
        if depth >= len(row) or depth < start:
            # Already there (a duplicate or a full hit), or its prefix went meanwhile.
            self._touch(nodes)
            return
        parent = root
        if path:
            parent, k = path[-1]
            if k < len(parent.tokens):
                parent = self._split(parent, k)
                nodes[-1] = parent
        off = depth - start
        child = _Node(row[depth:], _own(keys[:, :, off:]), _own(values[:, :, off:]), parent)
        parent.children[child.tokens[0]] = child
        self.bytes_used += child.nbytes
        self._lru[child] = None
        self._touch([*nodes, child])

    def _remove(self, node: _Node) -> None:
        assert node.parent is not None and not node.children
        del node.parent.children[node.tokens[0]]
        del self._lru[node]
        self.bytes_used -= node.nbytes
        self.evictions += 1

    def _evict(self) -> None:
        """Drop least recently used unpinned leaves until the bytes fit in the budget."""
        excess = self.bytes_used - self.budget_bytes
        if excess <= 0:
            return
        # Oldest first; a node's descendants all come before it, so a node whose children are
        # all doomed already is a leaf by the time it is removed (victims keep that order).
        victims: list[_Node] = []
        doomed: set[_Node] = set()
        for node in self._lru:
            if excess <= 0:
                break
            if node.pins or not doomed.issuperset(node.children.values()):
                continue
            victims.append(node)
            doomed.add(node)
            excess -= node.nbytes
        for node in victims:
            self._remove(node)

    def _unpin_node(self, node: _Node) -> None:
        node.pins -= 1
        if not node.pins:
            self._pinned.discard(node)

    # -- compute ------------------------------------------------------------------------
    def _compute(self, root: _Node, rows: list[Row], count: bool = False) -> list[torch.Tensor]:
        """Last-position logits of unique ``rows``; stores their key/values on the way.

        ``count``: add the reused tokens to ``tokens_reused`` (requests, not internal passes).
        """
        self._prefill_shared(root, rows)
        plans = []
        for row in rows:
            depth, path = self._match(root, row)
            cached = min(depth, len(row) - 1)  # the last token runs anyway: its logits are needed
            pieces, left = [], cached
            for node, k in path:
                if left <= 0:
                    break
                assert node.keys is not None and node.values is not None
                take = min(k, left)
                pieces.append((node.keys, node.values, take))
                left -= take
            self._touch([n for n, _ in path])
            plans.append(_Plan(row, cached, pieces))
            if count:
                self.tokens_reused += cached
        out: dict[Row, torch.Tensor] = {}
        for group in _groups(plans):
            out.update(zip([p.row for p in group], self._forward(root, group), strict=True))
            self._evict()
        return [out[row] for row in rows]

    def _prefill_shared(self, root: _Node, rows: list[Row]) -> None:
        """Run once the uncached prefixes that several rows share, before the rows themselves."""
        if len(rows) < 2:
            return
        shared: set[Row] = set()
        ordered = sorted(rows)
        for a, b in itertools.pairwise(ordered):
            n = _lcp(a, b)
            if n >= SHARE_MIN_TOKENS and n - self._match(root, a[:n])[0] >= SHARE_MIN_TOKENS:
                shared.add(a[:n])
        if shared:
            # Their own shared prefixes are handled by the same rule, one level down.
            self._compute(root, sorted(shared))

    def _forward(self, root: _Node, plans: list[_Plan]) -> list[torch.Tensor]:
        """One padded forward over ``plans``; stores the new key/values, returns last logits."""
        lay = self.layout
        rows, past, width = len(plans), max(p.cached for p in plans), max(p.new for p in plans)
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, past + width), dtype=torch.long)
        positions = torch.empty((rows, width), dtype=torch.long)
        steps = torch.arange(width)
        for i, p in enumerate(plans):
            ids[i, : p.new] = torch.tensor(p.row[p.cached :])
            mask[i, : p.cached] = 1
            mask[i, past : past + p.new] = 1
            # Padding after a row's tokens repeats its last position (never attended to).
            positions[i] = (steps + p.cached).clamp(max=len(p.row) - 1)
        # One buffer per side holds the gathered pasts and receives the new positions in place
        # (a plain DynamicLayer would concatenate, copying every past a second time). Padding
        # in the past is zeroed: masked slots get weight 0, and 0 * NaN would poison the row;
        # the new positions are all written by the forward pass.
        shape = (lay.layers, rows, lay.kv_heads, past + width)
        buf_k = torch.empty((*shape, lay.key_dim), dtype=lay.dtype, device=lay.device)
        buf_v = torch.empty((*shape, lay.value_dim), dtype=lay.dtype, device=lay.device)
        for i, p in enumerate(plans):
            at = 0
            for keys, values, take in p.pieces:
                buf_k[:, i, :, at : at + take] = keys[:, :, :take]
                buf_v[:, i, :, at : at + take] = values[:, :, :take]
                at += take
            buf_k[:, i, :, at:past] = 0
            buf_v[:, i, :, at:past] = 0
        cache = DynamicCache(config=self.config)
        cache.layers = [_FilledLayer(buf_k[n], buf_v[n], past) for n in range(lay.layers)]
        last = [p.new - 1 for p in plans]
        kept = sorted(set(last))
        keep: int | torch.Tensor = 1 if kept == [width - 1] else torch.tensor(kept)
        column = {pos: j for j, pos in enumerate(kept)} if isinstance(keep, torch.Tensor) else None
        with torch.inference_mode():
            out = self.model(
                input_ids=ids.to(lay.device),
                attention_mask=mask.to(lay.device),
                position_ids=positions.to(lay.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=keep if isinstance(keep, int) else keep.to(lay.device),
            )
        if out.past_key_values is not cache or any(
            not isinstance(layer, _FilledLayer) or not layer.filled for layer in cache.layers
        ):
            raise RuntimeError("the model did not store its key/values in the cache it was given")
        for i, p in enumerate(plans):
            new = slice(past, past + p.new)
            self._insert(root, p.row, p.cached, buf_k[:, i, :, new], buf_v[:, i, :, new])
        self.forward_passes += 1
        self.tokens_computed += sum(p.new for p in plans)
        logits = out.logits
        if column is None:
            return list(logits[:, -1])
        return [logits[i, column[n]] for i, n in enumerate(last)]


class _FilledLayer(DynamicLayer):
    """A ``DynamicLayer`` over preallocated ``[rows, heads, past + width, dim]`` buffers that
    already hold the pasts: ``update`` writes the new positions in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, past: int) -> None:
        super().__init__()
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


def _ancestry(node: _Node) -> list[_Node]:
    """``node`` and its ancestors, root excluded."""
    out = []
    cur: _Node | None = node
    while cur is not None and cur.parent is not None:
        out.append(cur)
        cur = cur.parent
    return out
