"""`specdeploy triton-repo` copies exactly the files a bundle's manifest lists (never what a
link in its folder points at), writes a repository whole or not at all, never touches what it
did not write; `--check` applies the writer's own rules; the repository records the bundle's
digest, and the model and the check refuse a bundle edited after writing."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from click.testing import CliRunner

import tritonserver
from specdeploy.cli import main
from specdeploy.core.errors import BundleError
from specdeploy.core.manifest import MANIFEST, load_bundle
from specdeploy.runtime import Session
from specdeploy.runtime.serving import triton, triton_io

pytest.importorskip("tritonclient.grpc.model_config_pb2",
                    reason="tritonclient is not installed (pip install 'specdeploy[triton]')")

BUNDLE = "llama-model"


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result, *fragments):
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)


@pytest.fixture
def bundle(bundles, tmp_path):
    """A copy of the bundle of our own, to put links into and to edit."""
    copy = tmp_path / "src" / "bundle"
    shutil.copytree(bundles(BUNDLE), copy)
    return copy


def listed(bundle_dir):
    return {MANIFEST, *load_bundle(bundle_dir, verify=False).manifest.files}


def tree(folder):
    """Every path under `folder` (links not followed), relative to it."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# -- 1. exactly the listed files, each a regular file; whole or not at all ---------------------

def test_links_in_the_bundle_folder_are_not_followed(bundle, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of any bundle")
    (bundle / "notes").symlink_to(secret)  # unlisted, pointing outside
    (bundle / "loop").symlink_to(bundle, target_is_directory=True)  # a folder link pointing at its parent
    (bundle / "scratch").mkdir()  # an unlisted folder
    (bundle / "scratch" / "x.bin").write_bytes(b"x")
    result = cli("triton-repo", bundle, tmp_path / "repo", "--name", "m")
    assert result.exit_code == 0, result.output
    copied = tmp_path / "repo" / "m" / "1" / "bundle"
    assert tree(copied) == sorted(listed(bundle))
    assert all(p.is_file() and not p.is_symlink() for p in copied.iterdir())
    assert tree(tmp_path / "repo") == ["m", "m/1", "m/1/bundle", *[f"m/1/bundle/{n}" for n in tree(copied)],
                                       "m/1/model.py", "m/config.pbtxt"]
    assert cli("triton-repo", "--check", tmp_path / "repo").exit_code == 0


def test_a_listed_file_linking_inside_the_bundle_is_copied_as_a_file(bundle, tmp_path):
    tokenizer = load_bundle(bundle).tokenizer.file
    (bundle / tokenizer).rename(bundle / "kept-tokenizer")
    (bundle / tokenizer).symlink_to("kept-tokenizer")
    assert cli("triton-repo", bundle, tmp_path / "repo", "--name", "m").exit_code == 0
    copied = tmp_path / "repo" / "m" / "1" / "bundle"
    assert (copied / tokenizer).is_file() and not (copied / tokenizer).is_symlink()
    assert not (copied / "kept-tokenizer").exists()  # unlisted
    Session(copied)  # checksums verified


def test_a_listed_file_linking_outside_the_bundle_is_refused(bundle, tmp_path):
    tokenizer = load_bundle(bundle).tokenizer.file
    outside = tmp_path / "elsewhere.json"
    shutil.move(bundle / tokenizer, outside)  # the same bytes: only where it lies is wrong
    (bundle / tokenizer).symlink_to(outside)
    before = tree(tmp_path)
    one_line_error(cli("triton-repo", bundle, tmp_path / "repo", "--name", "m"), str(bundle / tokenizer),
                   "outside the bundle")
    assert tree(tmp_path) == before  # no repository, no staging folder
    with pytest.raises(BundleError, match="outside the bundle"):  # the copy refuses it too
        triton.copy_bundle(triton.Bundle(bundle, load_bundle(bundle, verify=False).manifest), tmp_path / "c")


def test_a_failed_write_leaves_out_as_it_was_and_the_next_run_succeeds(bundle, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "other").mkdir(parents=True)  # another model of the repository
    (repo / "other" / "config.pbtxt").write_text('name: "other"\n')
    before = tree(tmp_path)

    def fails(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:  # after the bundle is copied, before the config is written
        m.setattr(triton, "config_text", fails)
        with pytest.raises(OSError, match="No space left"):
            triton.write_repository(bundle, repo, "m")
    assert tree(tmp_path) == before
    assert cli("triton-repo", bundle, repo, "--name", "m").exit_code == 0
    assert (repo / "other" / "config.pbtxt").read_text() == 'name: "other"\n'
    assert sorted(os.listdir(tmp_path)) == ["repo", "src"]  # nothing left beside OUT


def test_a_new_out_and_its_missing_parents_are_removed_on_failure(bundle, tmp_path, monkeypatch):
    monkeypatch.setattr(triton, "config_text", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        triton.write_repository(bundle, tmp_path / "a" / "b" / "repo", "m")
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_out_that_is_a_file_or_under_one_is_a_one_line_error(bundle, tmp_path):
    (tmp_path / "file").write_text("x")
    one_line_error(cli("triton-repo", bundle, tmp_path / "file"), "is a file, not a folder")
    one_line_error(cli("triton-repo", bundle, tmp_path / "file" / "repo"), f"lies under {tmp_path / 'file'}")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    one_line_error(cli("triton-repo", bundle, tmp_path / "dangling"), "not a folder")
    assert (tmp_path / "file").read_text() == "x" and sorted(os.listdir(tmp_path)) == ["dangling", "file", "src"]


def test_replace_replaces_only_what_specdeploy_wrote(bundle, tmp_path):
    repo = tmp_path / "repo"
    assert cli("triton-repo", bundle, repo, "--name", "m", "--max-queue", 3).exit_code == 0
    one_line_error(cli("triton-repo", bundle, repo, "--name", "m"), "already exists")
    assert cli("triton-repo", bundle, repo, "--name", "m", "--max-queue", 4, "--batch", 0, "--replace").exit_code == 0
    assert "max_queue_size: 4" in (repo / "m" / "config.pbtxt").read_text()
    # a model folder half written by an earlier release (model.py and part of the bundle, no config)
    (repo / "m" / "config.pbtxt").unlink()
    (repo / "m" / "1" / "bundle" / MANIFEST).unlink()
    assert triton.is_written_model(repo / "m")
    assert cli("triton-repo", bundle, repo, "--name", "m", "--replace").exit_code == 0
    assert cli("triton-repo", "--check", repo).exit_code == 0
    # not specdeploy's: left alone, byte for byte
    for setup in ("mine", "extra"):
        target = repo / setup
        if setup == "mine":
            (target / "1").mkdir(parents=True)
            (target / "1" / "model.py").write_text("# my own model\n")
        else:  # specdeploy's folder, with a file someone added
            assert cli("triton-repo", bundle, repo, "--name", setup).exit_code == 0
            (target / "README").write_text("mine")
        before = {p: p.read_bytes() for p in target.rglob("*") if p.is_file()}
        one_line_error(cli("triton-repo", bundle, repo, "--name", setup, "--replace"),
                       "is not a model folder specdeploy wrote")
        assert {p: p.read_bytes() for p in target.rglob("*") if p.is_file()} == before
    (repo / "link").symlink_to(repo / "m", target_is_directory=True)
    one_line_error(cli("triton-repo", bundle, repo, "--name", "link", "--replace"), "not a model folder")
    assert (repo / "link").is_symlink() and (repo / "m" / "config.pbtxt").is_file()


# -- 2. --check applies the writer's rules -------------------------------------------------------

CONFIG_EDITS = [  # (a hand edit of config.pbtxt, what --check says)
    ((re.compile(r"max_queue_size: \d+"), "max_queue_size: 0"), "max_queue_size } } 0 must be >= 1 (Triton reads 0 as an unbounded queue)"),
    ((re.compile(r"max_queue_size: \d+"), "max_queue_size: -2"), "Value out of range: -2"),  # max_queue_size is unsigned
    ((re.compile(r"dynamic_batching \{.*?\n\}\n", re.S), ""), "max_queue_size } } is missing: with no bound"),
    (("count: 1", "count: 0"), "instance_group count 0 is outside [1, 256]"),
    (("count: 1", "count: 300"), "instance_group count 300 is outside [1, 256]"),
    ((re.compile(r"instance_group \[.*?\]\n"), ""), "instance_group count is missing"),
    (('string_value: "ort"', 'string_value: "torch"'), "instance_group kind KIND_CPU with backend 'torch'"),
    (("kind: KIND_CPU", "kind: KIND_GPU"), "instance_group kind KIND_GPU with backend 'ort': ort runs as KIND_CPU"),
    (('"threads" value: { string_value: ""', '"threads" value: { string_value: "0"'), "parameter 'threads' 0 must be >= 1"),
    (('"threads" value: { string_value: ""', '"threads" value: { string_value: "two"'),
     "parameter 'threads' 'two': an integer >= 1"),
    (('string_value: "ort"', 'string_value: "onnx"'), "parameter 'backend' 'onnx': choose from ort, torch, trt"),
]


@pytest.mark.parametrize("edit,expected", CONFIG_EDITS, ids=[e[1][:40] for e in CONFIG_EDITS])
def test_check_reports_what_the_writer_refuses(bundles, tmp_path, edit, expected):
    assert cli("triton-repo", bundles(BUNDLE), tmp_path, "--name", "m").exit_code == 0
    config = tmp_path / "m" / "config.pbtxt"
    old, new = edit
    text = config.read_text()
    edited = old.sub(new, text, count=1) if isinstance(old, re.Pattern) else text.replace(old, new, 1)
    assert edited != text
    config.write_text(edited)
    result = cli("triton-repo", "--check", tmp_path)
    assert result.exit_code == 1, result.output
    assert expected in result.stdout, result.stdout
    assert result.stdout.count(expected) == 1  # said once, though model.py applies the rule too


REFUSED = [  # settings the writer refuses: config.pbtxt written with them anyway
    dict(instances=0), dict(instances=triton_io.MAX_INSTANCES + 1), dict(max_queue=0), dict(max_queue=-1),
    dict(backend="onnx"), dict(threads=0),
]


def in_config_words(message):
    for key, flag in triton_io.FLAGS.items():
        message = message.replace(flag, triton_io.CONFIG_FIELDS[key])
    return message


@pytest.mark.parametrize("refused", REFUSED, ids=[str(r) for r in REFUSED])
def test_whatever_the_writer_refuses_check_reports(bundles, tmp_path, refused):
    settings = dict(instances=1, max_queue=8, backend="ort", threads=None) | refused
    with pytest.raises(triton.InputError) as writer:
        triton.write_repository(bundles(BUNDLE), tmp_path / "refused", "m", **settings)
    assert not (tmp_path / "refused").exists()
    assert cli("triton-repo", bundles(BUNDLE), tmp_path, "--name", "m").exit_code == 0
    config = tmp_path / "m" / "config.pbtxt"  # the refused settings, written anyway
    config.write_text(triton.config_text("m", **settings, bundle_path="bundle",
                                         digest=load_bundle(bundles(BUNDLE)).digest))
    result = cli("triton-repo", "--check", tmp_path)
    assert result.exit_code == 1, result.output
    said = result.stdout.splitlines()
    if "Value out of range" not in result.stdout:  # (a value ModelConfig cannot hold is refused as it is read)
        said = [line.removeprefix(f"{config}: ") for line in said]
        assert in_config_words(str(writer.value)) in said, result.stdout


def test_writer_and_check_share_one_rule_set():
    for refused in REFUSED:
        settings = dict(instances=1, max_queue=8, backend="ort", threads=None) | refused
        flags = triton_io.setting_problems("m", (settings["instances"],), settings["max_queue"], settings["backend"],
                                        settings["threads"])
        fields = triton_io.setting_problems("m", (settings["instances"],), settings["max_queue"], settings["backend"],
                                         "" if settings["threads"] is None else str(settings["threads"]),
                                         triton_io.CONFIG_FIELDS)
        assert len(flags) == len(fields) == 1, (refused, flags, fields)
        assert [in_config_words(m) for m in flags] == fields  # the same rule, named as the config names it
    assert triton_io.setting_problems("m", (1,), 8, "ort", None) == []


# -- 3. the bundle's digest ----------------------------------------------------------------------

def edit_manifest(bundle_dir):
    """A change no file checksum covers (the manifest's own fields): only the digest tells."""
    path = bundle_dir / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["created_by"] = manifest.get("created_by", "") + " (edited)"
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    load_bundle(bundle_dir, verify=True)  # still a bundle that loads, checksums and all


def recorded_digest(model_dir):
    config = triton.parse_config(model_dir / "config.pbtxt")
    return config.metric_tags[triton_io.DIGEST_TAG]


@pytest.mark.parametrize("reference", [False, True], ids=["copied", "reference"])
def test_the_repository_records_the_bundle_digest_and_check_verifies_it(bundle, tmp_path, reference):
    digest = load_bundle(bundle).digest
    inspected = cli("inspect", bundle)
    assert inspected.exit_code == 0 and digest in inspected.output
    result = cli("triton-repo", bundle, tmp_path / "repo", "--name", "m", *(["--reference"] if reference else []))
    assert result.exit_code == 0, result.output
    model = tmp_path / "repo" / "m"
    assert recorded_digest(model) == digest
    check = cli("triton-repo", "--check", tmp_path / "repo")
    assert check.exit_code == 0 and digest in check.stdout, check.output
    served = bundle if reference else model / "1" / "bundle"
    edit_manifest(served)
    check = cli("triton-repo", "--check", tmp_path / "repo")
    assert check.exit_code == 1
    assert f"bundle digest {load_bundle(served).digest} is not the {digest} required" in check.stdout, check.stdout
    # model.py's load: the settings Triton hands it, then its Session
    config = {"parameters": {k: {"string_value": v.string_value}
                             for k, v in triton.parse_config(model / "config.pbtxt").parameters.items()},
              "metric_tags": {triton_io.DIGEST_TAG: recorded_digest(model)}}
    settings = triton_io.ModelSettings.from_model_config(config, model / "1")
    assert settings.digest == digest
    with pytest.raises(BundleError, match=re.escape(f"bundle digest {load_bundle(served).digest} is not the")) as e:
        Session(settings.bundle, digest=settings.digest)
    assert len(str(e.value).splitlines()) == 1


def test_a_config_without_a_digest_is_refused(bundles, tmp_path):
    assert cli("triton-repo", bundles(BUNDLE), tmp_path, "--name", "m").exit_code == 0
    config = tmp_path / "m" / "config.pbtxt"
    config.write_text(re.sub(r"metric_tags \[.*\]\n", "", config.read_text()))
    result = cli("triton-repo", "--check", tmp_path)
    assert result.exit_code == 1 and 'metric_tags "bundle_digest" \'\' is not a bundle digest' in result.stdout
    with pytest.raises(triton.InputError, match="write the repository again"):
        triton_io.ModelSettings.from_parameters({"bundle": "bundle"}, tmp_path / "m" / "1")


def test_triton_refuses_to_load_a_bundle_edited_in_the_repository(bundle, tmp_path):
    reason = tritonserver.unavailable()
    if reason:
        pytest.skip(reason)
    model = triton.write_repository(bundle, tmp_path / "repo", "spec", threads=1)
    edit_manifest(model / "1" / "bundle")
    server = tritonserver.TritonServer(tmp_path / "repo", tmp_path)
    with pytest.raises(RuntimeError, match="did not become ready"):
        server.start(within=60)
    log = server.log.read_text(errors="replace")
    lines = [line for line in log.splitlines() if "bundle digest" in line]
    assert lines and f"is not the {load_bundle(bundle).digest} required" in lines[0], server.log_tail()
