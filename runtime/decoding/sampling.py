"""Sampling: pure functions on arrays, no model handles (docs/design.md, "The round").

`warp` turns logits into the distribution a token is drawn from, the same warp for target and
draft (the lossless proof requires it); `sample` draws one token. The acceptance rule that
judges drafted tokens against the target lives in accept.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdeploy.runtime.decoding.request import check_setting


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off. Checked by the
    request schema's rules for these settings (runtime/decoding/request.py)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_k", "top_p", "seed"):
            check_setting(name, getattr(self, name), None)  # their rules need no limits

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
