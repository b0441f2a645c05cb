"""Token trees: several candidate continuations verified in one target pass.

A tree's root is the last committed token (it opens every pass, as in a chain round); its
nodes are candidate tokens after it. Node i is written at slot n-1+1+i (the root at n-1),
sits at position n-1+depth(i), and sees the committed context and its own ancestors only:
a tree is a mask. The target's rows judge every node at once; the longest path the target
agrees with wins (accept.py), and its nodes' K/V move into the slots a chain would have
written them to.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class DraftTree:
    """Candidate nodes in depth-first order, each node's children in order of preference, so
    that the first children from the root form the main chain, written where a chain round
    would write it.

    tokens [N] int64; parents [N] int64 (-1: a child of the root, else the index of a node
    before it); probs [N] (optional): the drafter's estimate that the target reaches the node.

    >>> t = DraftTree.chain(np.array([7, 8, 9]))
    >>> t.parents.tolist(), t.depths().tolist()
    ([-1, 0, 1], [1, 2, 3])
    """

    tokens: np.ndarray
    parents: np.ndarray
    probs: np.ndarray | None = None

    @classmethod
    def chain(cls, tokens: np.ndarray) -> "DraftTree":
        return cls(np.asarray(tokens, dtype=np.int64), np.arange(len(tokens), dtype=np.int64) - 1)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def depths(self) -> np.ndarray:
        """Each node's depth below the root (a root's child: 1)."""
        depth = np.empty(self.size, dtype=np.int64)
        for i, p in enumerate(self.parents.tolist()):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return depth

    def is_chain(self) -> bool:
        return bool(np.array_equal(self.parents, np.arange(self.size) - 1))

    def children(self, node: int) -> np.ndarray:
        """Indices of the children of `node` (-1: the root), in order of preference."""
        return np.flatnonzero(self.parents == node)

    def prune(self, n: int) -> "DraftTree":
        """The n most probable nodes (a subtree: no node is likelier than its parent), in
        depth-first order. Without probs, the first n in depth-first order."""
        if n >= self.size:
            return self
        if self.probs is None:
            keep = np.arange(n)
        else:  # most probable first, equals in depth-first order: a parent before its children
            keep = np.sort(np.argsort(-self.probs, kind="stable")[:n])
        remap = np.full(self.size, -1, dtype=np.int64)
        remap[keep] = np.arange(keep.shape[0])
        parents = self.parents[keep]
        parents = np.where(parents < 0, -1, remap[np.maximum(parents, 0)])
        if (parents[self.parents[keep] >= 0] < 0).any():
            raise ValueError("prune: a kept node's parent was dropped (probs must not grow with depth)")
        return DraftTree(self.tokens[keep], parents, None if self.probs is None else self.probs[keep])

    def main_chain(self) -> np.ndarray:
        """The first children from the root down: the nodes a chain round would propose."""
        out, node = [], -1
        while True:
            kids = self.children(node)
            if kids.size == 0:
                return self.tokens[np.asarray(out, dtype=np.int64)]
            node = int(kids[0])
            out.append(node)

    def layout(self) -> "TreeLayout":
        """The pass that verifies this tree: the root then the nodes, their position offsets and
        who sees whom."""
        t = self.size + 1
        offsets = np.zeros(t, dtype=np.int64)
        visible = np.zeros((t, t), dtype=bool)
        visible[0, 0] = True
        for i, p in enumerate(self.parents.tolist()):
            row = i + 1
            parent_row = 0 if p < 0 else p + 1
            offsets[row] = offsets[parent_row] + 1
            visible[row] = visible[parent_row]
            visible[row, row] = True
        return TreeLayout(offsets, visible)


@dataclass
class TreeLayout:
    """A verify pass of T = 1 + nodes tokens written at slots start..start+T-1: `offsets` [T]
    each token's position past `start` (its depth), `visible` [T, T] which of the pass's
    tokens each row sees (its ancestors and itself); every row sees all slots before start.

    >>> lay = DraftTree(np.array([5, 6, 7]), np.array([-1, 0, -1])).layout()
    >>> lay.offsets.tolist(), lay.visible.astype(int).tolist()
    ([0, 1, 2, 1], [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]])
    """

    offsets: np.ndarray
    visible: np.ndarray
