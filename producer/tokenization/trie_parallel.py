"""Torch version of the character trie: whole batches of weight vectors at once.

Weight sums are one sparse matrix product with the leaf-to-ancestor reachability matrix; maxima
are one ``scatter_reduce`` along the same (leaf, ancestor) pairs. Both run on any torch device,
so a GPU worker computes the trie masses next to the logits it just produced. Results come back
as float32 numpy arrays, as genlm-backend 0.3.1's ``ParallelTokenCharacterTrie`` returns them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from producer.tokenization.trie import IntArray, TokenCharacterTrie, WeightArray

__all__ = ["ParallelTokenCharacterTrie", "resolve_device"]


def resolve_device(device: str | torch.device | None) -> str:
    """The device to compute on: the one asked for, else CUDA when present, else the CPU.

    Raises:
        ValueError: ``device`` is not a torch device name.
    """
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"Invalid device: {device!r}; expected a torch device or None") from e
    return str(device)


class ParallelTokenCharacterTrie(TokenCharacterTrie):
    """:class:`~producer.tokenization.trie.TokenCharacterTrie` computing weights with torch on
    ``device``.

    Attributes (besides the trie's):
        device: Device name the weights are computed on.
        M: ``(leaves, nodes)`` sparse CSR float32 matrix, ``M[i, n] = 1`` when node ``n`` is
            leaf ``i`` (the ``i``-th row of ``idx_to_leaf``) or one of its ancestors.
        src_indices / dst_indices: The (leaf row, node) pairs of ``M``, leaf by leaf from
            the leaf up to the root.
        positions: Index in ``decode`` of each leaf row.
    """

    def __init__(
        self, decode: Sequence[Any], device: str | torch.device | None = None, **kwargs: Any
    ) -> None:
        super().__init__(decode, **kwargs)
        self.device = resolve_device(device)
        self._build_reachability_matrix()
        self.positions = torch.tensor(self.idx_to_leaf[:, 0], dtype=torch.long, device=self.device)

    def _ancestor_pairs(self) -> tuple[IntArray, IntArray]:
        """``(leaf row, node)`` for each leaf and each of its ancestors, itself included,
        ordered by leaf row and then from the leaf upwards."""
        parent = self.parent_array()
        rows: list[IntArray] = []
        cols: list[IntArray] = []
        leaf_rows = np.arange(len(self.idx_to_leaf), dtype=np.int64)
        current = self.idx_to_leaf[:, 1].astype(np.int64)
        while len(current):
            rows.append(leaf_rows)
            cols.append(current)
            up = parent[current]
            keep = up >= 0
            leaf_rows, current = leaf_rows[keep], up[keep]
        if not rows:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        all_rows, all_cols = np.concatenate(rows), np.concatenate(cols)
        by_leaf = np.argsort(all_rows, kind="stable")  # steps were appended upwards
        return all_rows[by_leaf], all_cols[by_leaf]

    def _build_reachability_matrix(self) -> None:
        rows, cols = self._ancestor_pairs()
        self.src_indices = torch.from_numpy(rows).to(self.device)
        self.dst_indices = torch.from_numpy(cols).to(self.device)
        indices = torch.stack([self.src_indices, self.dst_indices])
        values = torch.ones(len(rows), device=self.device)
        shape = (len(self.idx_to_leaf), len(self.children))
        with warnings.catch_warnings():  # torch's notice that sparse CSR is a beta feature
            warnings.filterwarnings("ignore", "Sparse CSR tensor support", UserWarning)
            coo = torch.sparse_coo_tensor(indices, values, shape, check_invariants=False)
            self.M = coo.to_sparse_csr()

    # Takes a batch, unlike the parent's, as genlm-backend's does.
    def _preprocess_ws(self, batch_ws: Any) -> torch.Tensor:  # type: ignore[override]
        """A batch of weight vectors as one ``(batch, vocab)`` float32 tensor on ``device``.

        Raises:
            ValueError: a vector does not have one weight per vocabulary entry.
        """
        if isinstance(batch_ws, torch.Tensor | np.ndarray) and batch_ws.ndim == 2:
            stacked = self._to_device(batch_ws)
            self._check_length(stacked.shape[1])
            return stacked
        rows = [self._to_device(ws) for ws in batch_ws]
        for ws in rows:
            if ws.ndim != 1:
                raise ValueError(f"Expected a 1-D weight vector, got shape {tuple(ws.shape)}")
            self._check_length(ws.shape[0])
        if not rows:
            return torch.empty((0, len(self.decode)), dtype=torch.float32, device=self.device)
        return torch.stack(rows)

    def _to_device(self, ws: Any) -> torch.Tensor:
        if not isinstance(ws, torch.Tensor):
            return torch.tensor(np.asarray(ws), device=self.device, dtype=torch.float32)
        return ws.detach().to(device=self.device, dtype=torch.float32)

    def weight_sum(self, ws: Any) -> WeightArray:
        """Sum of the weights of the tokens below each node, as float32.

        Args:
            ws: Token weights (tensor, array or list), ``ws[i]`` for ``decode[i]``.
        """
        return self.batch_weight_sum(self._preprocess_ws([ws]))[0, :]

    def batch_weight_sum(self, ws: Any) -> WeightArray:
        """:meth:`weight_sum` of each vector of a batch (a 2-D tensor/array or a sequence of
        vectors), as a ``(batch, nodes)`` array."""
        leaf_ws = self._preprocess_ws(ws)[:, self.positions]
        sums: torch.Tensor = torch.sparse.mm(leaf_ws, self.M)
        return sums.cpu().numpy()

    def weight_max(self, ws: Any) -> WeightArray:
        """Largest weight of the tokens below each node, as float32 (see :meth:`weight_sum`)."""
        return self.batch_weight_max(self._preprocess_ws([ws]))[0, :]

    def batch_weight_max(self, ws: Any) -> WeightArray:
        """:meth:`weight_max` of each vector of a batch, as a ``(batch, nodes)`` array."""
        leaf_ws = self._preprocess_ws(ws)[:, self.positions]
        batch_size = leaf_ws.shape[0]
        result = torch.zeros((batch_size, len(self.children)), device=self.device)
        result.scatter_reduce_(
            dim=1,
            index=self.dst_indices.expand(batch_size, -1),
            src=leaf_ws[:, self.src_indices],
            reduce="amax",
            include_self=False,
        )
        return result.cpu().numpy()
