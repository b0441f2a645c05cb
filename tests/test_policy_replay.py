"""benchmarks/policy_replay.py: its round accounting, and the runtime's `auto` replayed on the
traces and costs recorded from SmolLM2 runs (tests/fixtures/policy_replay_*.json, no models needed)."""
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

from specdeploy.runtime.decoding.policy import DraftLength

ROOT = Path(__file__).parents[1]
from benchmarks import policy_replay as replay_mod
RECORDED = sorted((ROOT / "tests" / "fixtures").glob("policy_replay_*.json"))


def flat_costs(max_k=8, plain=0.02, first=0.01, step=0.008, verify=0.025):
    k = max_k + 1
    return replay_mod.Costs(plain, np.full(k, first), np.full(k, step), np.full(k, verify), np.zeros(max_k + 2))


def test_rounds_are_counted_as_the_loop_runs_them():
    """Every draft token holds: a round of k commits k + 1 tokens; one that never holds commits
    1 token a round; k = 0 is plain decoding."""
    cost = flat_costs()
    n = 1 + 5 * 4  # the prefill's token, then 4 rounds of 5 at k = 4
    speedup, per_pass = replay_mod.replay(np.full(n, 8), cost, 4, 0.0, None)
    assert per_pass == 5.0
    assert speedup == pytest.approx((n - 1) * 0.02 / (4 * (0.01 + 3 * 0.008 + 0.025)))
    speedup, per_pass = replay_mod.replay(np.zeros(n, dtype=int), cost, 3, 0.0, None)
    assert per_pass == 1.0 and speedup < 1.0
    assert replay_mod.replay(np.full(n, 8), cost, 0, 0.0, None) == pytest.approx((1.0, 1.0))


def test_costs_survive_the_json_round_trip():
    cost = flat_costs()
    again = replay_mod.Costs.from_json(json.loads(json.dumps(cost.to_json())))
    assert again.plain == cost.plain and np.array_equal(again.verify, cost.verify)


def auto_over_best(path: Path, seeds=range(3)) -> float:
    saved = json.loads(path.read_text())
    cost, helds = replay_mod.Costs.from_json(saved["costs"]), [np.array(h) for h in saved["held"]]
    ratios = []
    for seed in seeds:
        runs = replay_mod.replay_policies(helds, cost, saved["cost_ratio"], 0.05, np.random.default_rng(seed), DraftLength)
        speedups = {name: statistics.median(r[0] for r in rs) for name, rs in runs.items()}
        ratios.append(speedups.pop("auto") / max(speedups.values()))
    return statistics.median(ratios)


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_auto_replayed_on_recorded_runs_comes_within_five_percent_of_the_best_k(path):
    assert auto_over_best(path) >= 0.95


def test_the_bound_catches_a_policy_that_drafts_where_no_k_pays():
    """Companion: on the 2-layer self-draft's trace (no k pays), drafting 2 tokens a round
    falls far below plain steps, which the bound above would catch."""
    saved = json.loads((ROOT / "tests" / "fixtures" / "policy_replay_int4_self2.json").read_text())
    cost = replay_mod.Costs.from_json(saved["costs"])
    pinned = statistics.median(replay_mod.replay(np.array(h), cost, 2, 0.0, None)[0] for h in saved["held"])
    assert pinned < 0.95
