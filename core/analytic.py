"""The analytic model of speculative decoding (Leviathan et al. 2023; docs/design.md, "The cost model").

With per-token acceptance a, draft length g and cost ratio c (a draft step over a target
pass), a round commits (1 - a^(g+1)) / (1 - a) tokens per target pass and costs g*c + 1
target passes: the speedup over plain decoding is the ratio. The runtime's draft-length
policy and the benchmarks' predictions both use these functions.
"""
from __future__ import annotations

from typing import Sequence


def tokens_per_pass(acceptance: float, draft_len: float) -> float:
    """Expected tokens per target pass with per-token acceptance a and draft length g:
    (1 - a^(g+1)) / (1 - a), and g + 1 when a = 1.

    >>> tokens_per_pass(0.5, 2)
    1.75
    """
    a, g = acceptance, draft_len
    if a >= 1.0:
        return g + 1.0
    return (1.0 - a ** (g + 1)) / (1.0 - a)


def predicted_speedup(acceptance: float, draft_len: float, cost_ratio: float, verify_growth: float = 0.0,
                      draft_overhead: float = 0.0) -> float:
    """Leviathan et al.'s speedup: tokens per pass / (g*c + 1), c = draft step / target pass.
    `verify_growth`: the verify pass's extra cost per extra token, relative to T = 1 (0 in
    the paper's model; measurable on a CPU, where a T = 5 pass costs more than T = 1).
    `draft_overhead`: what a round's drafting costs beyond g steps, relative to a target pass
    (a model draft's first pass catches up on the tokens the last round committed: T = 2).

    >>> round(predicted_speedup(0.5, 2, 0.1), 6)
    1.458333
    """
    return tokens_per_pass(acceptance, draft_len) / (
        draft_len * cost_ratio + draft_overhead + 1.0 + verify_growth * draft_len)


def acceptance_estimate(rounds: Sequence[tuple[int, int]]) -> float:
    """Per-token acceptance a from (proposed, accepted) per round: accepted tokens over
    acceptance trials, where each round that stopped at a rejection adds one failed trial
    (the geometric model's maximum-likelihood estimate; a round that accepted all it
    proposed was cut by the draft length, not by a rejection).

    >>> acceptance_estimate([(4, 2), (4, 4), (2, 0)])
    0.75
    """
    accepted = sum(a for p, a in rounds if p)
    rejected = sum(1 for p, a in rounds if p and a < p)
    return accepted / (accepted + rejected) if accepted + rejected else 0.0
