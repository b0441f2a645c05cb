"""`specdeploy eval`: the quality contract passes on a lossless bundle and fails, with
the first differing position and the margin there, when speculation changes the output."""
import json

import numpy as np
from click.testing import CliRunner

from specdeploy.runtime import Session
from specdeploy.runtime import loop as loop_module
from specdeploy.runtime.evaluate import _chi2_sf, evaluate
from specdeploy.cli import main
from tiny import PROMPTS


def test_chi2_survival_function_matches_scipy():
    from scipy import stats

    for x, dof in [(0.5, 1), (3.0, 2), (10.0, 5), (40.0, 20), (200.0, 150), (1.0, 30)]:
        assert abs(_chi2_sf(x, dof) - stats.chi2.sf(x, dof)) < 1e-9


def test_eval_cli_passes_on_a_lossless_bundle(bundles, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:5]))
    out = tmp_path / "report.json"
    result = CliRunner().invoke(main, ["eval", str(bundles("llama-model")), "--prompts", str(prompts),
                                       "--max-new-tokens", "24", "--samples", "150", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "contract holds" in result.stdout
    report = json.loads(out.read_text())
    assert report["greedy"]["exact_match_rate"] == 1.0
    assert report["sampling"]["ok"] and report["sampling"]["drafted"] > 0


def _wrong_accept(draft_tokens, target_tokens):
    """A broken verifier: accepts every draft token."""
    return draft_tokens.shape[0], int(target_tokens[-1])


def test_eval_reports_a_wrong_accept(bundles, monkeypatch):
    monkeypatch.setattr(loop_module, "accept_greedy", _wrong_accept)
    report = evaluate(Session(bundles("llama-model")), PROMPTS[:4], max_new_tokens=24, samples=0)
    assert not report["contract_holds"]
    bad = [r for r in report["greedy"]["rows"] if not r["match"]]
    assert bad and all(r["verdict"] == "WRONG ACCEPT" and r["margin"] > 1e-3 for r in bad)
    assert all(isinstance(r["first_difference"], int) for r in bad)


def test_eval_exits_nonzero_when_broken(bundles, tmp_path, monkeypatch):
    monkeypatch.setattr(loop_module, "accept_greedy", _wrong_accept)
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPTS[0])
    result = CliRunner().invoke(main, ["eval", str(bundles("llama-model")), "--prompts", str(prompts), "--samples", "0"])
    assert result.exit_code == 3
    assert "contract BROKEN" in result.stdout
