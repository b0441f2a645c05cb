"""The manifest is bounded and consistent: every field a tampered or careless bundle could set
to make the runtime loop, allocate or guess is a one-line error naming it, read before any
file is hashed or any graph is loaded."""
import os
import shutil

import pytest
from click.testing import CliRunner

from specdeploy.cli import main

from test_bundle_hardening import edit_manifest as edit
from test_errors import assert_one_line_error


def generate(path):
    return CliRunner().invoke(main, ["generate", str(path), "--prompt", "hi", "--max-new-tokens", "2"])


@pytest.mark.parametrize("bundle, change, fragment", [
    ("llama-ngram", lambda m: m["draft"].__setitem__("max_ngram", 10**9), "field 'max_ngram' is 1000000000, outside [1, 64]"),
    ("llama-ngram", lambda m: m["draft"].update(min_ngram=5, max_ngram=3), "min_ngram 5 is above max_ngram 3"),
    ("llama-ngram", lambda m: m["tokenizer"].__setitem__("eos_token_ids", list(range(10**6))), "holds 1000000 ids, at most 64"),
    ("llama-ngram", lambda m: m["tokenizer"].__setitem__("eos_token_ids", [10**6]), "eos_token_ids 1000000 is outside the vocabulary"),
    ("llama-self", lambda m: m["models"].pop("draft"), "draft kind 'self' but models has no 'draft' entry"),
    ("llama-model", lambda m: m["models"].pop("draft"), "draft kind 'model' but models has no 'draft' entry"),
    ("llama-ngram", lambda m: m["models"].__setitem__("draft", m["models"]["target"]), "draft kind 'ngram' but models has 'draft' entry"),
    ("llama-self", lambda m: m["draft"].__setitem__("layers", 99), "draft layers 99 is above the target's 3"),
    ("mistral-model", lambda m: m["models"]["target"].__setitem__("sliding_window", 10**6), "sliding_window 1000000, outside [1, 128]"),
    ("llama-ngram", lambda m: m["models"]["target"].__setitem__("kv_layout", [[2, 16]] * 4),
     "field 'kv_layout' has 4 entries; expected 1..3 (num_layers)"),
    ("llama-ngram", lambda m: m["models"]["target"].__setitem__("kv_layout", [[2, 16], "x", [2, 16]]),
     "field 'kv_layout'[1] is 'x'; expected [num_kv_heads, head_dim]"),
    ("llama-ngram", lambda m: m["models"]["target"].__setitem__("kv_layout", [[2, 16], [2, 10**6], [2, 16]]),
     "field 'head_dim' is 1000000, outside [1, 4096]"),
])
def test_fields_out_of_bounds_or_contradicting_each_other(copy_of, bundle, change, fragment):
    path = copy_of(bundle)
    edit(path, change)
    assert_one_line_error(generate(path), fragment)


@pytest.mark.parametrize("text, fragment", [
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
    ('{"max_seq": ' + "9" * 5000 + "}", "not valid JSON"),
])
def test_a_manifest_json_cannot_crash_the_parser(copy_of, text, fragment):
    path = copy_of("llama-ngram")
    (path / "manifest.json").write_text(text)
    assert_one_line_error(generate(path), fragment)


def test_a_manifest_that_is_a_link_is_refused(copy_of, tmp_path):
    path = copy_of("llama-ngram")
    real = tmp_path / "elsewhere.json"
    shutil.move(path / "manifest.json", real)
    os.symlink(real, path / "manifest.json")
    assert_one_line_error(generate(path), "is a symbolic link")


@pytest.mark.parametrize("bundle, change, fragment", [
    ("llama-ngram", lambda m: m["models"]["target"].__setitem__("attention", "fused"),
     "the graph's attention is 'exact', the manifest says 'fused'"),
    ("llama-ngram", lambda m: m["models"]["target"].__setitem__("sliding_window", 40),
     "the graph's sliding_window is None, the manifest says 40"),
    ("mistral-model", lambda m: m["models"]["target"].__setitem__("sliding_window", None),
     "the graph's sliding_window is 40, the manifest says None"),
    ("llama-ngram", lambda m: m["models"]["target"].__setitem__("dtype", "fp16"),
     "the graph's dtype is 'fp32', the manifest says 'fp16'"),
    ("llama-ngram", lambda m: m["models"]["target"].__setitem__("kv_layout", [[2, 16], [2, 32], [2, 16]]),
     "past_key_1 is ['B', 2, 128, 16] in the graph but the manifest's num_kv_heads, max_seq, head_dim make it ['?', 2, 128, 32]"),
    ("llama-int8-ngram", lambda m: m["models"]["target"].__setitem__("kv_layout", [[2, 16], [2, 32], [2, 16]]),
     "past_key_1 is ['B', 2, 'L', 16] in the graph but the manifest's num_kv_heads, head_dim make it ['?', 2, 'L', 32]"),
])
def test_settings_that_contradict_the_graph_are_refused_when_it_loads(copy_of, bundle, change, fragment):
    path = copy_of(bundle)
    edit(path, change)
    assert_one_line_error(generate(path), "target.onnx: " + fragment)
