"""The token trie behind the hf backend's key/value cache (:mod:`.kv_cache`): which slots of the
arena (:mod:`.kv_slots`) hold which prefix, LRU eviction in bytes, pins. It stores key/values;
computing them is :class:`.kv_cache.KVCache`'s.

Layout: a radix trie per namespace (LoRA adapter, ``None`` for the base model). Each node holds
a *segment* of tokens and the arena slots of those positions. A prefix is the concatenation of
the segments along its path, so a shared prefix is stored once however many prompts extend it.
A row that extends a leaf grows the leaf's segment (up to ``GROW_MAX_TOKENS``) instead of
hanging a one-token node under it, so the path of a sequence decoded token by token stays short.
A branch in the middle of a segment splits it into two nodes, which share no slot. Nothing here
copies key/values: splitting and growing move slot numbers, and eviction frees a leaf's slots.

Eviction is least-recently-used in bytes: only leaves go, and a request touches its whole path,
deepest node first, so the order always lists a node after all its descendants and the oldest
entry is a leaf. Pinned prefixes (and their ancestors) are never evicted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from worker.backends.hf.kv_slots import SlotArena

Row = tuple[int, ...]
GROW_MAX_TOKENS = 64
"""A leaf grows in place while it holds at most this many tokens; past that, new positions
start a child segment, so that a path's segments stay few and its slot arrays short."""
NO_SLOTS = np.empty(0, dtype=np.int64)


class Node:
    """A segment of tokens and the arena slots of those positions (none at a namespace's
    root)."""

    __slots__ = ("children", "nbytes", "parent", "pins", "slots", "tokens")

    def __init__(self, tokens: Row, slots: np.ndarray, parent: Node | None, nbytes: int) -> None:
        self.tokens = tokens
        self.slots = slots
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.pins = 0
        self.nbytes = nbytes


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

    def __init__(self, budget_bytes: int, arena: SlotArena) -> None:
        self.budget_bytes = int(budget_bytes)
        self.arena = arena
        arena.set_budget(self.budget_bytes)
        self._lock = threading.RLock()
        self._roots: dict[Hashable, Node] = {}
        self._lru: OrderedDict[Node, None] = OrderedDict()
        self._pinned: set[Node] = set()
        self._later: list[Callable[[], None]] = []
        """Stores left for :meth:`settle` (:class:`.kv_cache.KVCache`'s ``defer``)."""
        self.bytes_used = 0
        self.evictions = 0

    @property
    def unsettled(self) -> bool:
        """Whether a pass left its stores for :meth:`settle`."""
        return bool(self._later)

    def settle(self) -> None:
        """Do the stores that passes left for later, then evict down to the budget. Every other
        method that reads or changes the trie calls it first; until then ``bytes_used`` and
        ``entries`` leave those positions out."""
        with self._lock:
            if not self._later:
                return
            later, self._later = self._later, []
            for store in later:
                store()
            self._evict()

    @property
    def entries(self) -> int:
        return len(self._lru)

    @property
    def arena_bytes(self) -> int:
        """Memory of the arena's slots, free ones and the zero slot included."""
        return (self.arena.capacity + 1) * self.arena.slot_bytes

    def unpin(self, prefix_ids: Sequence[int], namespace: Hashable = None) -> bool:
        """Undo one ``pin``; False when the prefix is not pinned."""
        with self._lock:
            self.settle()
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
            self.settle()
            self.budget_bytes = int(budget_bytes)
            self.arena.set_budget(self.budget_bytes)
            self._evict()

    def clear(self) -> None:
        """Drop every entry, pinned ones included, and give the arena's memory back; counters
        other than sizes are kept."""
        with self._lock:
            self._later.clear()
            self._roots.clear()
            self._lru.clear()
            self._pinned.clear()
            self.bytes_used = 0
            self.arena.release()

    def drop(self, namespace: Hashable) -> None:
        """Drop every entry of one namespace (an adapter that was unloaded), pinned ones too."""
        with self._lock:
            self.settle()
            root = self._roots.pop(namespace, None)
            stack = list(root.children.values()) if root is not None else []
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                self._lru.pop(node, None)
                self._pinned.discard(node)
                self.bytes_used -= node.nbytes
                self.arena.free(node.slots)

    def measured_bytes(self) -> int:
        """Bytes of the distinct arena slots the trie's nodes hold, found by walking it; -1 when
        the arena counts a different number of slots in use (a slot lost or shared)."""
        with self._lock:
            self.settle()
            held = [node.slots for node in self._lru]
            slots = np.unique(np.concatenate(held)) if held else NO_SLOTS
            if len(slots) != self.arena.used_slots or len(slots) != sum(map(len, held)):
                return -1
            return len(slots) * self.arena.slot_bytes

    def cached_length(self, ids: Sequence[int], namespace: Hashable = None) -> int:
        """How many leading tokens of ``ids`` the cache holds now."""
        with self._lock:
            self.settle()
            return self._match(self._root(namespace), tuple(ids))[0]

    # -- the trie -----------------------------------------------------------------------
    def _root(self, namespace: Hashable) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = Node((), NO_SLOTS, None, 0)
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
        assert node.parent is not None
        size = self.arena.slot_bytes
        head = Node(node.tokens[:k], node.slots[:k], node.parent, k * size)
        node.parent.children[head.tokens[0]] = head
        node.tokens = node.tokens[k:]
        node.slots = node.slots[k:]
        node.nbytes = len(node.tokens) * size
        node.parent = head
        head.children[node.tokens[0]] = node
        self._lru[head] = None
        return head

    def _insert(self, root: Node, row: Row, start: int) -> tuple[int, np.ndarray] | None:
        """Make room in the trie for ``row[start:]``'s key/values; returns where the caller is
        to write them: the offset of the first position to store past ``start`` and its slots
        (one per position to the row's end). None when nothing is to be stored: the row is there
        already (a duplicate or a full hit), its prefix went meanwhile, or the arena is full."""
        depth, path = self._match(root, row)
        nodes = [n for n, _ in path]
        if depth >= len(row) or depth < start:
            self._touch(nodes)
            return None
        slots = self.arena.alloc(len(row) - depth)
        if slots is None:
            self._touch(nodes)
            return None
        size = self.arena.slot_bytes
        self.bytes_used += len(slots) * size
        parent = root
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
                # a row that extends a leaf (an SMC particle's next step) grows it, so that a
                # particle's path stays a few segments long
                parent.tokens += row[depth:]
                parent.slots = np.concatenate((parent.slots, slots))
                parent.nbytes = len(parent.tokens) * size
                self._touch(nodes)
                return depth - start, slots
        child = Node(row[depth:], slots, parent, len(slots) * size)
        parent.children[child.tokens[0]] = child
        self._lru[child] = None
        self._touch([*nodes, child])
        return depth - start, slots

    def _remove(self, node: Node) -> None:
        assert node.parent is not None and not node.children
        del node.parent.children[node.tokens[0]]
        del self._lru[node]
        self.bytes_used -= node.nbytes
        self.arena.free(node.slots)
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
