"""Two bundles' target graphs, decoding side by side: the time of a step, paired per prompt.

    python benchmarks/graph_ab.py BUNDLE_A BUNDLE_B [--prompts FILE | --documents 3072,6144] [--steps N]
        [--repeats R] [--threads N]

For A/B tests of graph changes (an export of the same model before and after). Each bundle's
target runs a bare greedy loop (its engine's `forward` and an argmax: no policy, no text) for
--steps tokens after its prompt; for every prompt and repeat, both bundles run, in alternating
order. Prints each bundle's median time per step and the median over prompts of B's time over
A's on the same prompt. Load order matters on a shared CPU (of two sessions in one process,
the one loaded second ran 5-7% faster in runs of one graph against itself): run both orders,
`A B` and `B A`, and quote both. --documents: instead of the prompts, the long-prompt
benchmark's summaries of the GPL-3 text cut to those lengths (benchmarks/long_prompts.py).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from specdeploy.runtime import Session
from specdeploy.runtime.tools.bench import read_prompts

HERE = Path(__file__).parent


def step_seconds(session: Session, ids: list[int], steps: int) -> float:
    """Mean seconds per greedy step after prefilling `ids`."""
    engine = session.target
    prompt = np.asarray(ids, dtype=np.int64)
    engine.forward(prompt[:-1], 0, last=True)
    token, position = int(prompt[-1]), prompt.shape[0] - 1
    t0 = time.perf_counter()
    for _ in range(steps):
        token = int(engine.forward(np.array([token]), position)[0].argmax())
        position += 1
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--prompts", default=str(HERE / "prompts.txt"))
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--documents", help="comma-separated lengths in tokens: long summaries instead of --prompts")
    args = ap.parse_args()
    sessions = [Session(path, threads=args.threads, prompt_cache=False) for path in (args.a, args.b)]
    if args.documents:
        try:
            from benchmarks.long_prompts import LICENCE, SUMMARY, cut
        except ModuleNotFoundError:  # run as a file
            from long_prompts import LICENCE, SUMMARY, cut
        prompts = [cut(sessions[0], LICENCE.read_text(), int(n)) + SUMMARY for n in args.documents.split(",")]
    else:
        prompts = read_prompts(Path(args.prompts))
    times: list[list[float]] = [[], []]
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            ids = sessions[0].encode(prompt, chat=True)
            order = (0, 1) if (i + repeat) % 2 == 0 else (1, 0)
            for which in order:
                times[which].append(step_seconds(sessions[which], ids, args.steps))
    ratio = statistics.median(b / a for a, b in zip(*times))
    for path, seconds in zip((args.a, args.b), times):
        print(f"{path}: {statistics.median(seconds) * 1e3:.3f} ms a step (median of {len(seconds)} runs)")
    print(f"B / A, median over prompts and repeats of the paired ratio: {ratio:.3f} (loaded first: A)")


if __name__ == "__main__":
    main()
