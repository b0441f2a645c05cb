"""The draft-length policy replayed without timing noise: `auto` against every fixed k.

    python benchmarks/policy_replay.py BUNDLE [--prompts FILE] [--limit N] [--max-new-tokens N]
        [--noise 0.05] [--seed 0] [--optimism X] [--json OUT]
    python benchmarks/policy_replay.py --from-json OUT [--noise ...] [--seed ...] [--optimism X]   # replay only

A measured speedup of `auto` against a fixed k moves by 5-15% between runs on a shared
machine, more than the policies differ. This replays them on what is fixed instead:

1. Trace (greedy, a bundle with a model draft): each prompt's plain output t_1..t_N, and
   for every position p the number of draft tokens that would hold there: the draft's
   greedy chain of max_draft tokens from the prompt and t_1..t_p, matched against
   t_p+1... (the draft catches up as it does in a round: a few passes a position).
2. Costs: this machine's median seconds of a target pass at T = 1..max_draft + 1 and of a
   draft pass at T = 1..max_draft + 1, the engines' passes interleaved.
3. Replay: for each policy, rounds over each prompt's positions: a round at p with draft
   length k costs the draft's first pass (it feeds the tokens committed since it last
   ran), k - 1 draft steps and a verify pass of k + 1 tokens, and commits min(k, held at p)
   + 1 tokens (k = 0: a plain step). `auto` is the runtime's own DraftLength, carried from
   prompt to prompt as a session carries it, fed the round's seconds times a random factor
   exp(N(0, noise)) (the scatter it sees where it runs; the replay's own clock stays exact).

Prints per policy the median over prompts of the speedup over plain decoding (the time of
N - 1 plain steps over the rounds' time: the decode-only ratio) and tokens per target
pass; `auto / best` is auto's median over the best fixed k's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from specdeploy.runtime import Session
from specdeploy.runtime.backends.ort import share_cpu_threads
from specdeploy.runtime.bench import read_prompts
from specdeploy.runtime.policy import DraftLength
from specdeploy.runtime.sampling import SamplingParams

HERE = Path(__file__).parent


def trace(session: Session, ids: np.ndarray, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(the plain output's tokens, how many draft tokens hold at each position 1..N-1)."""
    out = np.asarray(session.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, speculate=False).token_ids)
    drafter, k = session.drafter, session.bundle.max_draft
    greedy, rng = SamplingParams(), np.random.default_rng(0)
    held = np.zeros(len(out), dtype=np.int64)
    for p in range(1, len(out)):  # a round starts once t_1..t_p are committed
        context = np.concatenate([ids, out[:p]])
        chain, _ = drafter.propose(context, min(k, len(out) - p), greedy, rng)
        match = chain == out[p : p + len(chain)]
        held[p] = len(chain) if match.all() else int(match.argmin())
    return out, held


def costs(session: Session, context: int, reps: int) -> tuple[np.ndarray, np.ndarray]:
    """Median seconds of a target pass and of a draft pass at T = 1..max_draft + 1 (index T)."""
    target, draft = session.target, session.drafter.engine
    n = session.bundle.max_draft + 1
    times = {(who, t): [] for who in ("target", "draft") for t in range(1, n + 1)}
    tokens = np.full(n, 100, dtype=np.int64)
    for _ in range(reps):
        for (who, t), got in times.items():
            engine = target if who == "target" else draft
            t0 = time.perf_counter()
            engine.forward(tokens[:t], context, last=who == "draft")
            got.append(time.perf_counter() - t0)
    med = {key: statistics.median(v) for key, v in times.items()}
    return (np.array([0.0] + [med["target", t] for t in range(1, n + 1)]),
            np.array([0.0] + [med["draft", t] for t in range(1, n + 1)]))


def replay(held: np.ndarray, verify: np.ndarray, draft: np.ndarray, policy: DraftLength | int,
           noise: float, rng: np.random.Generator) -> tuple[float, float]:
    """(speedup over plain decoding, tokens per target pass) of one prompt's rounds."""
    n, p, seconds, passes, unseen = len(held), 1, 0.0, 0, 1
    max_k = len(verify) - 2
    jitter = (lambda: float(np.exp(rng.normal(0.0, noise)))) if noise else (lambda: 1.0)  # noqa: E731
    while p < n:
        k = policy if isinstance(policy, int) else policy.choose()
        k = min(k, n - p)
        if k == 0:
            seconds += verify[1]
            if not isinstance(policy, int):
                policy.update(0, 0, 0.0, verify[1] * jitter())
            p, passes, unseen = p + 1, passes + 1, unseen + 1
            continue
        accepted = min(k, int(held[p]))
        first = draft[min(unseen, max_k + 1)]
        spent_draft = first + (k - 1) * draft[1]
        seconds += spent_draft + verify[k + 1]
        if not isinstance(policy, int):
            j = jitter()
            policy.update(k, accepted, spent_draft * j, verify[k + 1] * jitter(), caught_up=unseen, draft_passes=k,
                          first_seconds=first * j)
        passes += 1
        # next round the draft feeds what it has not seen: the bonus token, and the last draft
        # token when every one held (the chain fed all but its last)
        unseen = 2 if accepted == k else 1
        p += accepted + 1
    return (n - 1) * verify[1] / seconds, (n - 1) / passes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--prompts", default=str(HERE / "prompts_varied.txt"))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--optimism", type=float, default=DraftLength.OPTIMISM,
                    help="DraftLength.OPTIMISM for `auto` (0: no optimism for positions rarely judged)")
    ap.add_argument("--json", type=Path, help="write the traces, costs and results here")
    ap.add_argument("--from-json", type=Path, help="replay the traces and costs an earlier --json holds (no model runs)")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        traces = [(p, 0, np.array(h)) for p, h in zip(saved["prompts"], saved["held"])]
        verify, draft = (np.array([0.0] + saved[key]) for key in ("verify_seconds", "draft_seconds"))
        cost_ratio = saved["cost_ratio"]
    else:
        share_cpu_threads()
        session = Session(args.bundle, prompt_cache=False)
        if session.drafter is None or session.drafter.engine is None:
            raise SystemExit(f"{args.bundle}: the draft is not a model (kind {session.bundle.draft_kind!r}); "
                             "this replays the draft-length policy of model drafts")
        traces = []
        for prompt in read_prompts(Path(args.prompts))[: args.limit]:
            ids = session.encode(prompt, chat=True)
            out, held = trace(session, ids, args.max_new_tokens)
            traces.append((prompt, len(ids), held))
            print(f"traced {prompt[:40]!r}: {len(out)} tokens, mean held {held[1:].mean():.2f}", flush=True)
        context = int(statistics.median(n for _, n, _ in traces)) + args.max_new_tokens // 2
        verify, draft = costs(session, context, args.reps)
        cost_ratio = session.drafter.cost_ratio
    max_k = len(verify) - 2
    DraftLength.OPTIMISM = args.optimism
    print("target pass ms at T = 1..:", " ".join(f"{x * 1e3:.1f}" for x in verify[1:]))
    print("draft pass ms at T = 1..: ", " ".join(f"{x * 1e3:.1f}" for x in draft[1:]))
    rng = np.random.default_rng(args.seed)
    policies: dict[str, list] = {f"k={k}": [] for k in range(max_k + 1)} | {"auto": []}
    auto = None
    for _, _, held in traces:
        for name in policies:
            if name == "auto":
                auto = DraftLength(max_k, cost_ratio=cost_ratio, measure=True).carry_from(auto)
                policies[name].append(replay(held, verify, draft, auto, args.noise, rng))
            else:
                policies[name].append(replay(held, verify, draft, int(name[2:]), 0.0, rng))
    summary = {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
               for name, rs in policies.items()}
    best = max((n for n in summary if n != "auto"), key=lambda n: summary[n][0])
    for name, (speedup, per_pass) in summary.items():
        print(f"{name:6s} speedup {speedup:.3f}x  tokens per pass {per_pass:.2f}")
    print(f"auto / best ({best}): {summary['auto'][0] / summary[best][0]:.3f}")
    if args.json:
        args.json.write_text(json.dumps({
            "bundle": args.bundle, "prompts": [p for p, _, _ in traces], "held": [h.tolist() for _, _, h in traces],
            "verify_seconds": verify[1:].tolist(), "draft_seconds": draft[1:].tolist(), "cost_ratio": cost_ratio,
            "noise": args.noise, "optimism": args.optimism,
            "summary": {n: {"speedup": s, "tokens_per_pass": t} for n, (s, t) in summary.items()},
        }, indent=1))


if __name__ == "__main__":
    main()
