"""Decode-only speedup per prompt, plain and each draft length alternating in one session.

    python benchmarks/decode_ratio.py BUNDLE [--prompts FILE] [--limit N] [--draft-len 3,4,auto]
        [--max-new-tokens N] [--repeats R]

For each prompt (chat template applied), R times: one plain generation, then one per draft
length, each checked token for token against plain; a prompt's ratio is the median of its R
ratios (each speculative run against the plain run beside it). Decode-only tok/s runs from the end of the first
round to the last token (prompt processing excluded). Prints each prompt's ratios and, per
draft length, the median ratio over prompts, the median acceptance and tokens per target pass.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from specdeploy.runtime import Session
from specdeploy.runtime.bench import read_prompts

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--prompts", default=str(HERE / "prompts_varied.txt"))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--draft-len", default="3,auto")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    session = Session(args.bundle, prompt_cache=False)  # every run prefills its prompt
    lens = [k if k == "auto" else int(k) for k in args.draft_len.split(",")]
    rows = {k: [] for k in lens}
    for prompt in read_prompts(Path(args.prompts))[: args.limit]:
        ids = session.encode(prompt, chat=True)
        runs = {k: [] for k in lens}
        for _ in range(args.repeats):
            plain = session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, speculate=False)
            for k in lens:
                spec = session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, draft_len=k)
                assert spec.token_ids == plain.token_ids, (prompt, k)
                ratio = spec.stats.decode_tokens_per_second / plain.stats.decode_tokens_per_second
                runs[k].append((ratio, spec.stats.acceptance_rate, spec.stats.mean_accepted))
        for k in lens:
            rows[k].append(tuple(statistics.median(r[i] for r in runs[k]) for i in range(3)))
        print(prompt[:40], {k: round(v[-1][0], 2) for k, v in rows.items()}, flush=True)
    for k, v in rows.items():
        print(f"draft {k}: median ratio {statistics.median(r[0] for r in v):.3f} (lowest prompt {min(r[0] for r in v):.2f}), "
              f"acceptance {statistics.median(r[1] for r in v):.3f}, tokens per pass {statistics.median(r[2] for r in v):.2f}")


if __name__ == "__main__":
    main()
