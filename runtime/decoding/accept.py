"""The acceptance rule: which drafted tokens the target's verify pass commits, and the
token of its own that follows them (docs/design.md, "The round"). Pure functions on arrays.

Roles in names: `target_tokens [k+1]` (greedy: the verify rows' argmaxes), `target_probs
[k+1, V]` (the warped verify rows), `draft_probs [k, V]` (None: a point mass on each drafted
token, as for n-gram drafts).

- Greedy chain: the longest prefix the target's argmaxes agree with, then the argmax after it.
- Sampled chain, lossless rejection sampling (Leviathan et al. 2023; Chen et al. 2023):
  accept drafted x with probability min(1, p(x) / q(x)); at the first rejection sample from
  norm(max(0, p - q)); after k acceptances sample the bonus token from p. The output then has
  exactly the target's distribution, whatever the draft proposes.
- Tree: walk from the root, following the child that carries the target's token for each row.

The round calls `accept_chain` / `accept_path`, which look the three rules up by name here.
"""
from __future__ import annotations

import numpy as np

from specdeploy.runtime.decoding.engine import Checked
from specdeploy.runtime.decoding.sampling import SamplingParams, sample, warp
from specdeploy.runtime.decoding.tree import DraftTree


def accept_chain(checked: Checked, params: SamplingParams, rng: np.random.Generator) -> tuple[int, int]:
    """Accept the longest prefix the target agrees with, then take the target's own token:
    the correction at the first disagreement, or the bonus after k' agreements.
    -> (accepted count, next token)."""
    if params.greedy:
        tokens = checked.target_tokens if checked.target_tokens is not None else checked.target_logits.argmax(axis=-1)
        return accept_greedy(checked.draft_tokens, tokens)
    return accept_sampled(checked.draft_tokens, checked.draft_probs, warp(checked.target_logits, params), rng)


def accept_path(tree: DraftTree, target_logits: np.ndarray, target_tokens: np.ndarray | None,
                params: SamplingParams, rng: np.random.Generator) -> tuple[list[int], int]:
    """A tree pass's verdict: target_logits [N+1, V] (row 0 the root's), target_tokens [N+1]
    their argmaxes where greedy. -> (the accepted path's node indices, the token after it)."""
    if params.greedy:
        return accept_tree(tree, lambda row: target_tokens[row])
    return accept_tree(tree, lambda row: sample(warp(target_logits[row], params), rng))


def accept_greedy(draft_tokens: np.ndarray, target_tokens: np.ndarray) -> tuple[int, int]:
    """-> (accepted count, the target's own next token). target_tokens [k+1]: its argmaxes.

    >>> accept_greedy(np.array([4, 5, 6]), np.array([4, 5, 9, 2]))
    (2, 9)
    """
    agree = draft_tokens == target_tokens[:-1]
    n = int(agree.argmin()) if not agree.all() else agree.shape[0]
    return n, int(target_tokens[n])


def accept_sampled(
    draft_tokens: np.ndarray,
    draft_probs: np.ndarray | None,
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Rejection sampling over k drafted tokens -> (accepted count, next token).

    draft_tokens [k], draft_probs [k, V] or None (point mass), target_probs [k+1, V].
    """
    k = draft_tokens.shape[0]
    for i in range(k):
        x = int(draft_tokens[i])
        p = target_probs[i, x]
        q = 1.0 if draft_probs is None else draft_probs[i, x]
        if q > 0 and rng.random() * q < p:  # accept with probability min(1, p/q)
            continue
        residual = target_probs[i].copy()
        if draft_probs is None:
            residual[x] = 0.0
        else:
            residual = np.maximum(residual - draft_probs[i], 0.0)
        if residual.sum() <= 0.0:  # p == q up to rounding: the residual is empty, p is exact
            residual = target_probs[i]
        return i, sample(residual, rng)
    return k, sample(target_probs[k], rng)


def accept_tree(tree: DraftTree, row_tokens) -> tuple[list[int], int]:
    """Walk the tree from the root: at each node take the target's token for its row
    (`row_tokens(row)`: row 0 is the root's, row i+1 node i's) and follow the child that
    carries it; stop where none does. -> (the accepted path's node indices, the target's own
    token after it). Greedy: the row's argmax. Sampled: a draw from the row's distribution,
    which keeps exactly the target's distribution for model-free candidates (point masses):
    each committed token is a draw from the target given the tokens before it.

    >>> t = DraftTree(np.array([5, 6, 7, 8]), np.array([-1, 0, -1, 2]))
    >>> accept_tree(t, lambda row: {0: 7, 3: 8, 4: 9}[row])
    ([2, 3], 9)
    """
    child = {(int(p), int(tok)): i for i, (p, tok) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()))}
    path, node = [], -1
    while True:
        token = int(row_tokens(node + 1))
        nxt = child.get((node, token))
        if nxt is None:
            return path, token
        path.append(nxt)
        node = nxt
