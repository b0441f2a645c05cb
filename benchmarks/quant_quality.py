"""What quantization costs in quality, against the fp32 bundle of the same source.

    python benchmarks/quant_quality.py engines/smollm2-fp32 engines/smollm2-int8 engines/smollm2-int4
        [--prompts FILE] [--max-new-tokens N] [--json OUT]

The first bundle is the reference. For each other bundle:
  - greedy exact match: the share of prompts (chat template applied) whose greedy output of
    up to N new tokens equals the reference's token for token, and the mean length of the
    common prefix;
  - mean KL(reference || quantized) of the next-token distributions, teacher-forced over
    held text: the module docstrings of a few standard-library modules (English prose
    that every Python installation ships), fed in passes of the bundle's prefill chunk.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
from pathlib import Path

import numpy as np

from specdeploy.runtime import Session

try:
    from benchmarks.provenance import provenance
except ModuleNotFoundError:  # run as a file (python benchmarks/NAME.py): benchmarks/ is on sys.path
    from provenance import provenance

HERE = Path(__file__).parent
HELD_MODULES = ("argparse", "json", "logging", "subprocess", "unittest", "http.server", "csv", "textwrap")


def held_text() -> str:
    return "\n\n".join(importlib.import_module(m).__doc__.strip() for m in HELD_MODULES)


def log_probs(session: Session, ids: np.ndarray) -> np.ndarray:
    """Teacher-forced log-probabilities [n, V] of every next token of `ids`."""
    engine, chunk = session.target, session.bundle.prefill_chunk
    rows = []
    for start in range(0, ids.shape[0], chunk):
        logits = engine.forward(ids[start : start + chunk], start).astype(np.float64)
        logits -= logits.max(-1, keepdims=True)
        rows.append(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
    return np.concatenate(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundles", nargs="+", help="the reference bundle first")
    ap.add_argument("--prompts", default=str(HERE / "prompts.txt"))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    prompts = [p for p in Path(args.prompts).read_text().splitlines() if p.strip()]
    sessions = [Session(b, threads=2) for b in args.bundles]
    ref = sessions[0]
    text_ids = np.asarray(ref.encode(held_text()), dtype=np.int64)[: ref.bundle.max_seq]
    ref_lp = log_probs(ref, text_ids)
    ref_out = [ref.generate(p, chat=True, max_new_tokens=args.max_new_tokens, speculate=False).token_ids for p in prompts]
    table = []
    print(f"{len(prompts)} prompts x {args.max_new_tokens} greedy tokens; KL over {text_ids.shape[0]} held tokens")
    print(f"{'bundle':40s} {'dtype':6s} {'exact match':>12s} {'mean common prefix':>19s} {'mean KL (nats)':>15s}")
    for path, session in zip(args.bundles, sessions):
        outs = [session.generate(p, chat=True, max_new_tokens=args.max_new_tokens, speculate=False).token_ids for p in prompts]
        prefixes = []
        for a, b in zip(ref_out, outs):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            prefixes.append(n)
        lp = log_probs(session, text_ids)
        kl = float((np.exp(ref_lp) * (ref_lp - lp)).sum(-1).mean())
        dtype = session.bundle.model("target").dtype
        row = {
            "bundle": path, "dtype": dtype,
            "exact_match": sum(a == b for a, b in zip(ref_out, outs)) / len(prompts),
            "mean_common_prefix": statistics.mean(prefixes), "mean_kl": kl,
            "top1_agreement_teacher_forced": float((lp.argmax(-1) == ref_lp.argmax(-1)).mean()),
        }
        table.append(row)
        print(f"{path:40s} {dtype:6s} {row['exact_match']:12.0%} {row['mean_common_prefix']:19.1f} {kl:15.5f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                                               "held_tokens": int(text_ids.shape[0]), "rows": table,
                                               "provenance": provenance()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
