"""Every user mistake gets one clear line on stderr and exit code 1, never a traceback."""
import json
import shutil

import pytest
from click.testing import CliRunner

import tiny
from specdeploy.cli import main


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    # export may log progress before failing; the error itself is one line, the last
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.fixture
def bundle_copy(bundles, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(bundles("llama-self"), dst)
    return dst


def test_prompt_longer_than_max_sequence(bundles):
    ids = ",".join(["5"] * 200)
    assert_one_line_error(
        run("generate", bundles("llama-self"), "--prompt-ids", ids),
        "prompt of 200 tokens is longer than the bundle's max sequence of 128",
    )


def test_prompt_plus_new_tokens_past_max_sequence(bundles):
    ids = ",".join(["5"] * 100)
    assert_one_line_error(
        run("generate", bundles("llama-self"), "--prompt-ids", ids, "--max-new-tokens", 50),
        "100 tokens + 50 new tokens exceeds the bundle's max sequence of 128", "at most 28 new tokens fit",
    )


def test_token_id_outside_vocabulary(bundles):
    assert_one_line_error(
        run("generate", bundles("llama-self"), "--prompt-ids", "1,2,999"),
        "token id 999 at prompt position 2 is outside the vocabulary [0, 320)",
    )
    assert_one_line_error(run("generate", bundles("llama-self"), "--prompt-ids", "1,-3"), "token id -3")


def test_engine_boundary_names_tensor_and_range(bundles):
    from specdeploy.runtime import InputError, Session

    session = Session(bundles("llama-self"))
    with pytest.raises(InputError, match=r"target \(target.onnx\): positions 120..129 are outside the KV buffer \[0, 128\)"):
        session.target.forward([1] * 10, 120)
    with pytest.raises(InputError, match=r"token id 320 at input position 1 is outside the vocabulary \[0, 320\)"):
        session.target.forward([1, 320], 0)
    for one in (320, -1):  # a single step has a path of its own
        with pytest.raises(InputError, match=rf"token id {one} at input position 0 is outside the vocabulary"):
            session.target.forward([one], 5)
    with pytest.raises(InputError, match=r"token id -2 at input position 2"):
        session.target.forward([0, 319, -2], 0)


def test_non_finite_check_reads_the_argmaxes_as_the_row_maxima():
    """check_finite given the rows' argmaxes (greedy) refuses exactly the rows the full
    maximum refuses: NaN anywhere, +inf, a row that is all -inf."""
    import numpy as np

    from specdeploy.core.errors import BundleError
    from specdeploy.runtime.decoding.loop import check_finite

    class Target:
        name = "target"

    nan, inf = np.nan, np.inf
    rows = [[0.5, 2.0, 1.0], [nan, 2.0, 1.0], [0.5, 2.0, nan], [inf, 2.0, 1.0], [0.5, inf, nan],
            [-inf, -inf, -inf], [-inf, -inf, 3.0], [2.0, 2.0, -inf]]
    for row in rows:
        logits = np.array([[0.0, 1.0, 0.0], row], dtype=np.float32)
        verdicts = []
        for argmax in (None, logits.argmax(axis=-1)):
            try:
                check_finite(Target(), logits, 7, argmax)
                verdicts.append("ok")
            except BundleError as e:
                verdicts.append(str(e))
        assert verdicts[0] == verdicts[1], (row, verdicts)
        assert (verdicts[0] == "ok") == bool(np.isfinite(max(row)) and not np.isnan(row).any()), (row, verdicts)


def test_missing_bundle_file(bundle_copy):
    (bundle_copy / "draft.onnx").unlink()
    assert_one_line_error(run("generate", bundle_copy, "--prompt", "hi"), "draft.onnx is missing")


def test_altered_bundle_file(bundle_copy):
    with open(bundle_copy / "tokenizer.json", "a") as f:
        f.write(" ")
    assert_one_line_error(run("inspect", bundle_copy), "tokenizer.json failed its checksum")


def test_unknown_format_version(bundle_copy):
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    manifest["format_version"] = 99
    (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line_error(run("generate", bundle_copy, "--prompt", "hi"), "format version 99 is not supported")


def test_not_a_bundle(tmp_path):
    assert_one_line_error(run("inspect", tmp_path), "manifest.json: missing")
    assert_one_line_error(run("inspect", tmp_path / "nope"), "no such bundle folder")


def test_draft_with_a_different_tokenizer(models, tmp_path):
    other = tmp_path / "other"
    tiny.make_model(other, "llama", seed=5, layers=1)
    corpus = ["completely different words for a different vocabulary " * 4, "zebra yak xylophone"]
    tiny.make_tokenizer(other, vocab_size=320, corpus=corpus)
    out = tmp_path / "out"
    assert_one_line_error(
        run("export", "--target", models["llama"], "--draft", other, "--out", out), "different tokenizers"
    )
    assert not out.exists()  # nothing half-written


def test_bad_draft_spec_and_source(models, tmp_path):
    assert_one_line_error(
        run("export", "--target", models["llama"], "--draft", "self:layers=3", "--out", tmp_path / "o"),
        "the target has 3 layers; choose 1..2",
    )
    assert_one_line_error(
        run("export", "--target", models["llama"], "--draft", "self:layers=x", "--out", tmp_path / "o"),
        "expected self:layers=N",
    )
    assert_one_line_error(run("export", "--target", tmp_path / "missing", "--out", tmp_path / "o"), "no such model folder")


def test_draft_len_past_bundle_max(bundles):
    assert_one_line_error(
        run("generate", bundles("llama-self"), "--prompt", "hi", "--draft-len", 9), "draft length 9 is outside [0, 8]"
    )


def test_a_failed_write_keeps_the_old_folder_and_leaves_nothing_behind(tmp_path):
    from specdeploy.export.build import atomic_folder

    out = tmp_path / "bundle"
    out.mkdir()
    (out / "old").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_folder(out) as work:
            (work / "new").write_text("2")
            raise RuntimeError("export failed half way")
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"] and (out / "old").read_text() == "1"
    with atomic_folder(out) as work:
        (work / "new").write_text("2")
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"] and [p.name for p in out.iterdir()] == ["new"]
