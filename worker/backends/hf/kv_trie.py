"""The token trie behind the hf backend's key/value cache (:mod:`.kv_cache`): storage, LRU
eviction in bytes, pins. It holds key/values; computing them is :class:`.kv_cache.KVCache`'s.

Layout: a radix trie per namespace (LoRA adapter, ``None`` for the base model). Each node holds
a *segment* of tokens and, for those positions only, one key tensor and one value tensor of shape
``[layers, kv_heads, len(segment), head_dim]`` in storage of its own. A prefix is the
concatenation of the segments along its path, so a shared prefix is stored once however many
prompts extend it (no per-prompt copies), and one node costs two tensors, not two per layer.
A row that extends a leaf grows the leaf's segment (up to ``GROW_MAX_TOKENS``) instead of
hanging a one-token node under it, so the path of a sequence decoded token by token stays short.
A branch in the middle of a segment splits it into two nodes (copied so that neither keeps the
other's storage alive, which keeps ``bytes_used`` equal to the real tensor bytes).

Eviction is least-recently-used in bytes: only leaves go, and a request touches its whole path,
deepest node first, so the order always lists a node after all its descendants and the oldest
entry is a leaf. Pinned prefixes (and their ancestors) are never evicted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import torch

Row = tuple[int, ...]
GROW_MAX_TOKENS = 64
"""A leaf grows in place (one copy of its segment) while it holds at most this many tokens;
past that, new positions start a child segment: growing is never quadratic in a sequence."""


class Node:
    """A segment of tokens and, for those positions only, their keys and values
    (``[layers, kv_heads, len(tokens), dim]``; None at a namespace's root)."""

    __slots__ = ("children", "keys", "nbytes", "parent", "pins", "tokens", "values")

    def __init__(
        self,
        tokens: Row,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        parent: Node | None,
    ) -> None:
        self.tokens = tokens
        self.keys = keys
        self.values = values
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.pins = 0
        self.nbytes = _nbytes(keys) + _nbytes(values)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy in storage of its own (a view would keep its base alive)."""
    return t.clone(memory_format=torch.contiguous_format)


def lcp(a: Row, b: Row) -> int:
    """Length of the common prefix, by binary search over C-speed slice comparisons."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def ancestry(node: Node) -> list[Node]:
    """``node`` and its ancestors, root excluded."""
    out = []
    cur: Node | None = node
    while cur is not None and cur.parent is not None:
        out.append(cur)
        cur = cur.parent
    return out


class KVTrie:
    """Key/value segments of earlier prompts, one trie per namespace, evicted in LRU order to
    stay within ``budget_bytes``; see the module docstring. Thread-safe (one re-entrant lock,
    which :class:`.kv_cache.KVCache` also holds while it computes)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self._lock = threading.RLock()
        self._roots: dict[Hashable, Node] = {}
        self._lru: OrderedDict[Node, None] = OrderedDict()
        self._pinned: set[Node] = set()
        self.bytes_used = 0
        self.evictions = 0

    @property
    def entries(self) -> int:
        return len(self._lru)

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
            protected: set[Node] = set()
            for node in self._pinned:
                protected.update(ancestry(node))
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

    def drop(self, namespace: Hashable) -> None:
        """Drop every entry of one namespace (an adapter that was unloaded), pinned ones too."""
        with self._lock:
            root = self._roots.pop(namespace, None)
            stack = list(root.children.values()) if root is not None else []
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                self._lru.pop(node, None)
                self._pinned.discard(node)
                self.bytes_used -= node.nbytes

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
    def _root(self, namespace: Hashable) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = Node((), None, None, None)
        return root

    def _match(self, root: Node, row: Row) -> tuple[int, list[tuple[Node, int]]]:
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

    def _node_at(self, root: Node, row: Row) -> Node | None:
        """The node ending exactly after ``row`` (splitting a segment if needed), or None."""
        depth, path = self._match(root, row)
        if depth < len(row) or not path:
            return None
        node, k = path[-1]
        if k < len(node.tokens):
            node = self._split(node, k)
        self._touch([n for n, _ in path[:-1]] + [node])
        return node

    def _touch(self, nodes: Sequence[Node]) -> None:
        # Deepest first, so that every node ends up after all its descendants.
        for node in reversed(nodes):
            self._lru.move_to_end(node)

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its first ``k`` tokens; returns the new parent (head) node."""
        assert node.parent is not None and node.keys is not None and node.values is not None
        head = Node(
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
        self, root: Node, row: Row, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store key/values of ``row[start:]`` (``keys``: ``[layers, heads, len - start, dim]``)."""
        depth, path = self._match(root, row)
        nodes = [n for n, _ in path]
        if depth >= len(row) or depth < start:
            # Already there (a duplicate or a full hit), or its prefix went meanwhile.
            self._touch(nodes)
            return
        parent = root
        off = depth - start
        if path:
            parent, k = path[-1]
            if k < len(parent.tokens):
                parent = self._split(parent, k)
                nodes[-1] = parent
            elif (
                not parent.children
                and not parent.pins
                and len(row) - depth + len(parent.tokens) <= GROW_MAX_TOKENS
            ):
                self._grow(parent, row[depth:], keys[:, :, off:], values[:, :, off:])
                self._touch(nodes)
                return
        child = Node(row[depth:], _own(keys[:, :, off:]), _own(values[:, :, off:]), parent)
        parent.children[child.tokens[0]] = child
        self.bytes_used += child.nbytes
        self._lru[child] = None
        self._touch([*nodes, child])

    def _grow(self, node: Node, tokens: Row, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append positions to a leaf's segment (a row that extends it, as an SMC particle's
        next step does), so that a particle's path stays a few segments long."""
        assert node.keys is not None and node.values is not None
        before = node.nbytes
        node.tokens += tokens
        node.keys = torch.cat((node.keys, keys), dim=2)
        node.values = torch.cat((node.values, values), dim=2)
        node.nbytes = _nbytes(node.keys) + _nbytes(node.values)
        self.bytes_used += node.nbytes - before

    def _remove(self, node: Node) -> None:
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
        victims: list[Node] = []
        doomed: set[Node] = set()
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

    def _unpin_node(self, node: Node) -> None:
        node.pins -= 1
        if not node.pins:
            self._pinned.discard(node)
