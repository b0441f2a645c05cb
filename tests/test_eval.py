"""`specdeploy eval`: the quality contract passes on a lossless bundle and fails, with
the first differing position and the margin there, when speculation changes the output."""
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from specdeploy.runtime import Session
from specdeploy.runtime.decoding import accept as accept_module
from specdeploy.runtime.tools.evaluate import _chi2_sf, evaluate
from specdeploy.cli import main
from test_sampling import _broken_skips_residual
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
    monkeypatch.setattr(accept_module, "accept_greedy", _wrong_accept)
    report = evaluate(Session(bundles("llama-model")), PROMPTS[:4], max_new_tokens=24, samples=0)
    assert not report["contract_holds"]
    bad = [r for r in report["greedy"]["rows"] if not r["match"]]
    assert bad and all(r["verdict"] == "WRONG ACCEPT" and r["margin"] > 1e-3 for r in bad)
    assert all(isinstance(r["first_difference"], int) for r in bad)


def test_eval_exits_nonzero_when_broken(bundles, tmp_path, monkeypatch):
    monkeypatch.setattr(accept_module, "accept_greedy", _wrong_accept)
    prompts = tmp_path / "p.txt"
    prompts.write_text(PROMPTS[0])
    result = CliRunner().invoke(main, ["eval", str(bundles("llama-model")), "--prompts", str(prompts), "--samples", "0"])
    assert result.exit_code == 3
    assert "contract BROKEN" in result.stdout


# -- the sampling check exercises the draft path it certifies (issue 18, item 7) -------------


def _prompts_file(tmp_path, prompts=PROMPTS[:5]):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts))
    return path


def _eval(bundle, tmp_path, *extra):
    out = tmp_path / "report.json"
    result = CliRunner().invoke(main, ["eval", str(bundle), "--prompts", str(_prompts_file(tmp_path)),
                                       "--max-new-tokens", "24", "--samples", "150", "--json", str(out), *extra])
    report = json.loads(out.read_text()) if out.exists() else None
    return result, report


@pytest.mark.parametrize("name", ["llama-ngram", "llama-model", "llama-self", "llama-same"])
def test_the_sampling_check_sees_draft_tokens_for_every_draft_kind(bundles, tmp_path, name):
    """The n-gram bundle used to pass with 0 draft tokens proposed (its chat prompts end in
    a bigram the lookup never finds), llama-same too (auto never drafts a draft as costly as
    the target): now the check samples where the drafter proposes, with both verdicts seen."""
    result, report = _eval(bundles(name), tmp_path)
    assert result.exit_code == 0, result.output
    assert "contract holds" in result.stdout
    s = report["sampling"]
    assert s["ok"] and s["drafted"] == s["samples"] == 150
    assert s["accepted"] + s["rejected"] == s["drafted"] and s["accepted"] > 0
    if name != "llama-same":  # a draft equal to the target is never rejected
        assert s["rejected"] > 0
    assert report["greedy"]["drafted"] > 0


def test_nothing_proposed_is_not_tested_not_holds(bundles, tmp_path):
    """One new token: the greedy check never drafts, and the n-gram lookup finds nothing at the
    end of any chat prompt. The gate must not say "holds": it says "not tested", exit 4."""
    result, report = _eval(bundles("llama-ngram"), tmp_path, "--max-new-tokens", "1")
    assert result.exit_code == 4, result.output
    assert "contract NOT TESTED" in result.stdout and "holds" not in result.stdout
    assert report["verdict"] == "not tested" and not report["contract_holds"]
    assert report["sampling"]["drafted"] == 0 and not report["sampling"]["tested"]


def _broken_accepts_with_p(draft_tokens, draft_probs, target_probs, rng):
    """A wrong sampler: accepts a drafted x with probability p(x), not min(1, p(x) / q(x))."""
    from specdeploy.runtime.decoding.sampling import sample

    for i in range(draft_tokens.shape[0]):
        x = int(draft_tokens[i])
        if rng.random() < target_probs[i, x]:
            continue
        q = np.zeros_like(target_probs[i]) if draft_probs is None else draft_probs[i]
        if draft_probs is None:
            q[x] = 1.0
        residual = np.maximum(target_probs[i] - q, 0.0)
        return i, sample(residual if residual.sum() > 0 else target_probs[i], rng)
    return draft_tokens.shape[0], sample(target_probs[-1], rng)


@pytest.mark.parametrize("name, broken", [
    ("llama-ngram", _broken_skips_residual), ("llama-model", _broken_skips_residual),
    ("llama-self", _broken_skips_residual),
    # the same as the right one for a point-mass draft (q(x) = 1), wrong for a model draft
    ("llama-model", _broken_accepts_with_p), ("llama-self", _broken_accepts_with_p),
])
def test_a_broken_sampler_fails_the_gate(bundles, tmp_path, monkeypatch, name, broken):
    """The old check passed all of these (at 150 samples): at the prompt's end the first
    token's distribution moved too little to see, or (n-gram) nothing was drafted."""
    monkeypatch.setattr(accept_module, "accept_sampled", broken)
    result, report = _eval(bundles(name), tmp_path)
    assert result.exit_code == 3, result.output
    assert "contract BROKEN" in result.stdout
    assert not report["sampling"]["ok"] and report["sampling"]["pvalue"] < report["sampling"]["alpha"]
    assert report["greedy"]["wrong_accepts"] == 0  # greedy is untouched: the sampling check caught it


def _without_chat_template(bundle, tmp_path):
    copy = tmp_path / "base-model"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tokenizer"]["chat_template"] = None
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_a_bundle_without_chat_template_is_gateable(bundles, tmp_path):
    base = _without_chat_template(bundles("llama-ngram"), tmp_path)
    result, report = _eval(base, tmp_path)
    assert result.exit_code == 0, result.output
    assert "contract holds" in result.stdout and report["chat"] is False
    assert report["sampling"]["drafted"] > 0
    # asking for the template it lacks is a one-line error; --no-chat is the same as the default
    asked = CliRunner().invoke(main, ["eval", str(base), "--prompts", str(_prompts_file(tmp_path)), "--chat"])
    assert asked.exit_code == 1 and "no chat template" in asked.output and "--no-chat" in asked.output
    plain, _ = _eval(base, tmp_path, "--no-chat")
    assert plain.exit_code == 0, plain.output


def test_no_chat_on_a_chat_bundle(bundles, tmp_path):
    result, report = _eval(bundles("llama-model"), tmp_path, "--no-chat", "--samples", "0")
    assert result.exit_code == 0, result.output
    assert report["chat"] is False and report["sampling"] is None
    assert "sampling: skipped" in result.stdout
