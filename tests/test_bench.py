"""bench: its arithmetic and the analytic model against values worked by hand, and a run on a
tiny bundle whose prediction is recomputed here, by hand, from the fields it was made of."""
import json
import math
from types import SimpleNamespace

import pytest

from specdeploy.core.analytic import acceptance_estimate, predicted_speedup, tokens_per_pass
from specdeploy.core.errors import InputError
from specdeploy.runtime.tools.bench import (
    bench,
    device_timers,
    format_report,
    inter_token_gaps,
    parse_draft_lens,
    percentile,
    plot,
    write_json,
)
from tiny import PROMPTS


def test_percentile_by_hand():
    # rank = (n - 1) * q / 100, linear between the neighbours (numpy's default)
    assert percentile([4, 1, 3, 2], 50) == 2.5  # rank 1.5: 2 + 0.5 * (3 - 2)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)  # rank 3.6: 40 + 0.6 * 10
    assert percentile([7], 90) == 7
    assert percentile([1, 2], 0) == 1 and percentile([1, 2], 100) == 2
    assert math.isnan(percentile([], 50))


def test_tokens_per_pass_and_predicted_speedup_by_hand():
    # a = 0.5, g = 2: 1 + 0.5 + 0.25 = 1.75 tokens per pass; g*c + 1 = 1.2 -> 1.4583
    assert tokens_per_pass(0.5, 2) == pytest.approx(1.75)
    assert predicted_speedup(0.5, 2, 0.1) == pytest.approx(1.75 / 1.2)
    # a = 0.8, g = 4: (1 - 0.8^5) / 0.2 = (1 - 0.32768) / 0.2 = 3.3616; c = 0.05: / 1.2 = 2.80133
    assert tokens_per_pass(0.8, 4) == pytest.approx(3.3616)
    assert predicted_speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    # every draft accepted: g + 1 tokens per pass
    assert tokens_per_pass(1.0, 4) == 5 and predicted_speedup(1.0, 4, 0.05) == pytest.approx(5 / 1.2)
    # nothing accepted: one token per pass, and the draft's cost is pure loss
    assert tokens_per_pass(0.0, 8) == 1 and predicted_speedup(0.0, 8, 0.1) == pytest.approx(1 / 1.8)
    # g = 0 is plain decoding
    assert predicted_speedup(0.7, 0, 0.3) == 1
    # a mean draft length need not be whole: a = 0.5, g = 1.5: (1 - 0.5^2.5) / 0.5 = 2 - 2^-1.5
    assert tokens_per_pass(0.5, 1.5) == pytest.approx(2 - 2 ** -1.5)  # 1.646447
    # a verify pass that grows with T: g*c + 1 + growth*g = 0.2 + 1 + 0.1 = 1.3
    assert predicted_speedup(0.5, 2, 0.1, verify_growth=0.05) == pytest.approx(1.75 / 1.3)


def test_acceptance_estimate_by_hand():
    # rounds (proposed, accepted): 2 of 4 then a rejection; 4 of 4 (cut by k, no rejection);
    # 0 of 2 (a rejection): 6 accepted over 6 + 2 trials
    assert acceptance_estimate([(4, 2), (4, 4), (2, 0)]) == 0.75
    assert acceptance_estimate([(3, 3), (3, 3)]) == 1.0
    assert acceptance_estimate([(0, 0)]) == 0.0  # plain rounds carry no evidence
    assert acceptance_estimate([]) == 0.0


def test_inter_token_gaps_by_hand():
    # rounds arrive at 0.5 s (2 tokens), 0.75 s (1 token), 1.5 s (3 tokens): TTFT 0.5 s,
    # then 0.25 s for the lone token and 0.75 / 3 = 0.25 s for each of the three
    ttft, gaps = inter_token_gaps(0.0, [(0.5, 2), (0.75, 1), (1.5, 3)])
    assert ttft == 0.5 and gaps == [0.25, 0.25, 0.25, 0.25]
    ttft, gaps = inter_token_gaps(1.0, [(1.25, 1), (1.5, 0), (2.0, 2)])  # an empty flush piece is skipped
    assert ttft == 0.25 and gaps == [0.375, 0.375]
    assert percentile(gaps, 50) == 0.375


def test_parse_draft_lens():
    assert parse_draft_lens("1,2, 4,8,auto", 8) == [1, 2, 4, 8, "auto"]
    assert parse_draft_lens((1, "auto"), 8) == [1, "auto"]
    with pytest.raises(InputError, match=r"--draft-len 9: outside \[1, 8\]"):
        parse_draft_lens("9", 8)
    with pytest.raises(InputError, match="expected integers or 'auto'"):
        parse_draft_lens("two", 8)


def test_device_timers_turn_on_only_engines_that_declare_device_timing():
    class Timed:  # the torch backend's shape: it declares `time_device`
        def __init__(self, device):
            self.device, self.time_device, self.stats = device, False, SimpleNamespace(device_seconds=0.0)

    class Untimed:  # a CUDA engine without device timing (the TensorRT backend's shape)
        device, stats = "cuda:0", {}

    gpu, cpu = Timed("cuda:0"), Timed("cpu")
    session = SimpleNamespace(target=gpu, drafter=SimpleNamespace(engine=cpu))
    assert device_timers(session) == {"target": gpu} and gpu.time_device and not cpu.time_device
    session = SimpleNamespace(target=Untimed(), drafter=SimpleNamespace(engine=None))  # a model-free drafter
    assert device_timers(session) == {}
    assert device_timers(SimpleNamespace(target=Timed("cuda:1"), drafter=None)).keys() == {"target"}


def test_bench_on_a_tiny_bundle(bundles, tmp_path):
    report = bench(
        bundles("llama-model"), draft_lens="1,4,auto", prompts=PROMPTS[:2], max_new_tokens=12, repeats=2, threads=1
    )
    assert report["backend"] == "ort" and report["clock"] == "wall-clock"
    plain = report["plain"]
    assert plain["runs"] == 4 and plain["new_tokens"] == 4 * 12
    assert plain["tokens_per_pass"] == 1.0 and plain["draft_seconds"] == 0
    assert [c["draft_len"] for c in report["configs"]] == [1, 4, "auto"]
    for c in report["configs"]:
        for key in ("tokens_per_second", "ttft_ms_median", "itl_ms_median", "itl_ms_p90", "measured_speedup",
                    "predicted_speedup", "acceptance", "cost_ratio", "prefill_seconds", "draft_seconds",
                    "verify_seconds", "host_seconds"):
            assert c[key] >= 0 and math.isfinite(c[key]), key
        assert c["itl_ms_p90"] >= c["itl_ms_median"]
        assert c["identical"] == "4/4"  # greedy: every speculative run equals its plain run
        assert c["new_tokens"] == 4 * 12 and c["draft_passes"] > 0
        # The model's inputs, recomputed from the time split: c is a draft step over a plain
        # step (plain decoding's verify time per target pass), v a verify pass over a plain step.
        plain_step = plain["verify_seconds"] / plain["target_passes"]
        assert c["cost_ratio"] == pytest.approx(c["draft_seconds"] / c["draft_passes"] / plain_step)
        assert c["verify_cost_ratio"] == pytest.approx(c["verify_seconds"] / c["target_passes"] / plain_step)
        assert 0 < c["mean_draft_len"] <= (8 if c["draft_len"] == "auto" else c["draft_len"])  # 8: the bundle's max
        # The prediction, written out here (Leviathan et al.), not by the function it checks:
        # (1 - a^(g+1)) / (1 - a) tokens per pass, at g*c + 1 plain steps (+ v - 1 with verify).
        a, g, cost, v = c["acceptance"], c["mean_draft_len"], c["cost_ratio"], c["verify_cost_ratio"]
        per_pass = g + 1 if a == 1 else (1 - a ** (g + 1)) / (1 - a)
        assert c["predicted_tokens_per_pass"] == pytest.approx(per_pass)
        assert c["predicted_speedup"] == pytest.approx(per_pass / (g * cost + 1))
        assert v > 0 and c["predicted_speedup_with_verify"] == pytest.approx(per_pass / (g * cost + v))
        assert 0 <= c["acceptance"] <= 1
    assert len(report["configs"][1]["acceptance_by_position"]) == 4
    text = format_report(report)
    assert "plain" in text and "acceptance by position, draft 4" in text
    write_json(report, tmp_path / "bench.json")
    assert json.loads((tmp_path / "bench.json").read_text())["configs"][0]["draft_len"] == 1
    pytest.importorskip("matplotlib")
    plot(report, tmp_path / "bench.png")
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_on_the_torch_backend(bundles):
    report = bench(bundles("llama-self"), backend="torch", draft_lens=[2], prompts=PROMPTS[:1], max_new_tokens=8,
                   repeats=1, warmup=False)
    assert report["backend"] == "torch" and report["configs"][0]["identical"] == "1/1"


def test_bench_rejects_a_draft_length_past_the_bundle(bundles):
    with pytest.raises(InputError, match="the bundle's max draft"):
        bench(bundles("llama-model"), draft_lens="16", prompts=PROMPTS[:1], max_new_tokens=4, repeats=1)


def test_bench_reports_the_trees_of_a_suffix_bundle(bundles):
    report = bench(bundles("llama-suffix"), draft_lens="2,auto", prompts=PROMPTS[:2], max_new_tokens=12, repeats=1,
                   threads=1)
    chain, auto = report["configs"]
    assert "tree_rounds" not in chain  # a pinned draft length runs chains
    assert auto["tree_rounds"] == auto["target_passes"] and auto["identical"] == "2/2"
    assert sum(auto["tree_size_histogram"].values()) == auto["tree_rounds"]
    assert 0 <= auto["accepted_path_mean"] <= auto["tree_nodes_mean"] + 8
    assert "token trees, draft auto:" in format_report(report)
