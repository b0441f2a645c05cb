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
2. Costs: this machine's median seconds of each pass as it runs in a round of each k (a
   draft pass of 2 tokens, k - 1 draft steps, a verify pass of k + 1 tokens, the rounds of
   every k taking turns) and of a target step among plain steps (see Costs).
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdeploy.runtime import Session
from specdeploy.runtime.backends.ort import share_cpu_threads
from specdeploy.runtime.tools.bench import read_prompts
from specdeploy.runtime.decoding.policy import DraftLength
from specdeploy.runtime.decoding.stats import Round
from specdeploy.runtime.decoding.sampling import SamplingParams

try:
    from benchmarks.provenance import provenance
except ModuleNotFoundError:  # run as a file (python benchmarks/NAME.py): benchmarks/ is on sys.path
    from provenance import provenance

HERE = Path(__file__).parent


class Optimistic(DraftLength):
    """A variant replayed against the runtime's policy (`--optimism X`, not kept: docs/drafters.md): each
    position's estimate h raised by X * sqrt(h (1 - h)) / n, n the rounds that judged it, so that
    one early rejection at a position does not keep k below it until its count fades."""

    OPTIMISM = 0.0

    def held(self) -> np.ndarray:
        a = min(self.acceptance, 0.999)
        n = self.POSITION_PRIOR + self.trials
        h = (self.POSITION_PRIOR * a + self.hits) / n
        return np.minimum(h + self.OPTIMISM * np.sqrt(h * (1.0 - h)) / n, 0.999)


def trace(session: Session, ids: np.ndarray, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(the plain output's tokens, how many draft tokens hold at each position 1..N-1)."""
    out = np.asarray(session.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, speculate=False).token_ids)
    drafter, k = session.drafter, session.bundle.max_draft
    greedy, rng = SamplingParams(), np.random.default_rng(0)
    held = np.zeros(len(out), dtype=np.int64)
    for p in range(1, len(out)):  # a round starts once t_1..t_p are committed
        context = np.concatenate([ids, out[:p]])
        chain = drafter.propose(context, min(k, len(out) - p), greedy, rng).tokens
        match = chain == out[p : p + len(chain)]
        held[p] = len(chain) if match.all() else int(match.argmin())
    return out, held


@dataclass
class Costs:
    """Seconds, as the passes run in rounds (a pass right after the other model's runs a few
    percent slower than one after its own kind: SmolLM2 fp32 + int4 self-draft, a T = 5
    verify pass 28.1 ms after four draft steps against 27.4 ms after a target step, side by
    side): `plain` a target step among plain steps; per k = 1..max_draft, a round's first
    draft pass (feeding 2 tokens), its later draft steps (mean) and its verify pass;
    `catch_up[T]` a draft pass of T tokens less one of 2, never below 0 (a first pass after
    plain steps; one of 1 token, after a rejection, is priced as one of 2: 0.3 ms dear for
    the int4 self-draft, in every policy alike)."""

    plain: float
    first: np.ndarray  # [k], index 0 unused
    step: np.ndarray
    verify: np.ndarray
    catch_up: np.ndarray  # [T], index 0 unused

    def to_json(self) -> dict:
        return {key: (value.tolist() if isinstance(value, np.ndarray) else value) for key, value in vars(self).items()}

    @classmethod
    def from_json(cls, d: dict) -> "Costs":
        return cls(d["plain"], *(np.array(d[key]) for key in ("first", "step", "verify", "catch_up")))


def costs(session: Session, context: int, reps: int) -> Costs:
    """Medians over `reps` rounds of each k (the k rotating) and runs of plain steps."""
    target, draft = session.target, session.drafter.engine
    max_k = session.bundle.max_draft
    tokens = np.full(max_k + 2, 100, dtype=np.int64)

    def timed(engine, t, last=False):
        t0 = time.perf_counter()
        engine.forward(tokens[:t], context, last=last)
        return time.perf_counter() - t0

    plain, by_t = [], {t: [] for t in range(1, max_k + 2)}
    rounds = {k: ([], [], []) for k in range(1, max_k + 1)}
    for _ in range(reps):
        for k, (first, step, verify) in rounds.items():
            first.append(timed(draft, 2, last=True))
            step.append(statistics.mean([timed(draft, 1, last=True) for _ in range(k - 1)] or [0.0]))
            verify.append(timed(target, k + 1))
        plain.extend(timed(target, 1) for _ in range(4))
        for t, got in by_t.items():
            got.append(timed(draft, t, last=True))
    med = statistics.median
    by = np.array([0.0] + [med(by_t[t]) for t in by_t])
    return Costs(
        med(plain[1::4] + plain[2::4] + plain[3::4]),  # a step after a step
        *(np.array([0.0] + [med(rounds[k][i]) for k in rounds]) for i in range(3)),
        catch_up=np.concatenate([[0.0], np.maximum(by[1:] - by[2], 0.0)]),
    )


def replay(held: np.ndarray, cost: Costs, policy: DraftLength | int, noise: float,
           rng: np.random.Generator | None) -> tuple[float, float]:
    """(speedup over plain decoding, tokens per target pass) of one prompt's rounds."""
    n, p, seconds, passes, unseen = len(held), 1, 0.0, 0, 1
    jitter = (lambda: float(np.exp(rng.normal(0.0, noise)))) if noise else (lambda: 1.0)  # noqa: E731
    while p < n:
        k = policy if isinstance(policy, int) else policy.choose()
        k = min(k, n - p)
        if k == 0:
            seconds += cost.plain
            if not isinstance(policy, int):
                policy.update(Round(0, 0, cost.plain * jitter()))
            p, passes, unseen = p + 1, passes + 1, unseen + 1
            continue
        accepted = min(k, int(held[p]))
        first = cost.first[k] + cost.catch_up[min(unseen, len(cost.catch_up) - 1)]
        spent_draft = first + (k - 1) * cost.step[k]
        seconds += spent_draft + cost.verify[k]
        if not isinstance(policy, int):
            j = jitter()
            policy.update(Round(k, accepted, cost.verify[k] * jitter(), spent_draft * j, draft_passes=k, caught_up=unseen,
                                first_seconds=first * j))
        passes += 1
        # next round the draft feeds what it has not seen: the bonus token, and the last draft
        # token when every one held (the chain fed all but its last)
        unseen = 2 if accepted == k else 1
        p += accepted + 1
    return (n - 1) * cost.plain / seconds, (n - 1) / passes


def replay_policies(helds: list[np.ndarray], cost: Costs, cost_ratio: float, noise: float, rng: np.random.Generator,
                    policy: type[DraftLength] = DraftLength) -> dict[str, list[tuple[float, float]]]:
    """Each fixed k = 0..max_k and `auto` (`policy`, carried from prompt to prompt as a session
    carries it) over every prompt's trace: {"k=0": [(speedup, tokens per pass) per prompt], ...,
    "auto": [...]}. Only `auto` draws on `rng` (its timing scatter)."""
    max_k = len(cost.first) - 1
    results = {f"k={k}": [replay(held, cost, k, 0.0, None) for held in helds] for k in range(max_k + 1)}
    auto, results["auto"] = None, []
    for held in helds:
        auto = policy(max_k, cost_ratio=cost_ratio, measure=True).carry_from(auto)
        results["auto"].append(replay(held, cost, auto, noise, rng))
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--prompts", default=str(HERE / "prompts_varied.txt"))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--optimism", type=float, default=0.0,
                    help="replay `auto` as the Optimistic variant with this bonus (0: the runtime's DraftLength)")
    ap.add_argument("--json", type=Path, help="write the traces, costs and results here")
    ap.add_argument("--from-json", type=Path, help="replay the traces and costs an earlier --json holds (no model runs)")
    args = ap.parse_args()
    if not args.from_json and not args.bundle:
        ap.error("give a bundle, or --from-json")
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        traces = [(p, 0, np.array(h)) for p, h in zip(saved["prompts"], saved["held"])]
        cost = Costs.from_json(saved["costs"])
        cost_ratio = saved["cost_ratio"]
        args.bundle = args.bundle or saved["bundle"]
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
        cost = costs(session, context, args.reps)
        cost_ratio = session.drafter.cost_ratio
    max_k = len(cost.first) - 1
    Optimistic.OPTIMISM = args.optimism
    policy = Optimistic if args.optimism else DraftLength
    print(f"ms, in rounds of k = 1..{max_k} (plain step {cost.plain * 1e3:.1f}):")
    for name in ("first", "step", "verify"):
        print(f"  {name:6s}", " ".join(f"{x * 1e3:5.1f}" for x in getattr(cost, name)[1:]))
    policies = replay_policies([held for _, _, held in traces], cost, cost_ratio, args.noise,
                               np.random.default_rng(args.seed), policy)
    summary = {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
               for name, rs in policies.items()}
    best = max((n for n in summary if n != "auto"), key=lambda n: summary[n][0])
    for name, (speedup, per_pass) in summary.items():
        print(f"{name:6s} speedup {speedup:.3f}x  tokens per pass {per_pass:.2f}")
    print(f"auto / best ({best}): {summary['auto'][0] / summary[best][0]:.3f}")
    if args.json:
        args.json.write_text(json.dumps({
            "bundle": args.bundle, "prompts": [p for p, _, _ in traces], "held": [h.tolist() for _, _, h in traces],
            "costs": cost.to_json(), "cost_ratio": cost_ratio,
            "noise": args.noise, "optimism": args.optimism,
            "summary": {n: {"speedup": s, "tokens_per_pass": t} for n, (s, t) in summary.items()},
            "provenance": provenance(),
        }, indent=1))


if __name__ == "__main__":
    main()
