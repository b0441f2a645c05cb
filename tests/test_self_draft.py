"""The quantized self-draft (`--draft self:dtype=int8|int4`, with or without `layers=N`): the
target at a lower precision drafts for itself. Lossless like every draft: greedy output
equals plain decoding and Hugging Face `generate`, token for token."""
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from specdeploy.cli import main
from specdeploy.runtime import Session
from test_errors import assert_one_line_error, run
from test_lossless import hf_greedy
from tiny import PROMPTS

NEW_TOKENS = 40


@pytest.mark.parametrize("name, dtype, layers", [("llama-self-int8", "int8", None), ("llama-self-int4", "int4", 1)])
def test_quantized_self_draft_is_lossless(bundles, models, name, dtype, layers):
    path = bundles(name)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["draft"] == {"kind": "self", "dtype": dtype, **({"layers": layers} if layers else {})}
    draft, target = manifest["models"]["draft"], manifest["models"]["target"]
    assert (draft["dtype"], target["dtype"]) == (dtype, "fp32")
    assert draft["num_layers"] == (layers or target["num_layers"]) and draft["quantization"]["scheme"]
    session = Session(path)
    hf = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32).eval()
    accepted = drafted = 0
    for prompt in PROMPTS[:10]:
        ids = session.encode(prompt)
        plain = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False)
        with torch.no_grad():
            assert plain.token_ids == hf_greedy(hf, ids, session.eos_token_ids), prompt
        for k in (1, 3, 8, "auto"):
            spec = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert spec.token_ids == plain.token_ids, (prompt, k)
            accepted, drafted = accepted + spec.stats.accepted, drafted + spec.stats.drafted
    assert drafted > 0 and accepted > 0
    if layers is None:  # every layer at int8: it agrees with its float self nearly always
        assert accepted / drafted > 0.8, accepted / drafted


def test_inspect_shows_the_quantized_self_draft(bundles):
    out = CliRunner().invoke(main, ["inspect", str(bundles("llama-self-int8"))])
    assert out.exit_code == 0, out.output
    assert "draft       self: the target itself, at int8" in out.output


@pytest.mark.parametrize("spec", ["self:dtype=int3", "self:layers=0", "self:", "self:dtype=int4,dtype=int8",
                                  "self:width=2", "self:layers=1,dtype="])
def test_bad_self_specs_are_one_line_errors(models, tmp_path, spec):
    assert_one_line_error(run("export", "--target", models["llama"], "--draft", spec, "--out", tmp_path / "o"),
                          f"--draft {spec!r}: expected self:layers=N")


def test_the_demo_times_alternating_runs_and_compares_every_output(bundles):
    """`specdeploy demo` over an existing bundle (no export): the streamed answer, then plain and
    speculative runs alternating, medians and per-pair ratios, every output compared."""
    path = bundles("llama-self-int8")
    out = CliRunner().invoke(main, ["demo", "--out", str(path), "--draft", "self:dtype=int8", "--dtype", "fp32",
                                    "--max-new-tokens", "12", "--repeats", "2", "--prompt", PROMPTS[3]])
    assert out.exit_code == 0, out.output
    assert "exporting" not in out.output  # the bundle matched the spelling: reused
    assert "identical    yes: token for token, every run" in out.output
    assert "median of 2 alternating pairs" in out.output and "decoding" in out.output
