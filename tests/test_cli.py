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
