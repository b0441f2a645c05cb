"""How many tokens per target pass model-free drafting can reach at best, on given prompts.

    python benchmarks/lookup_bound.py BUNDLE [--prompts FILE] [--limit N] [--max-new-tokens N]
        [--depth D] [--json OUT]

Model-free drafters (the n-gram chain, the suffix index's trees) propose what followed
earlier occurrences of the text's last few tokens, in the request's own prompt and output or
in earlier requests. This bounds every such drafter from above: for each prompt it decodes
the target's plain greedy output, then replays it in rounds where an oracle verifies, in one
pass, *every* continuation (up to D tokens) that followed an occurrence of the last c
committed tokens, a tree of unlimited size, and keeps the longest the target agrees with.
A round commits that many tokens plus the target's own; tokens per pass is the output's
length over the rounds. No drafter with the same candidates does better, whatever its
scores, budget or tree size policy (where a continuation holds from one position, its tail
holds from the next, so a round that commits more never leaves a worse start: tests).

    c = 2   the suffix index's shortest context (it matches 8 tokens down to 2)
    c = 1   the last token alone
    c = 0   no context: any place in the text (the tree would hold every substring)

each over the request's own text (`own`) and with the earlier prompts' requests and outputs
before it (`shared`, as a service's shared index holds them). Also the median number of
occurrences a round's tree would merge (how wide an unlimited tree is). Greedy, chat template
applied; prints medians over prompts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

try:
    from benchmarks.provenance import provenance
except ModuleNotFoundError:  # run as a file (python benchmarks/NAME.py): benchmarks/ is on sys.path
    from provenance import provenance

HERE = Path(__file__).parent
CONTEXTS = (2, 1, 0)
SEPARATOR = -1  # between texts of the shared corpus: no continuation runs from one into the next


def best_continuation(corpus: np.ndarray, context: int, truth: np.ndarray, depth: int) -> tuple[int, int]:
    """The longest prefix of `truth` (at most `depth` tokens) that followed an occurrence of the
    corpus's last `context` tokens earlier in it (context 0: that starts anywhere in it).
    -> (its length, how many occurrences there were).

    >>> c = np.array([5, 6, 7, 8, 5, 6, 9, 1, 5, 6])
    >>> best_continuation(c, 2, np.array([9, 1, 2]), 8)   # after "5 6": 7 8 ..., 9 1 5 ...
    (2, 2)
    >>> best_continuation(c, 0, np.array([8, 5, 6, 9, 4]), 8)
    (4, 10)
    >>> best_continuation(c, 1, np.array([3]), 8)
    (0, 2)
    """
    n = corpus.shape[0]
    if context == 0:
        starts = np.arange(n)
    else:
        tail = corpus[n - context :]
        ends = np.arange(context - 1, n - 1)  # an occurrence ending at j, its continuation from j + 1
        hit = np.ones(ends.shape[0], dtype=bool)
        for i in range(context):
            hit &= corpus[ends - (context - 1) + i] == tail[i]
        starts = ends[hit] + 1
    occurrences = int(starts.shape[0])
    best = 0
    for m in range(min(depth, truth.shape[0])):
        starts = starts[starts + m < n]
        starts = starts[corpus[starts + m] == truth[m]]
        if starts.size == 0:
            break
        best = m + 1
    return best, occurrences


def replay(prompt: np.ndarray, output: np.ndarray, shared: np.ndarray, context: int, depth: int) -> tuple[float, float]:
    """Rounds of the oracle over one output: (tokens per target pass, median occurrences a round)."""
    p, rounds, widths = 0, 0, []
    text = np.concatenate([shared, prompt, output])
    start = shared.shape[0] + prompt.shape[0]
    while p < output.shape[0]:
        corpus = text[: start + p]
        held, occurrences = best_continuation(corpus, context, output[p:], depth)
        p += min(held, output.shape[0] - p - 1) + 1  # the last token is always the target's own
        rounds += 1
        widths.append(occurrences)
    return output.shape[0] / rounds, float(statistics.median(widths))


def main() -> None:
    from specdeploy.core.errors import SpecdeployError
    from specdeploy.runtime import Session
    from specdeploy.runtime.tools.bench import read_prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--prompts", default=str(HERE / "prompts_varied.txt"))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=8, help="longest continuation a round verifies (a bundle's max draft)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    try:
        session = Session(args.bundle, prompt_cache=False)
        prompts = read_prompts(Path(args.prompts))[: args.limit]
    except (SpecdeployError, OSError) as e:
        sys.exit(f"lookup_bound: {e}")
    if not prompts:
        sys.exit(f"lookup_bound: {args.prompts}: no prompts (one per non-blank line)")
    shared = np.empty(0, dtype=np.int64)
    rows = []
    for prompt in prompts:
        ids = np.asarray(session.encode(prompt, chat=True), dtype=np.int64)
        out = np.asarray(session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, speculate=False).token_ids,
                         dtype=np.int64)
        row = {"prompt": prompt, "new_tokens": int(out.shape[0])}
        for c in CONTEXTS:
            for scope, before in (("own", shared[:0]), ("shared", shared)):
                row[f"{scope} c={c}"], row[f"{scope} c={c} width"] = replay(ids, out, before, c, args.depth)
        rows.append(row)
        shared = np.concatenate([shared, ids, out, [SEPARATOR]])
        print(f"{prompt[:40]!r}: " + "  ".join(f"{s} c={c} {row[f'{s} c={c}']:.2f}" for c in CONTEXTS
                                              for s in ("own", "shared")), flush=True)
    summary = {}
    print(f"\nmedian over {len(rows)} prompts: tokens per target pass at best (occurrences a round's tree merges)")
    for c in CONTEXTS:
        for scope in ("own", "shared"):
            key = f"{scope} c={c}"
            summary[key] = {"tokens_per_pass": statistics.median(r[key] for r in rows),
                            "mean": statistics.mean(r[key] for r in rows),
                            "width": statistics.median(r[key + " width"] for r in rows)}
            print(f"  {key:12s} {summary[key]['tokens_per_pass']:.2f}  (mean {summary[key]['mean']:.2f}, "
                  f"width {summary[key]['width']:.0f})")
    if args.json:
        args.json.write_text(json.dumps({"bundle": args.bundle, "prompts": args.prompts, "depth": args.depth,
                                         "max_new_tokens": args.max_new_tokens, "summary": summary, "rows": rows,
                                         "provenance": provenance()},
                                        indent=1))


if __name__ == "__main__":
    main()
