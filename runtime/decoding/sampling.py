"""Sampling: pure functions on arrays, no model handles (docs/design.md, "The round").

`penalize` applies a request's presence, frequency and repetition penalties to the target's
rows, each row under the tokens before it (the committed ones, then the drafts on its path), so
a verify pass's rows are penalized exactly as single steps would be. `warp` turns logits into
the distribution a token is drawn from (temperature, top-k, top-p, min-p); `sample` draws one
token. The acceptance rule that judges drafted tokens against the target lives in accept.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdeploy.runtime.decoding.request import check_setting


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 switch those filters off; the
    penalties at 0 (presence, frequency) and 1 (repetition) are off. Checked by the request
    schema's rules for these settings (runtime/decoding/request.py)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        for name in ("temperature", "top_k", "top_p", "seed", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            check_setting(name, getattr(self, name), None)  # their rules need no limits

    @classmethod
    def of(cls, req) -> "SamplingParams":
        """A validated request's settings (runtime/decoding/request.py `Request`)."""
        return cls(req.temperature, req.top_k, req.top_p, req.seed, req.min_p, req.presence_penalty,
                   req.frequency_penalty, req.repetition_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a row's logits depend on the tokens before it (any penalty is on)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def penalize(logits: np.ndarray, params: SamplingParams, ids: np.ndarray, prompt_len: int,
             before: list[np.ndarray]) -> np.ndarray:
    """The rows' logits under the request's penalties -> a new float32 array [R, V].

    Row r follows the committed `ids` (the first `prompt_len` of them the prompt), then the
    drafted tokens `before[r]` (a chain's row r: its first r drafts; a tree's: the path to its
    node). As OpenAI and vLLM define them: presence and frequency count the generated tokens
    (each token's logit less frequency x its count, less presence if it occurs at all);
    repetition (as Hugging Face's `repetition_penalty`) every token of prompt and text, a
    positive logit divided by it, a negative one multiplied. Applied before temperature and
    the filters; the same function for a single step and a verify pass's rows, so they agree.

    >>> row = np.array([[2.0, -1.0, 0.5]], dtype=np.float32)
    >>> penalize(row, SamplingParams(presence_penalty=0.5, repetition_penalty=2.0), np.array([0, 1]), 1, [EMPTY]).tolist()
    [[1.0, -2.5, 0.5]]
    """
    vocab = logits.shape[-1]
    counts = np.bincount(ids[prompt_len:], minlength=vocab)[:vocab]
    seen = np.zeros(vocab, dtype=bool)
    seen[ids[ids < vocab]] = True
    out = np.empty(logits.shape, dtype=np.float32)
    for r, extra in enumerate(before):
        c, s = counts, seen
        if extra.shape[0]:
            c, s = counts.copy(), seen.copy()
            np.add.at(c, extra, 1)
            s[extra] = True
        out[r] = _penalized_row(logits[r], params, c, s)
    return out


def _penalized_row(row: np.ndarray, params: SamplingParams, counts: np.ndarray, seen: np.ndarray) -> np.ndarray:
    row = row.astype(np.float32)
    if params.repetition_penalty != 1.0:
        rp = np.float32(params.repetition_penalty)
        row = np.where(seen, np.where(row > 0, row / rp, row * rp), row)
    if params.frequency_penalty != 0.0:
        row = row - np.float32(params.frequency_penalty) * counts.astype(np.float32)
    if params.presence_penalty != 0.0:
        row = row - np.float32(params.presence_penalty) * (counts > 0)
    return row


EMPTY = np.empty(0, dtype=np.int64)


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """logits [..., V] -> probs [..., V] (float64) after temperature, top-k, top-p, then min-p
    (tokens less likely than min_p times the likeliest are dropped).

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
    if params.min_p > 0.0:
        probs = np.where(probs >= params.min_p * probs.max(axis=-1, keepdims=True), probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from probs [V] by inverse CDF (one uniform per draw, so runs replay)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.shape[0] - 1))
