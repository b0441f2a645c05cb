"""The speculative loop: prefill, then rounds of draft -> verify -> accept.

Data flow: prompt ids -> prefill (chunks) -> rounds -> committed ids. The target's KV
cache always holds every committed token but the last, which opens the next pass: a
verify pass feeds [last, d1..dk] at positions n-1..n-1+k and its k+1 logit rows judge
d1..dk and give the token after them. Plain decoding is the same round with no draft.

A generation runs under one `DecodeSettings`. A round takes the drafter's `Proposal`, judges
it (accept.py) and leaves a `Round` record, which the policy that sized the round learns from
and `Stats` adds up (docs/design.md, "The round").
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from specdeploy.core.errors import BundleError

from specdeploy.runtime.decoding.accept import Judge
from specdeploy.runtime.decoding.drafters import Drafter, Proposal
from specdeploy.runtime.decoding.engine import Checked, Engine
from specdeploy.runtime.decoding.policy import DraftLength, TreeSize
from specdeploy.runtime.decoding.sampling import SamplingParams
from specdeploy.runtime.decoding.stats import Round, Stats
from specdeploy.runtime.decoding.tree import DraftTree


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
        return target.resumable(int(differ[0]) if differ.size else m)

    def hold(self, target: Engine, ids: np.ndarray, length: int) -> None:
        self.ids[:length] = ids[:length]
        self.length = length
        self.runs = target.runs


@dataclass(frozen=True)
class DecodeSettings:
    """What a generation runs under: its limits, how it samples, the policies that size its
    rounds (`draft_len`; with `tree`, tree rounds of depth up to draft_len's maximum, or a
    model-free drafter's chains looked up before their length is chosen) and the prompt cache
    it may reuse and keeps up to date (None: every prompt is prefilled whole)."""

    max_new_tokens: int
    eos_token_ids: frozenset[int]  # a round's first EOS ends the generation (any iterable of ids)
    prefill_chunk: int
    params: SamplingParams
    draft_len: DraftLength
    tree: TreeSize | None = None
    cache: PromptCache | None = None
    logprobs: int | None = None  # each committed token's log probability and this many alternatives

    def __post_init__(self):
        object.__setattr__(self, "eos_token_ids", frozenset(int(t) for t in self.eos_token_ids))


def decode(target: Engine, drafter: Drafter | None, prompt_ids: np.ndarray, settings: DecodeSettings, stats: Stats,
           judge: Judge | None = None):
    """Yield the committed tokens of each round until EOS or max_new_tokens. `judge` (made here
    when not given) judges the rounds; after each, `judge.take` has its tokens' logprobs.

    The caller has checked that prompt + max_new_tokens fits the bundle's max sequence.
    Host synchronisation: each engine pass returns its logits to the host once, so a round
    is one for the verify pass plus one per draft step (the drafter picks each token on the
    host), except a round over engines that chain the draft on the device (a model draft on
    the torch backend, or greedy on TensorRT engines with the argmax output): one per round.
    """
    t_start = time.perf_counter()
    s, cache = settings, settings.cache
    judge = judge or Judge(s.params, np.random.default_rng(s.params.seed), prompt_ids.shape[0], s.logprobs)
    ids = np.empty(prompt_ids.shape[0] + s.max_new_tokens, dtype=np.int64)  # allocated once
    n = prompt_ids.shape[0]
    ids[:n] = prompt_ids
    stats.prompt_tokens = n
    reuse = cache.reusable(target, ids[:n]) if cache is not None else 0
    stats.cached_tokens = reuse
    if drafter is not None and cache is None:
        drafter.reset()  # else it keeps its own K/V: its rollback reuses what agrees with ids
    prefill(target, ids[:n], s.prefill_chunk, start=reuse)
    if cache is not None:
        cache.hold(target, ids, n - 1)
    stats.prefill_seconds = time.perf_counter() - t_start
    end = n  # committed tokens: ids[:end]
    try:
        while end - n < s.max_new_tokens:
            wanted = s.max_new_tokens - (end - n)  # never drafts past it: they would be thrown away
            new = next_round(target, drafter, ids[:end], wanted - 1, s, judge, stats)
            new, eos = commit(ids, end, n, new, s.max_new_tokens, s.eos_token_ids, stats, t_start)
            end += new.shape[0]
            if cache is not None:
                cache.hold(target, ids, end - 1)
            yield new
            if eos:
                return
    finally:
        if drafter is not None and drafter.keeps_history:
            drafter.remember(ids[:end])  # what the request said, for later ones


def commit(ids: np.ndarray, end: int, n: int, new: np.ndarray, max_new_tokens: int, eos_token_ids: frozenset[int],
           stats: Stats, started: float) -> tuple[np.ndarray, bool]:
    """A round's tokens committed after ids[:end] (the first n are the prompt), for Session's rounds
    and a batch's lanes alike: cut to the new tokens left and at the first EOS, written into `ids`,
    counted in `stats` (times from `started`; the first round's is the time to first token).
    -> (the tokens committed, whether an EOS ended them)."""
    new = new[: max_new_tokens - (end - n)]
    eos = next((i for i, token in enumerate(new.tolist()) if token in eos_token_ids), None)  # no numpy
    if eos is not None:
        new = new[: eos + 1]
    ids[end : end + new.shape[0]] = new
    stats.new_tokens = end + new.shape[0] - n
    stats.seconds = time.perf_counter() - started
    if stats.new_tokens == new.shape[0]:
        stats.first_token_seconds = stats.seconds
        stats.first_round_tokens = stats.new_tokens
    return new, eos is not None


def next_round(target: Engine, drafter: Drafter | None, ids: np.ndarray, most: int, s: DecodeSettings,
               judge: Judge, stats: Stats) -> np.ndarray:
    """One round of at most `most` drafts (tree nodes deep), sized by its policy, which then
    learns from the round's record, as `stats` does. Returns the tokens it commits."""
    if s.tree is not None:
        new, round = tree_round(target, drafter, ids, s.tree, min(s.draft_len.max_k, most), judge)
        s.tree.update(round)
    else:
        k = min(s.draft_len.choose(), most) if drafter is not None else 0
        new, round = speculative_round(target, drafter, ids, k, judge, s.draft_len.min_confidence, most)
        if drafter is not None and not round.forced:  # a forced round says nothing of the drafter
            s.draft_len.update(round)
    stats.record(round)
    return new


def speculative_round(
    target: Engine, drafter: Drafter | None, ids: np.ndarray, k: int, judge: Judge, min_confidence: float = 0.0,
    most: int = 0,
) -> tuple[np.ndarray, Round]:
    """One round: draft up to k, verify k'+1 in one target pass, accept, correct or bonus.
    Returns the tokens it commits (1..k'+1) and its record. With k = 0 (or no drafter) it is
    one plain decoding step. Under a grammar, a speculating round proposes the tokens it forces
    and cuts its drafts where the grammar leaves them, never more than `most` (`chain_draft`)."""
    chosen, params, rng = k if drafter is not None else None, judge.params, judge.rng
    forced = judge.forced(most) if drafter is not None else EMPTY
    free = not forced.shape[0]  # a forced round: the grammar drafts (`chain_draft`)
    if free and params.greedy and (drafter is None or k == 0) and not judge.needs_rows:
        token, verify_seconds = plain_step(target, ids)
        return np.array([token], dtype=np.int64), Round(0, 0, verify_seconds, chosen=chosen)
    if free and drafter is not None and k > 0 and drafter.fused_with(target) and not judge.needs_rows:
        proposal, checked = drafter.propose_and_verify(target, ids, k, params, rng)  # on the device, one host sync
    else:
        proposal = chain_draft(drafter, ids, k, most, forced, judge, min_confidence)
        chosen = chosen if free else None
        checked = verify(target, ids, proposal, params)
    n_accepted, next_token = judge.chain(ids, checked)
    record = Round(checked.draft_tokens.shape[0], n_accepted, checked.verify_seconds, proposal.seconds,
                   proposal.passes, proposal.caught_up, proposal.first_seconds, chosen, forced=forced.shape[0])
    return np.append(checked.draft_tokens[:n_accepted], next_token), record


def chain_draft(drafter: Drafter | None, ids: np.ndarray, k: int, most: int, forced: np.ndarray, judge: Judge,
                min_confidence: float = 0.0) -> Proposal:
    """A chain round's drafts (Session's rounds, a batch's lookups and pinned lanes): up to k of
    the drafter's, cut before the first the grammar forbids; or, where the grammar forces
    `forced`, those, then (for a model-free drafter, whose lookup can start after them at no
    cost) up to k of its own from there, never more than `most` in all. A model draft proposes
    nothing in a forced round: its next one catches up."""
    if not forced.shape[0]:
        if drafter is None or k <= 0:
            return Proposal.nothing()
        return judge.cut(drafter.propose(ids, k, judge.params, judge.rng, min_confidence))
    t0 = time.perf_counter()
    tokens, extra = forced, min(k, most - forced.shape[0])
    if drafter.engine is None and extra > 0:
        more = drafter.propose(np.concatenate([ids, forced]), extra, judge.params, judge.rng).tokens
        tokens = np.concatenate([forced, judge.admissible(more, None, after=forced)])
    return Proposal(tokens, seconds=time.perf_counter() - t0)


def verify(target: Engine, ids: np.ndarray, proposal: Proposal, params: SamplingParams) -> Checked:
    """The target's one pass over [last, d1..dk'] at positions n-1..n-1+k': its k'+1 rows
    judge the drafts and give the token after them."""
    n = ids.shape[0]
    t0 = time.perf_counter()
    target_logits = target.forward(np.concatenate([ids[-1:], proposal.tokens]), n - 1)  # [k'+1, V]
    verify_seconds = time.perf_counter() - t0
    tokens = target_logits.argmax(axis=-1) if params.greedy else None
    check_finite(target, target_logits, n - 1, tokens)
    return Checked(proposal.tokens, proposal.probs, target_logits, tokens, verify_seconds=verify_seconds)


def plain_step(target: Engine, ids: np.ndarray) -> tuple[int, float]:
    """A greedy round with nothing drafted: one target pass at T = 1 and its argmax, with as
    little host work as the round allows (on the CPU a step's Python runs on caches the pass
    has just emptied, so each array operation it skips is worth a few microseconds).
    -> (the token, the pass's seconds)."""
    n = ids.shape[0]
    t0 = time.perf_counter()
    logits = target.forward(ids[n - 1 :], n - 1)
    seconds = time.perf_counter() - t0
    row = logits[0]
    token = int(row.argmax())
    if not math.isfinite(row[token]):  # argmax stops at a NaN: the row's maximum is what it found
        check_finite(target, logits, n - 1, np.array([token]))
    return token, seconds


def tree_round(
    target: Engine, drafter, ids: np.ndarray, sizes: TreeSize, max_depth: int, judge: Judge,
) -> tuple[np.ndarray, Round]:
    """One tree round: the drafter's candidate tree, cut to the size the policy chooses, judged
    by the target in one pass; the accepted path's K/V move to the slots a chain would have
    written them to. Returns the tokens it commits (the path and the target's own token) and
    its record.

    With `sizes.chains` the candidate is the drafter's chain (a model-free lookup, looked up
    before the policy decides how much of it to verify: the lookup is free, and what it found
    is the best guide to how far it holds), verified as a chain round."""
    n, params = ids.shape[0], judge.params
    candidates, lookup, forced = look_up(drafter, ids, sizes, max_depth, target.max_seq, judge)
    tree = candidates.prune(sizes.choose(candidates.probs, candidates.size))
    t0 = time.perf_counter()
    if tree.size and not tree.is_chain():
        logits = target.forward(np.concatenate([ids[-1:], tree.tokens]), n - 1, tree=tree.layout())
    else:  # a chain (or nothing): the ordinary pass, whatever the target
        logits = target.forward(np.concatenate([ids[-1:], tree.tokens]), n - 1)
    verify_seconds = time.perf_counter() - t0
    tokens = logits.argmax(axis=-1) if params.greedy else None
    check_finite(target, logits, n - 1, tokens)
    path, token = judge.tree(ids, tree, logits, tokens)
    if path != list(range(len(path))):  # off the main chain: move the path's K/V into place
        target.move_kv(n + np.asarray(path, dtype=np.int64), n)
    record = Round(tree.size, len(path), verify_seconds, lookup, chosen=tree.size if sizes.chains else None,
                   tree=not sizes.chains, path=tuple(path), scores=tree.probs, forced=min(forced, tree.size))
    return np.append(tree.tokens[path], token), record


EMPTY = np.empty(0, dtype=np.int64)
EMPTY_TREE = DraftTree(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), np.empty(0))


def look_up(drafter, ids: np.ndarray, sizes: TreeSize, max_depth: int, max_seq: int,
            judge: Judge) -> tuple[DraftTree, float, int]:
    """A tree round's candidates (Session's rounds and a batch's lanes): the drafter's tree of at
    most `sizes.max_nodes` nodes up to `max_depth` deep, node i written at slot n + i of a buffer
    of `max_seq` (n: the committed ids), or with `sizes.chains` its chain: under a grammar, the
    tokens it forces and then the lookup's, cut where the grammar leaves them. -> (the
    candidates, the lookup's seconds, how many of the first candidates the grammar forced)."""
    room = min(sizes.max_nodes, max_seq - ids.shape[0])
    if max_depth <= 0 or room <= 0:
        return EMPTY_TREE, 0.0, 0
    if sizes.chains:
        most = min(room, max_depth)
        forced = judge.forced(most)
        proposal = chain_draft(drafter, ids, most, most, forced, judge)
        return DraftTree.chain(proposal.tokens), proposal.seconds, forced.shape[0]
    t0 = time.perf_counter()
    tree = drafter.propose_tree(ids, room, max_depth)
    return tree, time.perf_counter() - t0, 0


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
