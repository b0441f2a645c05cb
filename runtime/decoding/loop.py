"""The speculative loop: prefill, then rounds of draft -> verify -> accept.

Data flow: prompt ids -> prefill (chunks) -> rounds -> committed ids. The target's KV
cache always holds every committed token but the last, which opens the next pass: a
verify pass feeds [last, d1..dk] at positions n-1..n-1+k and its k+1 logit rows judge
d1..dk and give the token after them. Plain decoding is the same round with no draft.
"""
from __future__ import annotations

import math
import time

import numpy as np

from specdeploy.core.errors import BundleError

from specdeploy.runtime.decoding.drafters import Drafter
from specdeploy.runtime.decoding.engine import Checked, Engine
from specdeploy.runtime.decoding.policy import DraftLength, TreeSize
from specdeploy.runtime.decoding.sampling import SamplingParams, accept_greedy, sample, verify_sampled, warp
from specdeploy.runtime.decoding.stats import Stats
from specdeploy.runtime.decoding.tree import DraftTree, accept_tree


def prefill(target: Engine, ids: np.ndarray, chunk: int, start: int = 0) -> None:
    """Write K/V of every prompt token but the last (it opens the first round), from
    position `start` on (the cache holds the ones before). No chunk's logits are read: each
    asks for its last row only, so the head runs once a chunk, not once a token."""
    for at in range(start, ids.shape[0] - 1, chunk):
        target.forward(ids[at : min(at + chunk, ids.shape[0] - 1)], at, last=True)


class PromptCache:
    """Which token ids the target's KV buffers hold, so that the next prompt prefills only
    what it does not share with them (a chat's system prompt, the earlier turns).

    K/V at a position depend only on the tokens up to it, and a verify pass's rows equal
    single steps bit for bit, so reused K/V equal what a prefill would write. The record
    is `length` committed tokens, taken at the end of each round (the loop's invariant: the
    cache holds every committed token but the last). It is trusted only if the engine has
    run no pass since (its `runs` counter): anyone else's pass, or one that failed, may have
    written over it.
    """

    def __init__(self, max_seq: int):
        self.ids = np.empty(max_seq, dtype=np.int64)
        self.length = 0
        self.runs: int | None = None

    def reusable(self, target: Engine, prompt: np.ndarray) -> int:
        """How many leading prompt tokens (never the last: it opens the first round) have
        their K/V in the buffers already."""
        if self.runs is None or target.runs != self.runs:
            return 0
        m = min(self.length, prompt.shape[0] - 1)
        differ = np.flatnonzero(self.ids[:m] != prompt[:m])
        return int(differ[0]) if differ.size else m

    def hold(self, target: Engine, ids: np.ndarray, length: int) -> None:
        self.ids[:length] = ids[:length]
        self.length = length
        self.runs = target.runs


def speculative_round(
    target: Engine, drafter: Drafter | None, ids: np.ndarray, k: int, params: SamplingParams, rng: np.random.Generator,
    stats: Stats, min_confidence: float = 0.0,
) -> np.ndarray:
    """One round: draft up to k, verify k'+1 in one target pass, accept, correct or bonus.
    Returns the tokens it commits (1..k'+1). With k = 0 (or no drafter) it is one plain
    decoding step."""
    if params.greedy and (drafter is None or k == 0):
        token = plain_step(target, ids, stats)
        stats.record_round(k if drafter is not None else None, 0, 0)
        return np.array([token], dtype=np.int64)
    if drafter is not None and k > 0 and drafter.fused_with(target):
        checked = drafter.propose_and_verify(target, ids, k, params, rng)  # on the device, one host sync
    else:
        if drafter is not None and k > 0:
            draft_tokens, draft_probs = drafter.propose(ids, k, params, rng, min_confidence)  # [k'], [k', V] or None
        else:
            draft_tokens, draft_probs = ids[:0], None
        t0 = time.perf_counter()
        target_logits = target.forward(np.concatenate([ids[-1:], draft_tokens]), ids.shape[0] - 1)  # [k'+1, V]
        verify = time.perf_counter() - t0
        tokens = target_logits.argmax(axis=-1) if params.greedy else None
        check_finite(target, target_logits, ids.shape[0] - 1, tokens)
        checked = Checked(draft_tokens, draft_probs, target_logits, tokens, verify_seconds=verify)
    stats.verify_seconds += checked.verify_seconds
    stats.target_passes += 1
    n_accepted, next_token = accept(checked, params, rng)
    stats.record_round(k if drafter is not None else None, checked.draft_tokens.shape[0], n_accepted)
    return np.append(checked.draft_tokens[:n_accepted], next_token)


def plain_step(target: Engine, ids: np.ndarray, stats: Stats) -> int:
    """A greedy round with nothing drafted: one target pass at T = 1 and its argmax, with as
    little host work as the round allows (on the CPU a step's Python runs on caches the pass
    has just emptied, so each array operation it skips is worth a few microseconds)."""
    n = ids.shape[0]
    t0 = time.perf_counter()
    logits = target.forward(ids[n - 1 :], n - 1)
    stats.verify_seconds += time.perf_counter() - t0
    stats.target_passes += 1
    row = logits[0]
    token = int(row.argmax())
    if not math.isfinite(row[token]):  # argmax stops at a NaN: the row's maximum is what it found
        check_finite(target, logits, n - 1, np.array([token]))
    return token


def tree_round(
    target: Engine, drafter, ids: np.ndarray, sizes: TreeSize, max_depth: int, params: SamplingParams,
    rng: np.random.Generator, stats: Stats,
) -> np.ndarray:
    """One tree round: the drafter's candidate tree, cut to the size the policy chooses, judged
    by the target in one pass; the accepted path's K/V move to the slots a chain would have
    written them to. Returns the tokens it commits (the path and the target's own token).

    With `sizes.chains` the candidate is the drafter's chain (a model-free lookup, looked up
    before the policy decides how much of it to verify: the lookup is free, and what it found
    is the best guide to how far it holds), verified as a chain round."""
    n = ids.shape[0]
    seconds = drafter.seconds
    room = min(sizes.max_nodes, target.max_seq - n)  # node i is written at slot n + i
    if max_depth <= 0 or room <= 0:
        candidates = EMPTY_TREE
    elif sizes.chains:
        candidates = DraftTree.chain(drafter.propose(ids, min(room, max_depth), params, rng)[0])
    else:
        candidates = drafter.propose_tree(ids, room, max_depth)
    lookup = drafter.seconds - seconds
    tree = candidates.prune(sizes.choose(candidates.probs, candidates.size))
    t0 = time.perf_counter()
    if tree.size and not tree.is_chain():
        logits = target.forward(np.concatenate([ids[-1:], tree.tokens]), n - 1, tree=tree.layout())
    else:  # a chain (or nothing): the ordinary pass, whatever the target
        logits = target.forward(np.concatenate([ids[-1:], tree.tokens]), n - 1)
    verify = time.perf_counter() - t0
    tokens = logits.argmax(axis=-1) if params.greedy else None
    check_finite(target, logits, n - 1, tokens)
    if params.greedy:
        path, token = accept_tree(tree, lambda row: tokens[row])
    else:
        path, token = accept_tree(tree, lambda row: sample(warp(logits[row], params), rng))
    if path != list(range(len(path))):  # off the main chain: move the path's K/V into place
        target.move_kv(n + np.asarray(path, dtype=np.int64), n)
    stats.verify_seconds += verify
    stats.target_passes += 1
    if sizes.chains:
        stats.record_round(tree.size, tree.size, len(path))
    else:
        stats.record_tree(tree.size, len(path))
    sizes.update(tree.probs, tree.size, path, verify, lookup)
    return np.append(tree.tokens[path], token)


EMPTY_TREE = DraftTree(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), np.empty(0))


def check_finite(target: Engine, target_logits: np.ndarray, start: int, argmax: np.ndarray | None = None) -> None:
    """Stop on logits that are NaN or +inf (or a row that is all -inf): altered weights or a
    broken graph, which would otherwise decode as token 0 over and over.

    `argmax`: the rows' argmaxes, where the caller has them (greedy): numpy's argmax stops at
    a row's first NaN, so the values at the argmaxes are exactly the rows' maxima (NaN where
    a row has one), read without a second pass over every logit.
    """
    if argmax is not None:  # a few rows: Python floats cost less than numpy's small-array calls
        if all(math.isfinite(target_logits[i, j]) for i, j in enumerate(argmax.tolist())):
            return
        row_max = target_logits[np.arange(argmax.shape[0]), argmax]
    else:
        row_max = target_logits.max(axis=-1)
    bad = np.flatnonzero(~np.isfinite(row_max))
    if bad.size:
        raise BundleError(
            f"{target.name}: non-finite logits ({row_max[bad[0]]}) at position {start + int(bad[0])}: "
            "the bundle's weights or graph are broken; re-export the bundle"
        )


def accept(checked: Checked, params: SamplingParams, rng: np.random.Generator) -> tuple[int, int]:
    """Accept the longest prefix the target agrees with, then take the target's own token:
    the correction at the first disagreement, or the bonus after k' agreements.
    -> (accepted count, next token)."""
    if params.greedy:
        tokens = checked.target_tokens if checked.target_tokens is not None else checked.target_logits.argmax(axis=-1)
        return accept_greedy(checked.draft_tokens, tokens)
    return verify_sampled(checked.draft_tokens, checked.draft_probs, warp(checked.target_logits, params), rng)


def decode(
    target: Engine,
    drafter: Drafter | None,
    prompt_ids: np.ndarray,
    max_new_tokens: int,
    draft_len: DraftLength,
    eos_token_ids: list[int],
    prefill_chunk: int,
    params: SamplingParams,
    stats: Stats,
    cache: PromptCache | None = None,
    tree: TreeSize | None = None,
):
    """Yield the committed tokens of each round until EOS or max_new_tokens.

    With `tree` (a drafter that proposes trees, a target that verifies them) each round is a
    tree round of depth up to the draft length's maximum; else a chain round of k drafts.

    The caller has checked that prompt + max_new_tokens fits the bundle's max sequence.
    Host synchronisation: each engine pass returns its logits to the host once, so a round
    is one for the verify pass plus one per draft step (the drafter picks each token on the
    host), except a round over engines that chain the draft on the device (a model draft on
    the torch backend, or greedy on TensorRT engines with the argmax output): one per round.
    """
    t_start = time.perf_counter()
    rng = np.random.default_rng(params.seed)
    ids = np.empty(prompt_ids.shape[0] + max_new_tokens, dtype=np.int64)  # allocated once
    n = prompt_ids.shape[0]
    ids[:n] = prompt_ids
    stats.prompt_tokens = n
    reuse = cache.reusable(target, ids[:n]) if cache is not None else 0
    stats.cached_tokens = reuse
    if drafter is not None:
        if cache is None:
            drafter.reset()  # else it keeps its own K/V: its rollback reuses what agrees with ids
        passes0, seconds0 = drafter.passes, drafter.seconds
    prefill(target, ids[:n], prefill_chunk, start=reuse)
    if cache is not None:
        cache.hold(target, ids, n - 1)
    stats.prefill_seconds = time.perf_counter() - t_start
    eos = frozenset(int(t) for t in eos_token_ids)
    if drafter is None:
        passes0 = seconds0 = 0
    try:
        yield from _rounds(target, drafter, ids, n, max_new_tokens, draft_len, eos, params, rng, stats, cache, tree,
                           t_start, passes0, seconds0)
    finally:
        if drafter is not None and hasattr(drafter, "remember"):
            drafter.remember(ids[: n + stats.new_tokens])  # what the request said, for later ones


def _rounds(target, drafter, ids, n, max_new_tokens, draft_len, eos, params, rng, stats, cache, tree, t_start,
            passes0, seconds0):
    produced = 0
    stats.finish_reason = "length"
    while produced < max_new_tokens:
        if tree is not None:  # never past the tokens still wanted: they would be thrown away
            new = tree_round(target, drafter, ids[:n], tree, min(draft_len.max_k, max_new_tokens - produced - 1),
                             params, rng, stats)
            k = None
        else:
            k = min(draft_len.choose(), max_new_tokens - produced - 1) if drafter is not None else 0
        if k is not None:
            draft_before, verify_before = (drafter.seconds if drafter else 0.0), stats.verify_seconds
            passes_before = drafter.passes if drafter else 0
            new = speculative_round(target, drafter, ids[:n], k, params, rng, stats, draft_len.min_confidence)
            if drafter is not None:
                draft_len.update(stats.last_proposed, stats.last_accepted, drafter.seconds - draft_before,
                                 stats.verify_seconds - verify_before, drafter.caught_up,
                                 drafter.passes - passes_before, drafter.first_seconds)
        stop = next((i for i, token in enumerate(new.tolist()) if token in eos), None)  # a set: no numpy per round
        if stop is not None:
            new = new[: stop + 1]
        new = new[: max_new_tokens - produced]
        if stop is not None and stop >= new.shape[0]:
            stop = None  # the EOS fell past max_new_tokens: the generation ends by its length
        ids[n : n + new.shape[0]] = new
        n += new.shape[0]
        produced += new.shape[0]
        if cache is not None:
            cache.hold(target, ids, n - 1)
        stats.new_tokens = produced
        if drafter is not None:
            stats.draft_passes = drafter.passes - passes0
            stats.draft_seconds = drafter.seconds - seconds0
        stats.seconds = time.perf_counter() - t_start
        if produced == new.shape[0]:
            stats.first_token_seconds = stats.seconds
            stats.first_round_tokens = produced
        if stop is not None:
            stats.finish_reason = "eos"
        yield new
        if stop is not None:
            return
