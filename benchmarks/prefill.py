"""Prompt processing per token, bundles side by side in one process, alternating.

    python benchmarks/prefill.py BUNDLE [BUNDLE ...] [--prompts FILE] [--repeats R]

For every prompt (chat template applied), each repeat prefills it once on every bundle, the
bundles' order rotating by one each time: `prefill` of the loop (every prompt token but the
last, in the bundle's chunks, nothing cached), timed per prompt token. Prints each bundle's
median milliseconds per token and, against the first bundle, the median of per-prompt
ratios. Compare a bundle of format version 1 (every logit row computed) with one of
version 2 (a chunk's logits asked for its last row only) to see what the head costs.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from specdeploy.runtime import Session
from specdeploy.runtime.backends.ort import share_cpu_threads
from specdeploy.runtime.tools.bench import read_prompts
from specdeploy.runtime.decoding.loop import prefill

HERE = Path(__file__).parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--prompts", default=str(HERE / "prompts_grounded.txt"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: every core)")
    args = ap.parse_args()
    share_cpu_threads(args.threads)
    sessions = {b: Session(b, prompt_cache=False) for b in args.bundles}
    first = next(iter(sessions.values()))
    prompts = [np.asarray(first.encode(p, chat=True), dtype=np.int64) for p in read_prompts(Path(args.prompts))]
    per_token = {b: [[] for _ in prompts] for b in sessions}
    turn = 0
    for _ in range(args.repeats):
        for i, ids in enumerate(prompts):
            names = list(sessions)
            names = names[turn % len(names):] + names[: turn % len(names)]
            turn += 1
            for b in names:
                session = sessions[b]
                t0 = time.perf_counter()
                prefill(session.target, ids, session.bundle.prefill_chunk)
                per_token[b][i].append((time.perf_counter() - t0) / (ids.shape[0] - 1))
    medians = {b: [statistics.median(runs) for runs in per_token[b]] for b in sessions}
    base = args.bundles[0]
    print(f"{len(prompts)} prompts, {int(statistics.median(p.shape[0] for p in prompts))} tokens (median), "
          f"{args.repeats} repeats")
    for b, values in medians.items():
        ratio = statistics.median(v / w for v, w in zip(values, medians[base]))
        print(f"{b}: {1e3 * statistics.median(values):.3f} ms per prompt token "
              f"({1 / statistics.median(values):.0f} tok/s), {ratio:.3f}x the time of {Path(base).name}")


if __name__ == "__main__":
    main()
