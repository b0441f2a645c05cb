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

A generation's rounds are judged by its `Judge` (Session's rounds and a batch's lanes alike):
the request's penalties, then its grammar's mask, applied to each row under the tokens before
it, then `accept_chain` / `accept_path`, which look the three rules up by name here, then the
log probabilities of the tokens it commits, where the request asks for them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np

from specdeploy.runtime.decoding.drafters.proposal import Proposal
from specdeploy.runtime.decoding.engine import Checked
from specdeploy.runtime.decoding.grammar import Constraint, mask_rows
from specdeploy.runtime.decoding.sampling import EMPTY, SamplingParams, penalize, sample, warp
from specdeploy.runtime.decoding.tree import DraftTree


class TokenLogprob(NamedTuple):
    """A committed token's log probability under the target's row that chose it (its raw
    logits, before penalties, temperature and filters, as vLLM reports them by default), and
    the likeliest tokens of that row with theirs (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Judge:
    """One generation's verdicts on its rounds: its sampling settings and random stream, the
    prompt's length (penalties count what follows it), its grammar (`constraint`: what drafts it
    cuts and forces, and each row's mask), and the log probabilities of the tokens it commits
    when `logprobs` (alternatives per token) is not None."""

    def __init__(self, params: SamplingParams, rng: np.random.Generator, prompt_len: int, logprobs: int | None = None,
                 constraint: Constraint | None = None):
        self.params, self.rng, self.prompt_len, self.logprobs = params, rng, prompt_len, logprobs
        self.constraint = constraint  # the request's grammar (chain rounds only: see session.chain_nodes)
        self._round: list[TokenLogprob] = []

    @property
    def needs_rows(self) -> bool:
        """Whether a round needs every row's logits on the host (not only its argmaxes)."""
        return self.params.penalized or self.logprobs is not None or self.constraint is not None

    def chain(self, ids: np.ndarray, checked: Checked) -> tuple[int, int]:
        """A chain round's verdict (`accept_chain`) on rows that follow the committed `ids`:
        each row penalized, then masked by the grammar, under the tokens before it."""
        raw, drafts = checked.target_logits, checked.draft_tokens
        logits = self._rows(raw, ids, lambda: [drafts[:i] for i in range(drafts.shape[0] + 1)], drafts)
        if logits is not raw:
            checked = replace(checked, target_logits=logits,
                              target_tokens=logits.argmax(axis=-1) if self.params.greedy else None)
        n, token = accept_chain(checked, self.params, self.rng)
        self._commit(raw, list(range(n + 1)), drafts[:n].tolist() + [token])
        return n, token

    def admissible(self, tokens: np.ndarray, probs: np.ndarray | None, after: np.ndarray = EMPTY) -> np.ndarray:
        """Drafts (that follow `after`) cut before the first the grammar forbids: it could never
        be accepted, and the rows after it are wasted. Point-mass drafts only (n-gram, greedy,
        forced): a sampled draft's rejection there draws from the residual p - q, which a cut
        would skip."""
        if self.constraint is None or (probs is not None and not self.params.greedy):
            return tokens
        return tokens[: self.constraint.valid(tokens, after)]

    def cut(self, proposal: Proposal) -> Proposal:
        """A drafter's proposal cut where the grammar leaves it (`admissible`)."""
        if self.constraint is None:
            return proposal
        kept = self.admissible(proposal.tokens, proposal.probs)
        return replace(proposal, tokens=kept, probs=None if proposal.probs is None else proposal.probs[: kept.shape[0]])

    def forced(self, most: int) -> np.ndarray:
        """Up to `most` tokens the grammar forces from here (each the only one it allows): drafts
        that cost no lookup and hold for certain."""
        if self.constraint is None or most <= 0:
            return EMPTY
        return np.asarray(self.constraint.forced()[:most], dtype=np.int64)

    def tree(self, ids: np.ndarray, tree: DraftTree, logits: np.ndarray, tokens: np.ndarray | None) -> tuple[list[int], int]:
        """A tree round's verdict (`accept_path`) on rows [N+1] (row 0 the root's) after `ids`."""
        assert self.constraint is None or tree.is_chain(), "a grammar's masks follow chains (session.chain_nodes)"
        raw = logits
        logits = self._rows(raw, ids, lambda: [EMPTY] + [tree.tokens[path_to(tree, j)] for j in range(tree.size)],
                            tree.tokens)
        if logits is not raw:
            tokens = logits.argmax(axis=-1) if self.params.greedy else None
        path, token = accept_path(tree, logits, tokens, self.params, self.rng)
        self._commit(raw, [0] + [j + 1 for j in path], tree.tokens[path].tolist() + [token])
        return path, token

    def _rows(self, raw: np.ndarray, ids: np.ndarray, before, chain: np.ndarray) -> np.ndarray:
        """The rows as the acceptance rule reads them: penalized under the tokens before each
        (`before()`: per row, the drafts on its path), then masked by the grammar along `chain`
        (the drafts, in order). `raw` itself where neither applies."""
        logits = raw
        if self.params.penalized:
            logits = penalize(raw, self.params, ids, self.prompt_len, before())
        if self.constraint is not None:
            logits = mask_rows(logits, self.constraint.masks(chain))
        return logits

    def _commit(self, raw: np.ndarray, rows: list[int], tokens: list[int]) -> None:
        """The round's committed tokens into the grammar's state, and their logprobs from `rows`."""
        if self.constraint is not None:
            self.constraint.commit(tokens)
        if self.logprobs is not None:
            self._round = [token_logprob(raw[r], t, self.logprobs) for r, t in zip(rows, tokens)]

    def take(self, m: int) -> list[TokenLogprob] | None:
        """The last round's first m committed tokens' log probabilities (the round may commit
        fewer than it judged: an EOS or the token limit cuts it); None where not asked for."""
        return None if self.logprobs is None else self._round[:m]


def path_to(tree: DraftTree, node: int) -> list[int]:
    """The nodes from the root's first child down to `node`, in order."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return path[::-1]


def token_logprob(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s log probability under the logits `row` [V] and the row's `top` likeliest
    tokens with theirs (float64 log-softmax; ties in the order of their ids)."""
    z = row.astype(np.float64)
    z = z - z.max()
    logp = z - np.log(np.exp(z).sum())
    best = np.argpartition(-logp, top - 1)[:top] if top else np.empty(0, dtype=np.int64)
    best = best[np.lexsort((best, -logp[best]))]
    return TokenLogprob(int(token), float(logp[token]), tuple((int(t), float(logp[t])) for t in best))


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
