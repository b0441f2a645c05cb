"""Sampling: pure functions on arrays, no model handles (docs/design.md, "The round").

Roles in names: `target_probs [k+1, V]` from the target's verify pass, `draft_probs [k, V]`
from the draft (None: a point mass on each drafted token, as for n-gram drafts).

Lossless rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accept drafted x
with probability min(1, p(x) / q(x)); at the first rejection sample from
norm(max(0, p - q)); after k acceptances sample the bonus token from p. The output then
has exactly the target's distribution, whatever the draft proposes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdeploy.core.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            raise InputError(f"temperature {self.temperature} is outside [0, 100]")
        if self.top_k < 0:
            raise InputError(f"top-k {self.top_k} must be >= 0 (0: off)")
        if not (0.0 < self.top_p <= 1.0):
            raise InputError(f"top-p {self.top_p} is outside (0, 1]")
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise InputError(f"seed {self.seed} is outside [0, 2**64)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """logits [..., V] -> probs [..., V] (float64) after temperature, top-k, then top-p.

    The same warp is applied to target and draft, as the lossless proof requires.
    >>> warp(np.array([0.0, 0.0, -np.inf]), SamplingParams(temperature=1.0)).tolist()
    [0.5, 0.5, 0.0]
    """
    if params.greedy:
        out = np.zeros(logits.shape, dtype=np.float64)
        np.put_along_axis(out, logits.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return out
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k, axis=-1)[..., -params.top_k, None]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max(axis=-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = before < params.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from probs [V] by inverse CDF (one uniform per draw, so runs replay)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.shape[0] - 1))


def verify_greedy(draft_tokens: np.ndarray, target_logits: np.ndarray) -> tuple[int, int]:
    """-> (accepted count, the target's own next token). target_logits [k+1, V]."""
    return accept_greedy(draft_tokens, target_logits.argmax(axis=-1))


def accept_greedy(draft_tokens: np.ndarray, target_tokens: np.ndarray) -> tuple[int, int]:
    """-> (accepted count, the target's own next token). target_tokens [k+1]: its argmaxes."""
    agree = draft_tokens == target_tokens[:-1]
    n = int(agree.argmin()) if not agree.all() else agree.shape[0]
    return n, int(target_tokens[n])


def verify_sampled(
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
