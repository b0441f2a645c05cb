"""proofs/gpu_check.py rehearsed on the CPU (--tiny): the GPU proof script (issue 17) must run
end to end before a device is lent to it, through the import path the device uses (the checkout's
folders mapped onto `specdeploy.*`, no install). About 25 s."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.bundle  # builds models and runs the whole proof script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "proofs" / "gpu_check.py"


def test_tiny_runs_end_to_end(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SPECDEPLOY_SHIM": "1"}
    out = subprocess.run([sys.executable, str(SCRIPT), "--tiny", str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["failed"] == []
    assert {"replay_matches_eager_target", "lossless_speculative_equals_plain", "prompt_cache_equals_fresh",
            "sampled_replays_from_seed", "at_most_one_sync_per_round", "restricted_head_captures_as_exported",
            "batched_replay_equals_eager"} <= set(report["checks"])
    assert set(report["loops"]) == {"tiny+draft", "tiny+distilled", "tiny-b+draft-b"}
    for loop in report["loops"].values():
        rows = loop["rows"]
        assert all(row["syncs_per_round"] == 1 for row in rows.values())
        assert rows["random k=8"]["acceptance"] < 0.1  # a random draft pins the low end
        assert rows["random k=8"]["identical"] == "2/2"
    assert report["loops"]["tiny+draft"]["rows"]["self k=4"]["acceptance"] > 0.9  # the target drafting for itself
    assert "self k=1" not in report["loops"]["tiny+distilled"]["rows"]  # measured once per target
    predictions = report["predictions"]["tiny+draft"]
    assert set(predictions["at_measured_acceptance"]) >= {"distilled-1L", "ngram-grounded"}
    assert "calibrated" in predictions["at_measured_acceptance"]["distilled-1L"]
    summary = (tmp_path / "summary.md").read_text()
    assert "| pair | run |" in summary and "Break-even" in summary


def test_minimal_builder_fits_specgraph():
    """The builder for a device without transformers gives SpecGraph the attributes it borrows."""
    from proofs import gpu_check as module
    plan = module.Plan(module.TINY_CONFIGS, module.TINY_PAIRS, module.TINY_CORRECTNESS_PAIR)
    graph = module.build_graph("tiny-distilled", plan, "cpu", torch.float32, seed=1, builder="minimal")
    logits = module.engine(graph, "draft", torch.float32, "cpu", True).forward(np.arange(5), 0)
    assert logits.shape == (5, 512)
    assert np.isfinite(logits).sum(-1).tolist() == [128] * 5  # the restricted head's tokens only
