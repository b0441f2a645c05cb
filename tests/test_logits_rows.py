"""Logit rows (format version 2): a pass asks for every row's logits or only its last, and
the head computes only what was asked; a format 1 bundle (every row, no such input) still runs."""
import json
import shutil

import numpy as np
import onnx

from tiny import PROMPTS

from specdeploy.cli.demo import _bundle_ready
from specdeploy.core.graph_io import LOGITS_ROWS
from specdeploy.core.manifest import load_bundle, sha256_file
from specdeploy.export.trt_build import every_row
from specdeploy.runtime import Session
from specdeploy.runtime.backends.ort import OrtEngine
from specdeploy.runtime.tools.report import describe


def _engine(bundle_dir, role="target"):
    bundle = load_bundle(bundle_dir)
    return OrtEngine.from_bundle(bundle, bundle.model(role), device="cpu")


def test_the_last_row_alone_is_the_last_row_and_writes_the_same_kv(bundles):
    """A pass that asks for its last row returns one row, that row's logits, and writes the
    very K/V the pass asking for every row writes (the head is all that is left out)."""
    path = bundles("llama-model")
    assert load_bundle(path).model("target").logits_rows
    every, last = _engine(path), _engine(path)
    ids = np.random.default_rng(3).integers(0, every.vocab_size, 40)
    for start, t in [(0, 16), (16, 16), (32, 5), (37, 1)]:
        full = every.forward(ids[start : start + t], start).copy()
        one = last.forward(ids[start : start + t], start, last=True).copy()
        assert full.shape == (t, every.vocab_size) and one.shape == (1, every.vocab_size)
        np.testing.assert_allclose(one[0], full[-1], rtol=1e-5, atol=1e-5 * np.abs(full).max())
        assert all(np.array_equal(a, b) for a, b in zip(every.kv_arrays, last.kv_arrays))
    again = every.forward(ids[:9], 0)  # the T = 9 binding of every row is not the one of the last
    assert again.shape == (9, every.vocab_size)


def _as_format_1(src, dst):
    """A copy of `src` as format 1 wrote it: graphs without logits_rows, a version 1 manifest."""
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["format_version"] = 1
    manifest.pop("sizes")  # format 1 recorded checksums only
    for entry in manifest["models"].values():
        graph = dst / entry["graph"]
        onnx.save(every_row(onnx.load(str(graph))), str(graph))
        manifest["files"][entry["graph"]] = sha256_file(graph)
        del entry["inputs"][LOGITS_ROWS]
        entry["outputs"]["logits"][1] = "T"
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_a_format_1_bundle_runs_every_row_and_decodes_the_same(bundles, tmp_path):
    """The graph a TensorRT plan is built from (every_row: no logits_rows) is a format 1
    graph: it loads, returns every row whether or not the last alone is asked for, with the
    logits of the format 2 graph asked for every row, and a session over it decodes what the
    format 2 bundle decodes."""
    new = bundles("llama-model")
    old = _as_format_1(new, tmp_path / "v1")
    inputs = {i.name for i in onnx.load(str(old / "target.onnx"), load_external_data=False).graph.input}
    assert LOGITS_ROWS not in inputs
    v1, v2 = _engine(old), _engine(new)
    assert not v1.spec.logits_rows
    ids = np.random.default_rng(4).integers(0, v1.vocab_size, 24)
    np.testing.assert_array_equal(v1.forward(ids[:16], 0, last=True), v2.forward(ids[:16], 0))
    np.testing.assert_array_equal(v1.forward(ids[16:], 16), v2.forward(ids[16:], 16))
    for prompt in PROMPTS[:3]:
        want = Session(new).generate(prompt, max_new_tokens=12, draft_len=3)
        got = Session(old).generate(prompt, max_new_tokens=12, draft_len=3)
        assert got.token_ids == want.token_ids
    assert "format      specdeploy-bundle v1," in describe(load_bundle(old))
    assert "format      specdeploy-bundle v2," in describe(load_bundle(new))
    assert _bundle_ready(new, "model", "fp32") and not _bundle_ready(old, "model", "fp32")  # the demo exports anew
