"""`specdeploy eval`: the quality contract. Speculation may change the speed, never the output.

Greedy: speculative vs plain decoding on every prompt; exact-match rate; for a mismatch,
the first differing position and the target's logit margin there (top-1 minus top-2 on
the plain path). A margin under `near_tie` is a near-tie flip (kernels of different shapes
rounding differently) and is reported as such; a larger one is a wrong accept.

Sampling: the distribution of the first generated token under speculative sampling
against the target's own distribution from its logits, by a chi-square test.
"""
from __future__ import annotations

import math

import numpy as np

from .loop import prefill
from .sampling import SamplingParams, warp
from .session import Session


def _target_logits_after(session: Session, ids: list[int]) -> np.ndarray:
    """The target's next-token logits after `ids`, computed on the plain path."""
    arr = np.asarray(ids, dtype=np.int64)
    prefill(session.target, arr, session.bundle.prefill_chunk)
    return session.target.forward(arr[-1:], arr.shape[0] - 1)[0].copy()


def greedy_contract(session: Session, prompts: list[str], max_new_tokens: int, draft_len, near_tie: float) -> dict:
    rows = []
    for prompt in prompts:
        ids = session.encode(prompt, chat=True)
        plain = session.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, speculate=False)
        spec = session.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, draft_len=draft_len)
        row = {"prompt": prompt[:60], "tokens": len(plain.token_ids), "match": spec.token_ids == plain.token_ids,
               "acceptance_rate": round(spec.stats.acceptance_rate, 4)}
        if not row["match"]:
            a, b = plain.token_ids, spec.token_ids
            i = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
            logits = _target_logits_after(session, ids + a[:i])
            top2 = np.sort(logits)[-2:]
            margin = float(top2[1] - top2[0])
            row.update(first_difference=i, margin=margin, verdict="near tie" if margin < near_tie else "WRONG ACCEPT")
        rows.append(row)
    matches = sum(r["match"] for r in rows)
    wrong = sum(r.get("verdict") == "WRONG ACCEPT" for r in rows)
    return {"prompts": len(rows), "exact_match_rate": matches / len(rows) if rows else 1.0,
            "near_ties": len(rows) - matches - wrong, "wrong_accepts": wrong, "rows": rows}


def sampling_contract(session: Session, prompt: str, params: SamplingParams, samples: int, alpha: float) -> dict:
    """Chi-square of the first token's distribution; samples generate 2 tokens so that the
    first passes through the rejection sampler whenever the drafter proposes."""
    from specdeploy.core.errors import InputError

    ids = session.encode(prompt, chat=True)
    exact = warp(_target_logits_after(session, ids), params)
    counts: dict[int, int] = {}
    drafted = 0
    for seed in range(samples):
        result = session.generate(prompt_ids=ids, max_new_tokens=2, temperature=params.temperature,
                                  top_k=params.top_k, top_p=params.top_p, seed=seed, draft_len="auto")
        counts[result.token_ids[0]] = counts.get(result.token_ids[0], 0) + 1
        drafted += result.stats.drafted
    impossible = [t for t in counts if exact[t] == 0.0]
    if impossible:
        return {"pvalue": 0.0, "ok": False, "reason": f"sampled token {impossible[0]}, which the target gives probability 0"}
    observed, expected, pool_o, pool_e = [], [], 0.0, 0.0
    for token in np.flatnonzero(exact):
        e = exact[token] * samples
        if e >= 5:
            observed.append(counts.get(int(token), 0))
            expected.append(e)
        else:
            pool_o += counts.get(int(token), 0)
            pool_e += e
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    if len(expected) < 2:
        raise InputError("the sampling check needs a prompt whose first token has at least two likely values")
    chi2 = float(sum((o - e) ** 2 / e for o, e in zip(observed, expected)))
    pvalue = float(_chi2_sf(chi2, len(expected) - 1))
    return {"prompt": prompt[:60], "samples": samples, "cells": len(expected), "chi2": round(chi2, 3),
            "pvalue": pvalue, "alpha": alpha, "drafted": drafted, "ok": pvalue > alpha,
            "settings": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}}


def _chi2_sf(x: float, dof: int) -> float:
    """Survival function of chi-square (regularised upper incomplete gamma), no SciPy needed."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    if z < a + 1:  # series for the lower gamma
        term = total = 1.0 / a
        n = a
        while term > total * 1e-15:
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    # continued fraction for the upper gamma (Lentz)
    b, c, d = z + 1 - a, 1e300, 1.0 / (z + 1 - a)
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return h * math.exp(-z + a * math.log(z) - math.lgamma(a))


def evaluate(session: Session, prompts: list[str], max_new_tokens: int = 64, draft_len="auto",
             near_tie: float = 1e-3, samples: int = 300, alpha: float = 1e-3, strict: bool = False,
             sampling: SamplingParams | None = None) -> dict:
    greedy = greedy_contract(session, prompts, max_new_tokens, draft_len, near_tie)
    params = sampling or SamplingParams(temperature=0.7, top_k=40)
    dist = sampling_contract(session, prompts[0], params, samples, alpha) if samples else None
    broken = greedy["wrong_accepts"] > 0 or (strict and greedy["near_ties"] > 0) or (dist is not None and not dist["ok"])
    return {"greedy": greedy, "sampling": dist, "contract_holds": not broken}
