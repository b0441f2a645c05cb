"""The speculative loop: prefill, then rounds of draft -> verify -> accept.

Data flow: prompt ids -> prefill (chunks) -> rounds -> committed ids. The target's KV
cache always holds every committed token but the last, which opens the next pass: a
verify pass feeds [last, d1..dk] at positions n-1..n-1+k and its k+1 logit rows judge
d1..dk and give the token after them. Plain decoding is the same round with no draft.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .backends import Engine
from .sampling import SamplingParams, accept_greedy, verify_greedy, verify_sampled, warp


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V a previous generation left (not prefilled)
    new_tokens: int = 0
    target_passes: int = 0  # verify passes (plain decoding: one per token)
    draft_passes: int = 0
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target agreed with
    proposed_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    first_token_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    seconds: float = 0.0
    finish_reason: str = ""  # "eos", "length" or "stop"
    draft_len_history: list[int] = field(default_factory=list)  # k chosen each round
    last_proposed: int = 0
    last_accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per target pass (accepted drafts plus the target's own token)."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def record_round(self, chosen: int | None, proposed: int, accepted: int) -> None:
        if chosen is not None:
            self.draft_len_history.append(chosen)
        self.last_proposed, self.last_accepted = proposed, accepted
        grow = proposed - len(self.proposed_at)
        if grow > 0:
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted
        self.drafted += proposed
        self.accepted += accepted

    def as_dict(self) -> dict:
        host = self.seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "target_passes": self.target_passes,
            "draft_passes": self.draft_passes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted": round(self.mean_accepted, 4),
            "acceptance_by_position": [
                round(a / p, 4) if p else None for a, p in zip(self.accepted_at, self.proposed_at)
            ],
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "time_to_first_token": round(self.first_token_seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "host_seconds": round(max(host, 0.0), 4),
            "finish_reason": self.finish_reason,
            "draft_len_history": self.draft_len_history,
            "draft_len_histogram": {str(k): self.draft_len_history.count(k) for k in sorted(set(self.draft_len_history))},
        }


def prefill(target: Engine, ids: np.ndarray, chunk: int, start: int = 0) -> None:
    """Write K/V of every prompt token but the last (it opens the first round), from
    position `start` on (the cache holds the ones before)."""
    for at in range(start, ids.shape[0] - 1, chunk):
        target.forward(ids[at : min(at + chunk, ids.shape[0] - 1)], at)


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
        if self.runs is None or getattr(target, "runs", None) != self.runs:
            return 0
        m = min(self.length, prompt.shape[0] - 1)
        differ = np.flatnonzero(self.ids[:m] != prompt[:m])
        return int(differ[0]) if differ.size else m

    def hold(self, target: Engine, ids: np.ndarray, length: int) -> None:
        self.ids[:length] = ids[:length]
        self.length = length
        self.runs = getattr(target, "runs", None)


def speculative_round(
    target: Engine, drafter, ids: np.ndarray, k: int, params: SamplingParams, rng: np.random.Generator, stats: Stats
) -> np.ndarray:
    """One round: draft up to k, verify k'+1 in one target pass, accept, correct or bonus.
    Returns the tokens it commits (1..k'+1). With k = 0 it is one plain decoding step."""
    if k > 0 and getattr(drafter, "fused_with", None) and drafter.fused_with(target):
        # Draft and verify on the device, one host synchronisation (torch; TensorRT when greedy).
        draft_tokens, draft_probs, target_out, verify_seconds = drafter.propose_and_verify(target, ids, k, params, rng)
        stats.verify_seconds += verify_seconds
        stats.target_passes += 1
        if params.greedy:
            n_accepted, next_token = accept_greedy(draft_tokens, target_out)
        else:
            n_accepted, next_token = verify_sampled(draft_tokens, draft_probs, warp(target_out, params), rng)
        stats.record_round(k, k, n_accepted)
        return np.append(draft_tokens[:n_accepted], next_token)
    if drafter is not None and k > 0:
        draft_tokens, draft_probs = drafter.propose(ids, k, params, rng)  # [k'], [k', V] or None
    else:
        draft_tokens, draft_probs = ids[:0], None
    t0 = time.perf_counter()
    target_logits = target.forward(np.concatenate([ids[-1:], draft_tokens]), ids.shape[0] - 1)  # [k'+1, V]
    stats.verify_seconds += time.perf_counter() - t0
    stats.target_passes += 1
    # Accept the longest prefix the target agrees with, then take the target's own token:
    # the correction at the first disagreement, or the bonus after k' agreements.
    if params.greedy:
        n_accepted, next_token = verify_greedy(draft_tokens, target_logits)
    else:
        n_accepted, next_token = verify_sampled(draft_tokens, draft_probs, warp(target_logits, params), rng)
    stats.record_round(k if drafter is not None else None, draft_tokens.shape[0], n_accepted)
    return np.append(draft_tokens[:n_accepted], next_token)


def decode(
    target: Engine,
    drafter,
    prompt_ids: np.ndarray,
    max_new_tokens: int,
    draft_len: "DraftLength",
    eos_token_ids: list[int],
    prefill_chunk: int,
    params: SamplingParams,
    stats: Stats,
    cache: PromptCache | None = None,
):
    """Yield the committed tokens of each round until EOS or max_new_tokens.

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
    eos = np.asarray(eos_token_ids, dtype=np.int64)
    produced = 0
    stats.finish_reason = "length"
    while produced < max_new_tokens:
        # Never draft past the tokens still wanted: they would be thrown away.
        k = min(draft_len.choose(drafter), max_new_tokens - produced - 1) if drafter is not None else 0
        draft_before, verify_before = (drafter.seconds if drafter else 0.0), stats.verify_seconds
        new = speculative_round(target, drafter, ids[:n], k, params, rng, stats)
        if drafter is not None:
            draft_len.update(stats.last_proposed, stats.last_accepted, drafter.seconds - draft_before,
                             stats.verify_seconds - verify_before)
        stop = np.flatnonzero(np.isin(new, eos))
        if stop.size:
            new = new[: stop[0] + 1]
        new = new[: max_new_tokens - produced]
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
        if stop.size:
            stats.finish_reason = "eos"
        yield new
        if stop.size:
            return


class DraftLength:
    """Chooses k each round: pinned, or `auto` within the bundle's maximum.

    auto picks the k (0 included: a plain step, when no draft length pays; it then probes
    with k = 1 every few rounds) that maximises expected tokens per unit of time under the analytic
    model (DESIGN.md section 4) with the acceptance rate a and the cost ratio c measured so
    far in this generation: tokens(k) = (1 - a^(k+1)) / (1 - a), time(k) = k*c + v(k), where
    v(k) is the verify pass's cost at T = k+1 relative to T = 1 (it grows a little with T).
    When it measures (greedy), its second round is one plain step: the T = 1 pass that c
    and v(k) are measured against (a verify pass at T = 2 is not one).
    The drafter also stops early when it is unsure of its next token (confidence below
    `min_confidence`). Greedy output never depends on k: it only changes the speed.
    """

    def __init__(
        self, max_k: int, fixed: int | None = None, min_confidence: float = 0.3, decay: float = 0.8,
        cost_ratio: float = 0.1, measure: bool = True,
    ):
        self.max_k = max_k
        # Under sampling the chosen k decides how many random draws a round uses, so a
        # seeded run replays only if k never depends on wall-clock timings: then the cost
        # ratio stays at its static estimate (`measure=False`). Greedy output does not
        # depend on k, so there the measured costs steer it.
        self.measure = measure
        self.fixed = fixed
        self.min_confidence = 0.0 if fixed is not None else min_confidence
        self.decay = decay
        self.accepted = 2.0  # pseudo-counts: start at a = 2/3, optimistic enough to try drafting
        self.rejected = 1.0
        self.cost_ratio = cost_ratio  # draft step / verify pass: a static estimate, then measured
        self.verify_slope = 0.05  # extra verify cost per extra token, relative to T = 1
        self._verify_t1: float | None = None
        self.probe_every = 8
        self._rounds = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self, drafter) -> int:
        drafter.min_confidence = self.min_confidence  # 0 when k is pinned: never stop early
        if self.fixed is not None:
            return self.fixed
        self._rounds += 1
        if self.measure and self._verify_t1 is None and self._rounds == 2:
            return 0  # one plain step: the T = 1 pass every other cost is measured against
        a = min(self.acceptance, 0.999)
        best_k, best = 0, 1.0  # k = 0: a plain step, one verify pass at T = 1 per token
        for k in range(1, self.max_k + 1):
            rate = (1 - a ** (k + 1)) / (1 - a) / (k * self.cost_ratio + 1 + self.verify_slope * k)
            if rate > best:
                best_k, best = k, rate
        if best_k == 0 and self._rounds % self.probe_every == 0:
            return 1  # drafting does not pay so far: probe now and then in case the text changed
        return best_k

    def update(self, proposed: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """After each round: `proposed` draft tokens (0: the pass was a plain step at T = 1),
        `accepted` of them, the draft's and the verify pass's seconds."""
        d = self.decay
        self.accepted = d * self.accepted + accepted
        self.rejected = d * self.rejected + (1 if accepted < proposed else 0)
        if verify_seconds <= 0 or not self.measure:
            return
        if proposed == 0:  # a plain step: the reference cost of a T = 1 pass
            t1 = self._verify_t1
            self._verify_t1 = verify_seconds if t1 is None else d * t1 + (1 - d) * verify_seconds
            return
        t1 = self._verify_t1 or verify_seconds / (1 + self.verify_slope * proposed)
        self.cost_ratio = d * self.cost_ratio + (1 - d) * (draft_seconds / proposed) / t1
        if self._verify_t1:
            slope = max(0.0, (verify_seconds / t1 - 1) / proposed)
            self.verify_slope = d * self.verify_slope + (1 - d) * slope
