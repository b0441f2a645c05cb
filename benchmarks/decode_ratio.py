"""Decode-only speedup per prompt, plain and each draft length alternating in one session.

    python benchmarks/decode_ratio.py BUNDLE [BUNDLE ...] [--prompts FILE] [--limit N]
        [--draft-len 3,4,auto] [--max-new-tokens N] [--repeats R] [--thread-pools shared|own|both]

For each prompt (chat template applied), R times: one plain generation, then one per draft
length, each checked token for token against plain; a prompt's ratio is the median of its R
ratios (each speculative run against the plain run beside it). Decode-only tok/s runs from the end of the first
round to the last token (prompt processing excluded). Prints each prompt's ratios and, per
draft length, the median ratio over prompts, the median acceptance and tokens per target pass.
With several bundles, each prompt's runs go through every bundle in turn (the rows of one
bundle compare with another's measured side by side), and each bundle's plain decoding
tok/s is reported beside its ratios.

`--thread-pools`: the sessions run on the process's one ONNX Runtime pool (`shared`, as the
`specdeploy` command runs them), on pools of their own (`own`), or `both`: each bundle loaded
twice, first on pools of its own, then (the shared pool made) on the shared one, the two run
side by side as two bundles.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from specdeploy.runtime import Session
from specdeploy.runtime.backends.ort import share_cpu_threads
from specdeploy.runtime.tools.bench import read_prompts

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--prompts", default=str(HERE / "prompts_varied.txt"))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--draft-len", default="3,auto")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--thread-pools", choices=["shared", "own", "both"], default="shared")
    args = ap.parse_args()
    load = lambda b: Session(b, prompt_cache=False)  # noqa: E731 every run prefills its prompt
    sessions = {f"{b} (own pools)": load(b) for b in args.bundles} if args.thread_pools == "both" else {}
    if args.thread_pools == "own":
        sessions = {b: load(b) for b in args.bundles}
    else:
        share_cpu_threads()
        sessions |= {b: load(b) for b in args.bundles}
    lens = [k if k == "auto" else int(k) for k in args.draft_len.split(",")]
    rows = {(b, k): [] for b in sessions for k in lens}
    plain_rates = {b: [] for b in sessions}
    # per (bundle, k): drafts judged and accepted per draft position, draft seconds and passes,
    # and the plain runs' seconds per target pass beside them (a draft step's cost relative to a step)
    at = {key: ([], []) for key in rows}
    cost = {key: [0.0, 0, 0.0, 0] for key in rows}
    for prompt in read_prompts(Path(args.prompts))[: args.limit]:
        runs = {key: [] for key in rows}
        rates = {b: [] for b in sessions}
        for _ in range(args.repeats):
            for b, session in sessions.items():
                ids = session.encode(prompt, chat=True)
                plain = session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, speculate=False)
                rates[b].append(plain.stats.decode_tokens_per_second)
                for k in lens:
                    spec = session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, draft_len=k)
                    assert spec.token_ids == plain.token_ids, (b, prompt, k)
                    ratio = spec.stats.decode_tokens_per_second / plain.stats.decode_tokens_per_second
                    runs[b, k].append((ratio, spec.stats.acceptance_rate, spec.stats.mean_accepted))
                    proposed, accepted = at[b, k]
                    for i, (p, a) in enumerate(zip(spec.stats.proposed_at, spec.stats.accepted_at)):
                        if i == len(proposed):
                            proposed.append(0)
                            accepted.append(0)
                        proposed[i] += p
                        accepted[i] += a
                    c = cost[b, k]
                    c[0] += spec.stats.draft_seconds
                    c[1] += spec.stats.draft_passes
                    c[2] += plain.stats.verify_seconds
                    c[3] += plain.stats.target_passes
        for key in rows:
            rows[key].append(tuple(statistics.median(r[i] for r in runs[key]) for i in range(3)))
        for b in sessions:
            plain_rates[b].append(statistics.median(rates[b]))
        tag = (lambda b, k: k) if len(sessions) == 1 else (lambda b, k: f"{Path(b).name} {k}")
        print(prompt[:40], {tag(*key): round(v[-1][0], 2) for key, v in rows.items()}, flush=True)
    for (b, k), v in rows.items():
        name = "" if len(sessions) == 1 else f"{b} (plain {statistics.median(plain_rates[b]):.1f} tok/s) "
        print(f"{name}draft {k}: median ratio {statistics.median(r[0] for r in v):.3f} (lowest prompt {min(r[0] for r in v):.2f}), "
              f"acceptance {statistics.median(r[1] for r in v):.3f}, tokens per pass {statistics.median(r[2] for r in v):.2f}")
        proposed, accepted = at[b, k]
        d_seconds, d_passes, p_seconds, p_passes = cost[b, k]
        if d_passes:
            print(f"    acceptance by draft position: {', '.join(f'{a / p:.2f}' for p, a in zip(proposed, accepted) if p)}; "
                  f"a draft pass costs {d_seconds / d_passes * 1e3:.2f} ms, {d_seconds / d_passes / (p_seconds / p_passes):.3f} "
                  f"of a plain step ({p_seconds / p_passes * 1e3:.2f} ms; the first pass of a round catches up on its tokens)")

if __name__ == "__main__":
    main()
