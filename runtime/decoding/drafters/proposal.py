"""What a drafter hands the round: its tokens, their probabilities and what drafting them cost."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Proposal:
    """tokens [k'] int64 (k' = 0: nothing to propose); probs [k', V] the draft's warped
    distribution at each (sampled model drafts), None: a point mass on each token (model-free
    drafts, and greedy), so one verifier serves every drafter.

    What the draft-length policy prices a draft step by: `seconds` the drafting took, `passes`
    draft passes it ran (0: a model-free lookup; one more than k' where a model draft stopped
    early on an unsure token), `caught_up` tokens its first pass fed (the tokens the last round
    committed, or a prompt's) and `first_seconds` that first pass alone (0.0: the passes were
    timed as a whole, as a chain on the device is).

    >>> Proposal.nothing().tokens.shape
    (0,)
    """

    tokens: np.ndarray
    probs: np.ndarray | None = None
    seconds: float = 0.0
    passes: int = 0
    caught_up: int = 0
    first_seconds: float = 0.0

    @classmethod
    def nothing(cls) -> "Proposal":
        return cls(np.empty(0, dtype=np.int64))
