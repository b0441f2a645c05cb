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


@dataclass
class Stats:
    prompt_tokens: int = 0
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

    def record_round(self, proposed: int, accepted: int) -> None:
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
        }


def prefill(target: Engine, ids: np.ndarray, chunk: int) -> None:
    """Write K/V of every prompt token but the last (it opens the first round)."""
    for start in range(0, ids.shape[0] - 1, chunk):
        target.forward(ids[start : min(start + chunk, ids.shape[0] - 1)], start)


def greedy_round(target: Engine, drafter, ids: np.ndarray, k: int, stats: Stats) -> np.ndarray:
    """One round of greedy speculative decoding; returns the tokens it commits (1..k+1)."""
    if drafter is not None and k > 0:
        draft_tokens, _ = drafter.propose(ids, k)  # [k'], k' <= k
    else:
        draft_tokens = ids[:0]
    t0 = time.perf_counter()
    target_logits = target.forward(np.concatenate([ids[-1:], draft_tokens]), ids.shape[0] - 1)  # [k'+1, V]
    target_tokens = target_logits.argmax(axis=-1)  # [k'+1]
    stats.verify_seconds += time.perf_counter() - t0
    stats.target_passes += 1
    # Accept the longest prefix the target agrees with, then take the target's own token:
    # the correction at the first disagreement, or the bonus after k' agreements.
    agree = draft_tokens == target_tokens[:-1]
    n_accepted = int(agree.argmin()) if not agree.all() else agree.shape[0]
    stats.record_round(draft_tokens.shape[0], n_accepted)
    return target_tokens[: n_accepted + 1]


def decode(
    target: Engine,
    drafter,
    prompt_ids: np.ndarray,
    max_new_tokens: int,
    draft_len: int,
    eos_token_ids: list[int],
    prefill_chunk: int,
    stats: Stats,
):
    """Yield the committed tokens of each round until EOS or max_new_tokens.

    The caller has checked that prompt + max_new_tokens fits the bundle's max sequence.
    """
    t_start = time.perf_counter()
    ids = np.empty(prompt_ids.shape[0] + max_new_tokens, dtype=np.int64)  # allocated once
    n = prompt_ids.shape[0]
    ids[:n] = prompt_ids
    stats.prompt_tokens = n
    if drafter is not None:
        drafter.reset()
        passes0, seconds0 = drafter.passes, drafter.seconds
    prefill(target, ids[:n], prefill_chunk)
    stats.prefill_seconds = time.perf_counter() - t_start
    eos = np.asarray(eos_token_ids, dtype=np.int64)
    produced = 0
    while produced < max_new_tokens:
        # Never draft past the tokens still wanted: they would be thrown away.
        k = min(draft_len, max_new_tokens - produced - 1)
        new = greedy_round(target, drafter, ids[:n], k, stats)
        stop = np.flatnonzero(np.isin(new, eos))
        if stop.size:
            new = new[: stop[0] + 1]
        new = new[: max_new_tokens - produced]
        ids[n : n + new.shape[0]] = new
        n += new.shape[0]
        produced += new.shape[0]
        stats.new_tokens = produced
        if drafter is not None:
            stats.draft_passes = drafter.passes - passes0
            stats.draft_seconds = drafter.seconds - seconds0
        stats.seconds = time.perf_counter() - t_start
        if produced == new.shape[0]:
            stats.first_token_seconds = stats.seconds
        yield new
        if stop.size:
            return
