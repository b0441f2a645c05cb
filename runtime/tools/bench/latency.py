"""Latency arithmetic on timings: percentiles and per-token gaps from streamed rounds.

Pure functions on numbers, no session: tested against values worked by hand.
"""
from __future__ import annotations

from typing import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, linear between closest ranks (numpy's default method).

    >>> percentile([1, 2, 3, 4], 50), percentile([1, 2, 3, 4], 90)
    (2.5, 3.7)
    """
    if not values:
        return float("nan")
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    lo = int(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def inter_token_gaps(start: float, arrivals: Sequence[tuple[float, int]]) -> tuple[float, list[float]]:
    """(time to first token, per-token gaps) from the arrival time and token count of each
    streamed round. A round carries several tokens at once: its gap since the previous
    round is shared among them, one sample per token (the first round's tokens give the
    time to first token instead).

    >>> inter_token_gaps(0.0, [(0.5, 2), (0.75, 1), (1.5, 3)])
    (0.5, [0.25, 0.25, 0.25, 0.25])
    """
    arrivals = [(t, n) for t, n in arrivals if n]
    if not arrivals:
        return float("nan"), []
    gaps = []
    for (t_prev, _), (t, n) in zip(arrivals, arrivals[1:]):
        gaps += [(t - t_prev) / n] * n
    return arrivals[0][0] - start, gaps
