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


def test_every_request_setting_is_a_generate_option():
    """`generate`'s request options are made from the request schema: every setting a server or
    Triton takes is an option, named as the library names it."""
    from specdeploy.runtime.decoding.request import SETTINGS

    names = {p.name for p in main.commands["generate"].params}
    assert set(SETTINGS) <= names
    assert main.commands["generate"].params  # (the comparison above is not vacuous)
    assert {"--min-p", "--repetition-penalty", "--structure", "--logprobs", "--no-speculate", "--private"} <= {
        opt for p in main.commands["generate"].params for opt in p.opts}


def test_generate_passes_the_schemas_settings_to_the_session(bundles, monkeypatch):
    """What the options say reaches the session: a choice structure, log probabilities with --json,
    and seeded sampling with min-p and penalties giving what Session gives for the same request."""
    from specdeploy.runtime import Session

    from test_cli_bounds import one_line

    bundle = str(bundles("llama-ngram"))
    run = lambda *extra: CliRunner().invoke(main, ["generate", bundle, "--prompt", "The quick", *extra])  # noqa: E731
    result = run("--structure", '{"choice": ["yes", "no"]}', "--max-new-tokens", "20", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["text"] in ("yes", "no")
    out = json.loads(run("--max-new-tokens", "6", "--logprobs", "2", "--json").stdout)
    assert len(out["logprobs"]) == len(out["token_ids"]) == 6
    assert [lp["token"] for lp in out["logprobs"]] == out["token_ids"] and all(len(lp["top"]) == 2 for lp in out["logprobs"])
    sampled = dict(max_new_tokens=12, temperature=1.0, seed=5, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5)
    args = [x for k, v in sampled.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    got = json.loads(run(*args, "--json").stdout)["token_ids"]
    assert got == Session(bundle).generate("The quick", **sampled).token_ids
    seen = {}
    stream = Session.stream
    monkeypatch.setattr(Session, "stream", lambda self, prompt, **kw: (seen.update(kw), stream(self, prompt, **kw))[1])
    run(*args, "--json")
    assert seen == dict(sampled, chat=False)  # each option arrives as the library's keyword
    one_line(run("--logprobs", "2"), "--logprobs", "--json")
    one_line(run("--tools", "[{not json"), "--tools: not JSON")
