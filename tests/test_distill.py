"""`specdeploy distill` on a tiny target: it trains, it helps, it resumes, it says how it was made."""
import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file

from specdeploy.cli import main
from specdeploy.runtime.decoding.session import Session

from conftest import MAX_SEQ, PREFILL_CHUNK

PROMPTS = [line for line in (Path(__file__).parents[1] / "benchmarks" / "prompts_varied.txt").read_text().splitlines()
           if line.strip()][:8]  # held out: distill never sees these prompts


def settings(**overrides):
    from specdeploy.export.distill import DistillSettings

    base = dict(layers=1, draft_vocab=160, tokens=3000, steps=60, batch=8, max_new_tokens=24)
    return DistillSettings(**{**base, **overrides})


@pytest.fixture(scope="module")
def drafts(models, tmp_path_factory):
    """A distilled draft of the tiny llama, and one of the same shape that never trained."""
    from specdeploy.export.distill import distill

    root = tmp_path_factory.mktemp("distilled")
    made = {}
    for name, steps in (("distilled", 60), ("untrained", 0)):
        distill(models["llama"], root / name, settings(steps=steps), progress=False)
        made[name] = root / name
    return made


@pytest.fixture(scope="module")
def draft_bundles(models, drafts, shared, tmp_path_factory):
    from specdeploy.export import build_bundle

    root = tmp_path_factory.mktemp("distilled_bundles")
    for name, draft in drafts.items():
        build_bundle(models["llama"], str(draft), root / name, max_seq=MAX_SEQ, max_draft=8, prefill_chunk=PREFILL_CHUNK,
                     cache=shared / "graphs")  # the target's graph as the shared bundles' (test_graph_cache.py)
    return {name: root / name for name in drafts}


def acceptance(bundle: Path, backend: str = "ort", draft_len: int = 1):
    session = Session(bundle, backend=backend)
    accepted = proposed = 0
    outputs = []
    for prompt in PROMPTS:
        spec = session.generate(prompt, max_new_tokens=40, draft_len=draft_len)
        plain = session.generate(prompt, max_new_tokens=40, speculate=False)
        assert spec.token_ids == plain.token_ids, prompt  # lossless, token for token
        accepted += spec.stats.accepted
        proposed += spec.stats.drafted
        outputs.append(spec.token_ids)
    return accepted / proposed, outputs


def test_a_distilled_draft_is_accepted_more_than_an_untrained_one_of_the_same_shape(draft_bundles):
    trained, _ = acceptance(draft_bundles["distilled"])
    untrained, _ = acceptance(draft_bundles["untrained"])
    assert trained > untrained + 0.1, (trained, untrained)


def test_the_record_says_how_the_draft_was_made(drafts, draft_bundles):
    record = json.loads((drafts["distilled"] / "distill.json").read_text())
    assert record["kind"] == "distilled" and record["layers"] == 1 and record["draft_vocab"] == 160
    assert len(record["vocab"]) == 160 and record["vocab"] == sorted(set(record["vocab"]))
    assert 2 in record["vocab"]  # the tiny tokenizer's EOS: a draft must be able to end a text
    assert record["settings"]["steps"] == 60 and record["data"]["answer_tokens"] >= 3000
    agreement = record["held_out_agreement"]
    assert agreement["distilled"] > agreement["untrained"]
    manifest = json.loads((draft_bundles["distilled"] / "manifest.json").read_text())
    distilled = manifest["draft"]["distilled"]
    assert distilled["settings"] == record["settings"] and "vocab" not in distilled
    assert manifest["models"]["draft"]["head_vocab"] == 160
    # the draft graph was checked against the student itself (its head rows), not only eager
    assert manifest["models"]["draft"]["parity"]["max_rel_diff_eager_vs_source"] < 1e-4


def test_tokens_outside_the_draft_vocabulary_are_never_drafted(drafts, draft_bundles):
    vocab = json.loads((drafts["distilled"] / "distill.json").read_text())["vocab"]
    logits = Session(draft_bundles["distilled"]).drafter.engine.forward(np.arange(3, 40), 0)
    outside = np.setdiff1d(np.arange(logits.shape[-1]), vocab)
    assert np.isneginf(logits[:, outside]).all() and np.isfinite(logits[:, vocab]).all()


def test_the_torch_backend_runs_a_distilled_draft_too(draft_bundles):
    rate_ort, ort = acceptance(draft_bundles["distilled"])
    rate_torch, torch_out = acceptance(draft_bundles["distilled"], backend="torch")
    assert torch_out == ort


def test_an_interrupted_distill_resumes_to_the_same_weights(models, drafts, tmp_path):
    from specdeploy.export.distill import distill

    out = tmp_path / "draft"
    with pytest.raises(KeyboardInterrupt):
        distill(models["llama"], out, settings(), progress=False, stop_after=30)  # last checkpoint: step 25
    assert (tmp_path / "draft.work" / "checkpoint.pt").is_file() and not out.exists()
    record = distill(models["llama"], out, settings(), progress=False)
    assert not (tmp_path / "draft.work").exists()
    resumed, straight = load_file(out / "model.safetensors"), load_file(drafts["distilled"] / "model.safetensors")
    assert resumed.keys() == straight.keys()
    for name in straight:
        np.testing.assert_array_equal(resumed[name], straight[name], err_msg=name)
    assert record["vocab"] == json.loads((drafts["distilled"] / "distill.json").read_text())["vocab"]


def test_resuming_with_other_settings_is_a_one_line_error(models, tmp_path):
    from specdeploy.export.distill import distill

    with pytest.raises(KeyboardInterrupt):
        distill(models["llama"], tmp_path / "d", settings(), progress=False, stop_after=0)
    same = ["--draft-vocab", "160", "--tokens", "3000", "--steps", "60", "--max-new-tokens", "24"]
    result = CliRunner().invoke(main, [
        "distill", "--target", str(models["llama"]), "--out", str(tmp_path / "d"), "--layers", "2", *same, "--no-progress",
    ])
    assert result.exit_code == 1
    assert re.fullmatch(r"error: .*d\.work: holds an interrupted run with other settings .*\n", result.output)


@pytest.mark.parametrize("flag, value, allowed", [
    ("--layers", "3", "1..2"), ("--layers", "0", "1..2"), ("--draft-vocab", "999", "1..320"), ("--tokens", "0", "1.."),
])
def test_out_of_range_settings_are_one_line_errors(models, tmp_path, flag, value, allowed):
    vocab = [] if flag == "--draft-vocab" else ["--draft-vocab", "160"]  # the default exceeds the tiny vocabulary
    result = CliRunner().invoke(main, [
        "distill", "--target", str(models["llama"]), "--out", str(tmp_path / "d"), *vocab, flag, value, "--no-progress",
    ])
    assert result.exit_code == 1
    assert result.output.startswith(f"error: {flag} {value}: expected {allowed}") and result.output.count("\n") == 1
    assert not (tmp_path / "d").exists()


def test_the_cli_help_states_the_real_defaults():
    from specdeploy.export.distill import DistillSettings
    from specdeploy.export.distill_eagle3 import HeadSettings

    text = CliRunner().invoke(main, ["distill", "--help"], terminal_width=400).output
    for field in ("layers", "draft_vocab", "tokens", "steps", "batch", "lr", "temperature", "max_new_tokens", "seed", "ttt"):
        flag = "--" + field.replace("_", "-")
        shown = re.search(re.escape(flag) + r" [A-Z]+ .*?\[default: ([^\]]+)\]", text)
        assert shown, flag
        model, _, eagle3 = shown.group(1).partition("; eagle3 ")  # "--kind eagle3" defaults, where they differ
        if field == "ttt":
            assert float(model) == HeadSettings().ttt and not eagle3
            continue
        assert float(model) == getattr(DistillSettings(), field), flag
        if field != "layers":
            assert float(eagle3 or model) == getattr(HeadSettings(), field), flag
