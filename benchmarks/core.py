"""Side-by-side measurements on one machine, in one process, runs alternating.

    python benchmarks/core.py engines/A [engines/B ...] [--hf SOURCE] [--prompts FILE] [--limit N]
        [--max-new-tokens N] [--repeats R] [--draft-len K[,K...|auto]] [--temperature T] [--json OUT]

For every bundle and prompt (chat template applied), plain and speculative decoding
alternate R times on the same engine; tokens/s is the median over runs of each prompt,
then the median over prompts. With --hf, Hugging Face `generate(do_sample=False)` of the
source model runs in the same alternation as the plain baseline, and its tokens are
compared with ours. Every speculative output is compared with plain decoding.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specdeploy.runtime import Session

try:
    from benchmarks.provenance import provenance
except ModuleNotFoundError:  # run as a file (python benchmarks/NAME.py): benchmarks/ is on sys.path
    from provenance import provenance

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--hf", help="source model (HF folder, .gguf, or 'smollm2') to time with transformers generate")
    ap.add_argument("--prompts", default=str(HERE / "prompts.txt"))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-len", default="auto", help="one or several, comma separated: 1,2,4,8,auto")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled with seeds 0..R-1")
    ap.add_argument("--limit", type=int, help="use the first N prompts")
    ap.add_argument("--json")
    args = ap.parse_args()
    prompts = [p for p in Path(args.prompts).read_text().splitlines() if p.strip()][: args.limit]
    draft_lens = [k if k == "auto" else int(k) for k in args.draft_len.split(",")]

    hf = None
    if args.hf:
        import torch
        from specdeploy.export import embedded_default, load_source

        torch.set_num_threads(2)
        hf = load_source(embedded_default() if args.hf == "smollm2" else args.hf).model

    report = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "temperature": args.temperature, "bundles": {}}
    for path in args.bundles:
        session = Session(path, prompt_cache=False)  # runs of one prompt alternate: each prefills it
        for draft_len in draft_lens:
            _run(session, path, prompts, draft_len, args, hf, report)
    if args.json:
        Path(args.json).write_text(json.dumps({**report, "provenance": provenance()}, indent=2))


def _run(session, path, prompts, draft_len, args, hf, report):
    rows = []
    for prompt in prompts:
        ids = session.encode(prompt, chat=True)
        kw = dict(prompt_ids=ids, max_new_tokens=args.max_new_tokens)
        plain_tps, spec_tps, hf_tps = [], [], []
        for r in range(args.repeats):
            sampled = dict(temperature=args.temperature, seed=r)
            plain = session.generate(**kw, **sampled, speculate=False)
            spec = session.generate(**kw, **sampled, draft_len=draft_len)
            plain_tps.append(plain.stats.tokens_per_second)
            spec_tps.append(spec.stats.tokens_per_second)
            if hf is not None:
                hf_ids, seconds = _hf_generate(hf, ids, args.max_new_tokens, session.eos_token_ids)
                hf_tps.append(len(hf_ids) / seconds)
        row = {
            "prompt": prompt[:40],
            "new_tokens": len(plain.token_ids),
            "plain_tps": statistics.median(plain_tps),
            "spec_tps": statistics.median(spec_tps),
            "speedup": statistics.median(s / p for s, p in zip(spec_tps, plain_tps)),
            "identical": spec.token_ids == plain.token_ids,
            "mean_draft_len": sum(spec.stats.draft_len_history) / max(1, len(spec.stats.draft_len_history)),
            "acceptance_rate": spec.stats.acceptance_rate,
            "drafted": spec.stats.drafted,
            "accepted": spec.stats.accepted,
            "mean_accepted": spec.stats.mean_accepted,
        }
        if hf is not None:
            row["hf_tps"] = statistics.median(hf_tps)
            row["plain_vs_hf"] = statistics.median(p / h for p, h in zip(plain_tps, hf_tps))
            row["identical_to_hf"] = hf_ids == plain.token_ids
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    drafted = sum(r["drafted"] for r in rows)
    summary = {
        "draft": session.bundle.draft.as_dict(),
        "draft_len": draft_len,
        "temperature": args.temperature,
        "mean_draft_len": statistics.mean(r["mean_draft_len"] for r in rows),
        "plain_tps_median": statistics.median(r["plain_tps"] for r in rows),
        "spec_tps_median": statistics.median(r["spec_tps"] for r in rows),
        "speedup_median": statistics.median(r["speedup"] for r in rows),
        # under sampling the two runs need not match (each replays itself under its seed)
        "identical": f"{sum(r['identical'] for r in rows)}/{len(rows)}" if args.temperature == 0 else "n/a",
        "acceptance_rate": sum(r["accepted"] for r in rows) / drafted if drafted else 0.0,
        "mean_accepted": statistics.mean(r["mean_accepted"] for r in rows),
    }
    if hf is not None:
        summary["hf_tps_median"] = statistics.median(r["hf_tps"] for r in rows)
        summary["plain_vs_hf_median"] = statistics.median(r["plain_vs_hf"] for r in rows)
        summary["identical_to_hf"] = f"{sum(r['identical_to_hf'] for r in rows)}/{len(rows)}"
    report["bundles"][f"{path} k={draft_len}"] = {"summary": summary, "rows": rows}
    print(f"{path}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in summary.items()), flush=True)


def _hf_generate(model, ids, max_new_tokens, eos_ids):
    import torch

    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_ids, pad_token_id=eos_ids[0]
        )
        seconds = time.perf_counter() - t0
    return out[0, len(ids) :].tolist(), seconds


def _fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main()
