"""The CLI contract other tools drive: spellings and JSON fields."""
import json

from click.testing import CliRunner

from specdeploy.cli import main


def test_generate_json(bundles):
    result = CliRunner().invoke(main, ["generate", str(bundles("llama-ngram")), "--prompt", "The quick", "--max-new-tokens", "30", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) == {"text", "token_ids", "stats"}
    for key in ("new_tokens", "target_passes", "acceptance_rate", "mean_accepted", "seconds", "tokens_per_second"):
        assert key in out["stats"]
    assert out["stats"]["new_tokens"] == len(out["token_ids"])


def test_generate_chat_and_no_speculate_agree(bundles):
    args = ["generate", str(bundles("llama-model")), "--prompt", "hello", "--chat", "--max-new-tokens", "20", "--json"]
    spec = json.loads(CliRunner().invoke(main, args + ["--draft-len", "3"]).stdout)
    plain = json.loads(CliRunner().invoke(main, args + ["--no-speculate"]).stdout)
    assert spec["token_ids"] == plain["token_ids"]
    assert plain["stats"]["draft_passes"] == 0


def test_generate_streams_text(bundles):
    result = CliRunner().invoke(main, ["generate", str(bundles("llama-self")), "--prompt", "The", "--max-new-tokens", "8"])
    assert result.exit_code == 0
    assert "tok/s" in result.stderr


def test_inspect(bundles):
    result = CliRunner().invoke(main, ["inspect", str(bundles("llama-self"))])
    assert result.exit_code == 0, result.output
    assert "self: the target's first 1 layers" in result.stdout
    assert "written in place" in result.stdout


def test_export_cli(models, tmp_path):
    out = tmp_path / "b"
    result = CliRunner().invoke(
        main, ["export", "--target", str(models["qwen2"]), "--draft", "ngram", "--out", str(out), "--max-seq", "64"]
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["draft"]["kind"] == "ngram"
    assert set(manifest["files"]) == {"target.onnx", "tokenizer.json"}
    assert manifest["models"]["target"]["architecture"] == "qwen2"


def test_export_draft_suffix_and_generate_tree_nodes(models, tmp_path):
    out = tmp_path / "suffix"
    result = CliRunner().invoke(main, ["export", "--target", str(models["llama"]), "--draft", "suffix", "--out", str(out),
                                       "--max-seq", "64", "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    assert "draft       suffix: suffix lookup" in CliRunner().invoke(main, ["inspect", str(out)]).stdout
    args = ["generate", str(out), "--prompt", "def add(a, b): return a + b. def add(a, b):", "--max-new-tokens", "16",
            "--json"]
    runs = {n: json.loads(CliRunner().invoke(main, args + ["--tree-nodes", n]).stdout) for n in ("auto", "4", "1")}
    assert len({tuple(r["token_ids"]) for r in runs.values()}) == 1
    assert runs["4"]["stats"]["tree_rounds"] == runs["4"]["stats"]["target_passes"]
    assert set(runs["4"]["stats"]["tree_size_histogram"]) <= {"0", "1", "2", "3", "4"}
    assert runs["1"]["stats"]["tree_rounds"] == 0  # chains
    bad = CliRunner().invoke(main, args + ["--tree-nodes", "99"])
    assert bad.exit_code == 1 and "tree nodes 99 is outside [1, 32]" in bad.output
