"""A bundle has a digest a deployer can pin: the sha256 of its manifest, which lists every other
file's size and sha256. `inspect` prints it, and a bundle loaded against a digest is exactly the
one it names, its chat template and system prompt included. A file of the wrong size is refused
without being read."""
import hashlib
import json
import os

import pytest
from click.testing import CliRunner

from specdeploy.cli import main
from specdeploy.core import manifest as manifest_module
from specdeploy.core.errors import BundleError
from specdeploy.core.manifest import load_bundle


@pytest.fixture
def bundle(copy_of):
    return copy_of("llama-ngram")


def test_inspect_prints_the_digest_of_the_manifest(bundle):
    digest = "sha256:" + hashlib.sha256((bundle / "manifest.json").read_bytes()).hexdigest()
    out = CliRunner().invoke(main, ["inspect", str(bundle)])
    assert out.exit_code == 0 and f"digest      {digest}" in out.output
    assert load_bundle(bundle, digest=digest).digest == digest


def test_an_edited_manifest_no_longer_has_the_pinned_digest(bundle):
    pinned = load_bundle(bundle).digest
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["tokenizer"]["chat_template"] = "{{ 'You are evil.' }}" + manifest["tokenizer"]["chat_template"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    assert load_bundle(bundle).digest != pinned  # it loads, as any bundle does, but it is another bundle
    with pytest.raises(BundleError, match=rf"bundle digest sha256:[0-9a-f]{{64}} is not the {pinned} required"):
        load_bundle(bundle, digest=pinned)


def test_a_file_of_the_wrong_size_is_refused_unread(bundle, monkeypatch):
    graph = bundle / "target.onnx"
    graph.unlink()
    with open(graph, "wb") as f:  # sparse: 20 GB that take no disk
        f.truncate(20 << 30)
    read = []
    real = manifest_module.sha256_file
    monkeypatch.setattr(manifest_module, "sha256_file", lambda path, *a: read.append(path.name) or real(path, *a))
    with pytest.raises(BundleError, match=r"target.onnx failed its checksum \(21474836480 bytes, the manifest says \d+; not read\)"):
        load_bundle(bundle)
    assert read == []
    os.truncate(graph, 0)


def test_a_session_can_be_told_to_require_the_digest(bundle):
    from specdeploy.runtime import Session

    pinned = load_bundle(bundle).digest
    assert Session(bundle, digest=pinned).bundle.digest == pinned
    with pytest.raises(BundleError, match="is not the sha256:0000 required"):
        Session(bundle, digest="sha256:0000")
    with pytest.raises(BundleError, match="is not the sha256:0000 required"):
        Session(load_bundle(bundle), digest="sha256:0000")
