"""`specdeploy eval`: the quality contract. Speculation may change the speed, never the output.

Greedy: speculative vs plain decoding on every prompt; exact-match rate; for a mismatch,
the first differing position and the target's logit margin there (top-1 minus top-2 on
the plain path). A margin under `near_tie` is a near-tie flip (kernels of different shapes
rounding differently) and is reported as such; a larger one is a wrong accept. It counts
the draft tokens the speculative runs proposed and accepted.

Sampling: a chi-square test of the first generated token's distribution under speculative
sampling against the target's own distribution from its logits, at a position where the
drafter proposes, so that every sample passes through the sampled verifier. Positions are
the end of each prompt and every point of its greedy continuation; at each, the drafter is
asked for one token (draft length pinned to 1) and the probability that the verifier
accepts it, sum(min(p, q)), is computed from the target's p and the draft's q (a point mass
for a model-free draft). The test runs at the position where that probability is closest to
1/2, so that both verdicts, accept and reject-then-resample, are common. The bound: a correct
sampler fails with probability at most `alpha` (Pearson's chi-square, cells expected under 5
pooled); a sampler that resamples wrongly after a rejection fails it (tests/test_eval.py).

Verdict: "broken" (a wrong accept, a near tie under `strict`, or the distribution test failed),
"not tested" (no draft token was proposed in the greedy runs, or the drafter proposed at no
position the sampling test could use), else "holds".
"""
from __future__ import annotations

import math

import numpy as np

from specdeploy.runtime.decoding.loop import prefill
from specdeploy.runtime.decoding.sampling import SamplingParams, warp
from specdeploy.runtime.decoding.session import Session

VERDICT_TOLERANCE = 1e-6  # |p - q| under which a rejection then x counts as possible


def _target_logits_after(session: Session, ids: list[int]) -> np.ndarray:
    """The target's next-token logits after `ids`, computed on the plain path."""
    arr = np.asarray(ids, dtype=np.int64)
    prefill(session.target, arr, session.bundle.prefill_chunk)
    return session.target.forward(arr[-1:], arr.shape[0] - 1)[0].copy()


def greedy_contract(session: Session, prompts: list[str], max_new_tokens: int, draft_len, near_tie: float,
                    chat: bool = True, runs: list | None = None) -> dict:
    """`runs`, when given, collects (prompt, prompt ids, plain output ids) for the sampling test."""
    rows = []
    for prompt in prompts:
        ids = session.encode(prompt, chat=chat)
        plain = session.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, speculate=False)
        spec = session.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, draft_len=draft_len)
        if runs is not None:
            runs.append((prompt, ids, plain.token_ids))
        row = {"prompt": prompt[:60], "tokens": len(plain.token_ids), "match": spec.token_ids == plain.token_ids,
               "acceptance_rate": round(spec.stats.acceptance_rate, 4), "drafted": spec.stats.drafted,
               "accepted": spec.stats.accepted}
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
    drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
    return {"prompts": len(rows), "exact_match_rate": matches / len(rows) if rows else 1.0,
            "near_ties": len(rows) - matches - wrong, "wrong_accepts": wrong, "drafted": drafted,
            "accepted": accepted, "rejected": drafted - accepted, "rows": rows}


def draft_positions(session: Session, runs: list, params: SamplingParams) -> tuple[int, list[dict]]:
    """Every position of `runs` (each prompt's end and each point of its greedy continuation)
    at which the drafter proposes a token with the draft length pinned to 1, with the
    probability that the sampled verifier accepts it, sum(min(p, q)).
    -> (positions looked at, [{run, length (of the context), position (after the prompt), token,
    accept, spread (1 - the target's top probability)}])."""
    drafter, target, b = session.drafter, session.target, session.bundle
    if drafter is None or b.max_draft < 1:
        return 0, []
    rng = np.random.default_rng(0)  # a model draft samples its token; only its q is used here
    scanned, found = 0, []
    for r, (_, ids, plain) in enumerate(runs):
        full = np.asarray(list(ids) + list(plain), dtype=np.int64)
        n = len(ids)
        last = min(full.shape[0] - 1, b.max_seq - 2)  # a sample generates 2 tokens after the context
        if last < n:
            continue
        # the target's next-token logits after full[:j] for j = n..last, in prefill-sized passes
        prefill(target, full[:n], b.prefill_chunk)
        rows = [target.forward(full[at : min(at + b.prefill_chunk, last)], at).copy()
                for at in range(n - 1, last, b.prefill_chunk)]
        logits = np.concatenate(rows) if rows else np.empty((0, target.vocab_size), dtype=np.float32)
        for j in range(n, last + 1):
            scanned += 1
            proposal = drafter.propose(full[:j], 1, params, rng)
            tokens, probs = proposal.tokens, proposal.probs
            if tokens.shape[0] == 0:
                continue
            p = warp(logits[j - n], params)
            if probs is None:
                accept = float(p[int(tokens[0])])
            else:
                accept = float(np.minimum(p, probs[0]).sum())
            found.append({"run": r, "length": j, "position": j - n, "token": int(tokens[0]),
                          "accept": accept, "spread": 1.0 - float(p.max())})
    return scanned, found


def sampling_contract(session: Session, runs: list, params: SamplingParams, samples: int, alpha: float) -> dict:
    """Two chi-square tests at the draft position chosen from `runs`, each at alpha / 2 (so a
    correct sampler fails with probability at most alpha). Each sample generates 2 tokens with
    the draft length pinned to 1, so its first token is the sampled verifier's verdict on one
    drafted token: accepted, or resampled after a rejection.

    - output: the first token's distribution against the target's own p (the contract);
    - verdicts: the (accepted?, first token) pairs against the rejection sampler's law: the
      draft token x accepted with probability min(p, q)(x), a rejection then x with
      max(0, p - q)(x) (q: the draft's distribution, a point mass for a model-free draft).
      Summed over the verdict this is p; it sees a wrong resampling after a rejection even
      where the output's distribution moves little.
    """
    scanned, found = draft_positions(session, runs, params)
    report = {"samples": samples, "alpha": alpha, "scanned": scanned, "proposing": len(found),
              "drafted": 0, "accepted": 0, "rejected": 0, "tested": False, "ok": False,
              "settings": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                           "draft_len": 1}}
    if not found:
        if session.drafter is None:
            why = "the bundle has no draft (kind none): no draft token to verify"
        elif session.bundle.max_draft < 1:
            why = "the bundle's max draft is 0: no draft token to verify"
        else:
            why = (f"the drafter proposed no token at any of the {scanned} positions looked at (each prompt's end "
                   f"and its greedy continuation): give more or longer prompts, or more --max-new-tokens")
        return {**report, "reason": why}
    best = max(found, key=lambda c: (min(c["accept"], 1.0 - c["accept"]), c["spread"]))
    prompt, prompt_ids, plain = runs[best["run"]]
    ids = np.asarray(list(prompt_ids) + list(plain), dtype=np.int64)[: best["length"]]
    report.update(prompt=prompt[:60], position=best["position"], context_tokens=len(ids),
                  draft_token=best["token"], accept_probability=round(best["accept"], 4))
    p = warp(_target_logits_after(session, ids.tolist()), params)
    proposal = session.drafter.propose(ids, 1, params, np.random.default_rng(0))
    tokens, probs = proposal.tokens, proposal.probs
    if probs is None:
        q = np.zeros_like(p)
        q[int(tokens[0])] = 1.0
    else:
        q = probs[0]
    outputs: dict[int, int] = {}
    verdicts: dict[tuple[int, int], int] = {}
    drafted = accepted = 0
    for seed in range(samples):
        result = session.generate(prompt_ids=ids, max_new_tokens=2, temperature=params.temperature,
                                  top_k=params.top_k, top_p=params.top_p, seed=seed, draft_len=1)
        first = result.token_ids[0]
        outputs[first] = outputs.get(first, 0) + 1
        key = (int(result.stats.accepted > 0), first)
        verdicts[key] = verdicts.get(key, 0) + 1
        drafted += result.stats.drafted
        accepted += result.stats.accepted
    report.update(drafted=drafted, accepted=accepted, rejected=drafted - accepted, tested=drafted == samples)
    if drafted != samples:
        return {**report, "reason": f"the drafter proposed a token at this position when asked, but in {drafted} "
                                    f"of {samples} samples only"}
    impossible = [t for t in outputs if p[t] == 0.0]
    if impossible:
        return {**report, "pvalue": 0.0, "reason": f"sampled token {impossible[0]}, which the target gives probability 0"}
    accept_law, reject_law = np.minimum(p, q), p - q
    law = {(1, int(x)): float(accept_law[x]) for x in np.flatnonzero(accept_law > 0)}
    # a rejection then x has probability max(0, p - q)(x); where p and q agree to rounding
    # (a draft recomputed here vs in the loop) the outcome is allowed, with ~0 expected
    law.update({(0, int(x)): max(float(reject_law[x]), 0.0) for x in np.flatnonzero(reject_law > -VERDICT_TOLERANCE)})
    bad = next((key for key in verdicts if key not in law), None)
    if bad is not None:
        if bad[0]:
            what = f"token {bad[1]} was accepted, but the draft gives it probability 0"
        elif probs is None and bad[1] == int(tokens[0]):
            what = f"the drafted token {bad[1]} came back after its rejection"
        else:
            what = f"token {bad[1]} came after a rejection, where the target's p does not exceed the draft's q"
        return {**report, "pvalue": 0.0, "reason": f"{what} (the rejection sampler gives that probability 0)"}
    out = _chi_square({int(x): float(p[x]) for x in np.flatnonzero(p)}, outputs, samples)
    ver = _chi_square(law, verdicts, samples, group=lambda key: key[0])
    if out is None or ver is None:
        return {**report, "tested": False,
                "reason": "the target's distribution at the chosen position is one token: nothing to compare"}
    ok = out[2] > alpha / 2 and ver[2] > alpha / 2
    return {**report, "cells": out[0], "chi2": round(out[1], 3), "pvalue": min(1.0, 2 * min(out[2], ver[2])),
            "output_pvalue": out[2], "verdict_cells": ver[0], "verdict_chi2": round(ver[1], 3),
            "verdict_pvalue": ver[2], "ok": ok}


def _chi_square(law: dict, counts: dict, n: int, group=lambda key: None) -> tuple[int, float, float] | None:
    """Pearson's chi-square of `counts` (n draws, every outcome a key of `law`) against the
    probabilities `law`; cells expected under 5 are pooled, one pool per `group(key)` (the
    verdict test pools accepted and rejected tokens apart, so the acceptance count is seen).
    -> (cells, chi2, p-value), None with fewer than two cells."""
    observed, expected, pools = [], [], {}
    for key, prob in law.items():
        e = prob * n
        if e >= 5:
            observed.append(counts.get(key, 0))
            expected.append(e)
        else:
            pool = pools.setdefault(group(key), [0.0, 0.0])
            pool[0] += counts.get(key, 0)
            pool[1] += e
    for pool_o, pool_e in pools.values():
        if pool_o > 0 and pool_e <= 0:
            return max(len(expected), 2), math.inf, 0.0  # outcomes of probability ~0 only in the pool
        if pool_e > 0:
            observed.append(pool_o)
            expected.append(pool_e)
    if len(expected) < 2:
        return None
    chi2 = float(sum((o - e) ** 2 / e for o, e in zip(observed, expected)))
    return len(expected), chi2, float(_chi2_sf(chi2, len(expected) - 1))


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
             sampling: SamplingParams | None = None, chat: bool | None = None) -> dict:
    """chat: None sends the prompts through the chat template when the bundle has one."""
    from specdeploy.core.errors import InputError

    has_template = bool(session.tokenizer.chat_template)
    chat = has_template if chat is None else chat
    if chat and not has_template:
        raise InputError("this bundle's tokenizer has no chat template: send the prompts as plain text (--no-chat)")
    runs: list = []
    greedy = greedy_contract(session, prompts, max_new_tokens, draft_len, near_tie, chat, runs)
    params = sampling or SamplingParams(temperature=0.7, top_k=40)
    dist = sampling_contract(session, runs, params, samples, alpha) if samples else None
    broken = (greedy["wrong_accepts"] > 0 or (strict and greedy["near_ties"] > 0)
              or (dist is not None and "pvalue" in dist and not dist["ok"]))
    untested = []
    if not greedy["drafted"]:
        untested.append("the greedy check's speculative runs proposed no draft token")
    if dist is not None and not dist["tested"]:
        untested.append(f"sampling: {dist['reason']}")
    verdict = "broken" if broken else "not tested" if untested else "holds"
    return {"chat": chat, "greedy": greedy, "sampling": dist, "verdict": verdict, "not_tested": untested,
            "contract_holds": verdict == "holds"}
