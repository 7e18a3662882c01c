"""Character trie over a token vocabulary, with per-node weight sums and maxima.

genlm-control turns a token-level LM into a byte-level one by walking a trie of the token
byte strings: the weight of a prefix node is the total (or best) weight of all tokens below
it. This module reproduces genlm-backend 0.3.1's ``TokenCharacterTrie`` node for node, so
genlm-control can walk ours (``root``, ``children``, ``word2leaf``, ``leaf2word``...) exactly
as it walks theirs:

* every vocabulary entry gets its own leaf, hung below the node of its last byte by the edge
  ``(None, index)``, so tokens sharing their bytes stay distinct;
* nodes are numbered in post-order (children before parents, root last), the order
  genlm-backend renames them to;
* ``word2leaf`` is keyed by ``(bytes, token_id)`` for tokens and by the item itself for
  anything else (plain ``bytes``, which is deprecated, or e.g. an end-of-sequence marker).

The weights are computed with numpy one trie level at a time instead of genlm-backend's numba
loop, so numba is not needed. :mod:`producer.tokenization.trie_parallel` (torch, any device)
and :mod:`producer.tokenization.trie_async` (auto-batching) build on this class and import it;
this module imports neither. All three are importable from :mod:`producer.tokenization`.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Hashable, Iterable, Iterator, Sequence
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["TokenCharacterTrie", "check_weight_count", "is_leaf_edge"]

LeafEdge = tuple[None, int]
"""Edge from the node of a token's last byte to its leaf: ``(None, index in decode)``."""

FloatArray = npt.NDArray[np.float64]
WeightArray = npt.NDArray[np.floating[Any]]
"""Node weights: float64 from the numpy trie, float32 from the torch one."""
IntArray = npt.NDArray[np.int64]


def is_leaf_edge(label: object) -> bool:
    """Whether a ``children`` key is a leaf edge ``(None, index)`` rather than a byte."""
    return isinstance(label, tuple) and len(label) == 2 and label[0] is None


def _is_token(item: object) -> bool:
    """A token is ``bytes`` carrying an int ``token_id`` (ours or genlm-backend's Token)."""
    return isinstance(item, bytes) and isinstance(getattr(item, "token_id", None), int)


_TRIE_MODULES = __name__  # this module, trie_parallel and trie_async


def _caller_stacklevel() -> int:
    """Stack level of the first frame outside the trie modules, so that a warning points at
    the code that passed the vocabulary rather than at a constructor calling its parent."""
    level = 1
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_TRIE_MODULES):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


class TokenCharacterTrie:
    """Trie of the byte strings of ``decode``, computing per-node weight sums and maxima.

    Attributes:
        decode: The vocabulary, as given; ``ws[i]`` is always the weight of ``decode[i]``.
        root: Index of the root node (the last node, as numbering is post-order).
        children: ``children[node]`` maps a byte (or item) to a child node, and a leaf edge
            ``(None, i)`` to the leaf of ``decode[i]``.
        word2leaf / leaf2word: Vocabulary key <-> leaf node.
        idx_to_leaf: ``int32`` array of ``(index in decode, leaf node)`` rows, in vocabulary
            order. ``token_id_to_leaf`` is the same array under genlm-backend's older name.
        leaf2token_id: Leaf node -> index in ``decode`` (== token id for a decoded vocab).
        jump: Sorted child indices of each node.
        ordering: Internal (non-leaf) nodes, children before parents.
        node2prefix: Node -> list of the bytes (items) on the path from the root.
    """

    def __init__(self, decode: Sequence[Any]) -> None:
        self.decode = decode
        self.root = 0
        self.children: list[dict[Any, int]] = [{}]
        self.word2leaf: dict[Hashable, int] = {}
        leaves = self._insert_all(decode)
        new_id = self._renumber(_post_order(self.children, self.root))
        self.idx_to_leaf = np.array(
            [(i, new_id[leaf]) for i, leaf in leaves], dtype=np.int32
        ).reshape(-1, 2)
        self._index()

    # -- construction ------------------------------------------------------------------------

    def _insert_all(self, decode: Sequence[Any]) -> list[tuple[int, int]]:
        """Insert every entry; returns ``(index, leaf)`` pairs in the pre-renumbering ids."""
        leaves = []
        warned = False
        for idx, item in enumerate(decode):
            if _is_token(item):
                word, key = bytes(item), (bytes(item), item.token_id)
            else:
                if isinstance(item, bytes) and not warned:
                    warnings.warn(
                        "Passing plain bytes to TokenCharacterTrie is deprecated. "
                        "Use Token objects from decode_vocab() instead.",
                        DeprecationWarning,
                        stacklevel=_caller_stacklevel(),
                    )
                    warned = True
                word, key = item, item
            leaf = self._add_leaf(self._walk_or_grow(word), idx)
            if key in self.word2leaf:
                raise ValueError(f"Duplicate word in vocabulary: {key}")
            self.word2leaf[key] = leaf
            leaves.append((idx, leaf))
        return leaves

    def _walk_or_grow(self, word: Iterable[Any]) -> int:
        """Node reached by spelling ``word`` from the root, creating missing nodes."""
        node = self.root
        for letter in word:
            child = self.children[node].get(letter)
            if child is None:
                child = self.children[node][letter] = self._new_node()
            node = child
        return node

    def _add_leaf(self, node: int, idx: int) -> int:
        leaf = self.children[node][(None, idx)] = self._new_node()
        return leaf

    def _new_node(self) -> int:
        self.children.append({})
        return len(self.children) - 1

    def _renumber(self, order: list[int]) -> IntArray:
        """Rename nodes so their ids follow ``order`` (post-order: parents after children),
        which keeps a node's subtree in a contiguous range just below it; returns the map
        from old to new ids."""
        new_id = np.empty(len(order), dtype=np.int64)
        new_id[order] = np.arange(len(order))
        new_children: list[dict[Any, int]] = [{} for _ in order]
        for old, kids in enumerate(self.children):
            new_children[new_id[old]] = {label: int(new_id[c]) for label, c in kids.items()}
        self.children = new_children
        self.root = int(new_id[self.root])
        self.word2leaf = {w: int(new_id[leaf]) for w, leaf in self.word2leaf.items()}
        return new_id

    def _index(self) -> None:
        """Derived lookups, all in final node ids."""
        self.leaf2word = dict(zip(self.word2leaf.values(), self.word2leaf.keys(), strict=True))
        self.token_id_to_leaf = self.idx_to_leaf
        self.leaf2token_id = {int(leaf): int(i) for i, leaf in self.idx_to_leaf}
        self.jump = [np.array(sorted(kids.values()), dtype=np.int32) for kids in self.children]
        is_leaf = np.zeros(len(self.children), dtype=bool)
        is_leaf[self.idx_to_leaf[:, 1]] = True
        self.ordering: IntArray = np.flatnonzero(~is_leaf).astype(np.int64)
        self._levels = self._build_levels()

    @cached_property
    def node2prefix(self) -> dict[int, list[Any]]:
        """Path labels from the root; a leaf has the prefix of its token's last-byte node.

        Built on first use: only drawings and tests need it, and it costs a list per node.
        """
        node2prefix: dict[int, list[Any]] = {self.root: []}
        for node in reversed(range(len(self.children))):  # parents before children
            for label, child in self.children[node].items():
                prefix = node2prefix[node]
                node2prefix[child] = prefix if is_leaf_edge(label) else [*prefix, label]
        return node2prefix

    def _build_levels(self) -> list[tuple[IntArray, IntArray, IntArray]]:
        """Per depth, deepest first: ``(parents, children, segment starts)`` such that the
        children of ``parents[k]`` are ``children[starts[k]:starts[k + 1]]``, sorted.

        A level's children are leaves or parents of a deeper level, so reducing levels in
        this order sees every child final before its parent.
        """
        edge_parent, edge_child = self.edges()
        depth = _depths(self.parent_array(), self.root)[edge_parent]
        levels = []
        for d in range(int(depth.max(initial=-1)), -1, -1):
            at_d = depth == d
            parents, starts = np.unique(edge_parent[at_d], return_index=True)
            levels.append((parents, edge_child[at_d], starts.astype(np.int64)))
        return levels

    def edges(self) -> tuple[IntArray, IntArray]:
        """Every edge as ``(parents, children)``, grouped by parent, children sorted."""
        counts = np.array([len(j) for j in self.jump], dtype=np.int64)
        parents = np.repeat(np.arange(len(self.jump), dtype=np.int64), counts)
        children = np.concatenate([*self.jump, np.empty(0, np.int32)]).astype(np.int64)
        return parents, children

    def parent_array(self) -> IntArray:
        """``parent[node]``, ``-1`` for the root."""
        parents, children = self.edges()
        parent = np.full(len(self.children), -1, dtype=np.int64)
        parent[children] = parents
        return parent

    # -- weights -----------------------------------------------------------------------------

    def _check_length(self, n: int) -> None:
        check_weight_count(len(self.decode), n)

    def _preprocess_ws(self, ws: Any) -> FloatArray:
        """One weight vector as a float64 numpy array on the CPU, its length checked."""
        if isinstance(ws, torch.Tensor):
            ws = _tensor_to_numpy(ws)
        arr = np.asarray(ws, dtype=np.float64)
        if arr.ndim != 1:
            raise ValueError(f"Expected a 1-D weight vector, got shape {arr.shape}")
        self._check_length(arr.shape[0])
        return arr

    def _stack(self, batch: Any) -> FloatArray:
        if isinstance(batch, torch.Tensor | np.ndarray) and batch.ndim == 2:
            if isinstance(batch, torch.Tensor):
                batch = _tensor_to_numpy(batch)
            self._check_length(batch.shape[1])
            return np.asarray(batch, dtype=np.float64)
        rows = [self._preprocess_ws(w) for w in batch]
        if not rows:
            return np.empty((0, len(self.decode)), dtype=np.float64)
        return np.stack(rows)

    def _propagate(self, ws: FloatArray, reduce: np.ufunc) -> FloatArray:
        """Node weights for a ``(batch, vocab)`` matrix: leaves take their token's weight,
        internal nodes ``reduce`` their children's, level by level from the deepest."""
        out = np.zeros((ws.shape[0], len(self.children)), dtype=np.float64)
        out[:, self.idx_to_leaf[:, 1]] = ws[:, self.idx_to_leaf[:, 0]]
        for parents, kids, starts in self._levels:
            out[:, parents] = reduce.reduceat(out[:, kids], starts, axis=1)
        return out

    def weight_sum(self, ws: Any) -> WeightArray:
        """Sum of the weights of the tokens below each node.

        Args:
            ws: Token weights (tensor, array or list), ``ws[i]`` for ``decode[i]``.

        Returns:
            float64 array of one weight per node.
        """
        return self._propagate(self._preprocess_ws(ws)[None, :], np.add)[0, :]

    def weight_max(self, ws: Any) -> WeightArray:
        """Largest weight of the tokens below each node (see :meth:`weight_sum`)."""
        return self._propagate(self._preprocess_ws(ws)[None, :], np.maximum)[0, :]

    def batch_weight_sum(self, ws: Any) -> WeightArray:
        """:meth:`weight_sum` of each weight vector of a batch, as a ``(batch, nodes)`` array."""
        return self._propagate(self._stack(ws), np.add)

    def batch_weight_max(self, ws: Any) -> WeightArray:
        """:meth:`weight_max` of each weight vector of a batch, as a ``(batch, nodes)`` array."""
        return self._propagate(self._stack(ws), np.maximum)

    # -- inspection --------------------------------------------------------------------------

    def _order(self, node: int) -> Iterator[int]:
        """Post-order of the internal nodes below ``node`` (leaf edges skipped)."""
        return (n for n in _post_order(self.children, node) if n not in self.leaf2word)

    def _order_full(self, node: int) -> Iterator[int]:
        """Post-order of every node below ``node``, leaves included."""
        return iter(_post_order(self.children, node))

    def visualize(self, ws: Any = None) -> Any:
        """Graphviz drawing of the trie, optionally shaded by one weight per node.

        Needs the ``graphviz`` package, imported only here.

        Raises:
            ValueError: ``ws`` does not have one weight per node.
        """
        return _render(self, ws)


def check_weight_count(vocab_size: int, n: int) -> None:
    """Raise unless ``n`` weights are one per entry of a ``vocab_size`` vocabulary.

    Raises:
        ValueError: ``n != vocab_size``.
    """
    if n != vocab_size:
        raise ValueError(f"Expected {vocab_size} token weights (one per vocabulary entry), got {n}")


def _tensor_to_numpy(ws: torch.Tensor) -> FloatArray:
    """float64 copy on the CPU; also takes bfloat16, which has no numpy dtype."""
    return ws.detach().to(device="cpu", dtype=torch.float64).numpy()


def _post_order(children: list[dict[Any, int]], start: int) -> list[int]:
    """Nodes below ``start`` in post-order, visiting children in insertion order.

    Iterative, as a recursive walk would overflow the stack on very long tokens.
    """
    order: list[int] = []
    stack: list[tuple[int, Iterator[int]]] = [(start, iter(children[start].values()))]
    while stack:
        node, kids = stack[-1]
        child = next(kids, None)
        if child is None:
            stack.pop()
            order.append(node)
        else:
            stack.append((child, iter(children[child].values())))
    return order


def _depths(parent: IntArray, root: int) -> IntArray:
    """Distance of each node from the root; parents have larger ids than their children."""
    depth = [0] * len(parent)
    parents = parent.tolist()
    for node in range(len(parents) - 1, -1, -1):
        if node != root:
            depth[node] = depth[parents[node]] + 1
    return np.array(depth, dtype=np.int64)


def _render(trie: TokenCharacterTrie, ws: Any) -> Any:
    """The graphviz drawing behind :meth:`TokenCharacterTrie.visualize`."""
    try:
        import graphviz
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Please install graphviz: pip install graphviz") from e
    n = len(trie.children)
    if ws is not None and len(ws) != n:
        raise ValueError(f"Weight vector length ({len(ws)}) must match number of nodes ({n})")
    dot = graphviz.Digraph(comment="Token Character Trie")
    dot.attr(rankdir="LR")
    _draw_legend(dot)
    for node in range(n):
        label = f"{node}\n'{trie.node2prefix[node]}'"
        if ws is not None:
            label += f"\n{ws[node]:.4f}"
        shape = "doublecircle" if node in trie.leaf2word else "circle"
        dot.node(str(node), label, shape=shape, style="filled", fillcolor=_shade(ws, node))
    for node, kids in enumerate(trie.children):
        for label, child in kids.items():
            text = f"End-of-Token (ID: {label[1]})" if is_leaf_edge(label) else str(label)
            dot.edge(str(node), str(child), label=text)
    return dot


def _draw_legend(dot: Any) -> None:
    with dot.subgraph(name="cluster_legend") as legend:
        legend.attr(label="Legend", fontsize="10")
        legend.attr("node", fontsize="7", width="0.1", height="0.1")
        legend.node(
            "legend_internal", "Internal Node ID\n'Prefix'\nWeight (if provided)", shape="circle"
        )
        legend.node("legend_leaf", "Complete Token", shape="doublecircle")
        legend.edge("legend_internal", "legend_leaf", label="Token item", fontsize="10")
        legend.attr(rankdir="TB")
        legend.attr(rank="same")


def _shade(ws: Any, node: int) -> str:
    """White for no weight, greener for a larger share of the largest node weight."""
    if ws is None:
        return "#ffffff"
    top = float(ws.max())
    if top <= 0:
        return "#ffffff"
    intensity = int(255 * (1 - float(ws[node]) / top))
    return f"#{intensity:02x}ff{intensity:02x}"
