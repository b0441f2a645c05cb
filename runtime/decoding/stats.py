"""What a generation measured: tokens, passes, acceptance, where the time went.

`Round` is what one round did; the loop hands it to the policy that chose the round and to
`Stats.record`, which adds it up.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Round:
    """One round's record (docs/design.md, "The round"): what was proposed and verified, what
    held, and what it cost.

    A chain round (a plain step: nothing proposed) or, with `tree`, a tree round, whose
    `proposed` counts the nodes verified and `accepted` the accepted path's.
    """

    proposed: int  # draft tokens (tree nodes) the verify pass judged; 0: a plain step
    accepted: int  # of them, the ones committed (the accepted path's nodes)
    verify_seconds: float  # the verify pass
    draft_seconds: float = 0.0  # the proposal's (a lookup's) seconds
    draft_passes: int = 0  # draft passes the proposal ran (0: a model-free lookup)
    caught_up: int = 0  # tokens the draft's first pass fed (a model draft catching up)
    first_seconds: float = 0.0  # the draft's first pass alone (0.0: not timed on its own)
    chosen: int | None = None  # the draft length chosen, for the history (None: none was)
    tree: bool = False  # a tree round: its size and path go to the tree histograms
    path: tuple[int, ...] = ()  # the accepted nodes' indices (rounds a TreeSize chose)
    scores: np.ndarray | None = None  # [proposed] the verified nodes' drafter scores (DraftTree.probs)
    forced: int = 0  # of the drafts, the first ones a grammar forced (each the only token it allowed)


FINISH_REASONS = ("eos", "length", "stop", "cancelled")


def finish_reason(*, cancelled: bool, stop: bool, eos: bool) -> str:
    """Why a generation ended, one of FINISH_REASONS: "cancelled" when it was ended before its
    rounds ran out (whatever they had met), else "stop" at a stop string, "eos" at an EOS token
    (the loop commits it and stops), "length" at max_new_tokens.

    >>> finish_reason(cancelled=False, stop=True, eos=True)
    'stop'
    """
    if cancelled:
        return "cancelled"
    if stop:
        return "stop"
    return "eos" if eos else "length"


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
    first_round_tokens: int = 0  # tokens the first round committed (they arrive together)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    seconds: float = 0.0
    finish_reason: str = ""  # one of FINISH_REASONS, once the generation has ended
    draft_len_history: list[int] = field(default_factory=list)  # k chosen each round
    last_proposed: int = 0
    last_accepted: int = 0
    tree_sizes: list[int] = field(default_factory=list)  # nodes verified each tree round (0: a plain step)
    path_lengths: list[int] = field(default_factory=list)  # the accepted path's length each tree round
    forced: int = 0  # drafts a grammar forced (counted in drafted and accepted too)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Tokens committed per target pass (accepted drafts plus the target's own token)."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Whole request: prompt processing included."""
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Decoding only: the tokens after the first round, over the time from its end to the last."""
        span = self.seconds - self.first_token_seconds
        return (self.new_tokens - self.first_round_tokens) / span if span > 0 else 0.0

    def record(self, round: Round) -> None:
        """Add one round: its verify pass, its draft's passes and seconds, what it proposed and
        what held (per draft position for chains; the size and path histograms for trees)."""
        self.target_passes += 1
        self.verify_seconds += round.verify_seconds
        self.draft_passes += round.draft_passes
        self.draft_seconds += round.draft_seconds
        proposed, accepted = round.proposed, round.accepted
        self.last_proposed, self.last_accepted = proposed, accepted
        self.drafted += proposed
        self.accepted += accepted
        self.forced += round.forced
        if round.tree:
            self.tree_sizes.append(proposed)
            self.path_lengths.append(accepted)
            return
        if round.chosen is not None:
            self.draft_len_history.append(round.chosen)
        grow = proposed - len(self.proposed_at)
        if grow > 0:
            self.proposed_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted

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
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 2),
            "time_to_first_token": round(self.first_token_seconds, 4),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "host_seconds": round(max(host, 0.0), 4),
            "finish_reason": self.finish_reason,
            "draft_len_history": self.draft_len_history,
            "draft_len_histogram": _histogram(self.draft_len_history),
            "forced": self.forced,
            "tree_rounds": len(self.tree_sizes),
            "tree_size_histogram": _histogram(self.tree_sizes),
            "accepted_path_histogram": _histogram(self.path_lengths),
        }


def _histogram(values: list[int]) -> dict[str, int]:
    return {str(k): values.count(k) for k in sorted(set(values))}
