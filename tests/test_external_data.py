"""Graphs whose weights pass protobuf's 2 GiB (a 1B model in fp32, Gemma 4 E2B's 262k-row table):
their weights written beside the graph in `<graph>.data`, listed and checksummed as any bundle
file, read by ONNX Runtime, reused by the graph cache. The tests lower the threshold, so tiny
graphs take the same path; the tokens are those of the same graphs kept in one file."""
from __future__ import annotations

import json

import pytest

from specdeploy.core.errors import BundleError
from specdeploy.core.manifest import graph_bytes, load_bundle
from specdeploy.export import build_bundle, onnx_export
from specdeploy.runtime import Session
from tiny import PROMPTS

pytestmark = pytest.mark.bundle


@pytest.fixture(scope="module")
def pair(models, tmp_path_factory):
    """The same target and model draft exported twice: graphs in one file, and weights beside them."""
    root = tmp_path_factory.mktemp("external")
    kw = dict(max_seq=96, max_draft=4, prefill_chunk=16)
    build_bundle(models["llama"], str(models["llama_draft"]), root / "inline", **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onnx_export, "INLINE_BYTES", 0)
        build_bundle(models["llama"], str(models["llama_draft"]), root / "external", cache=root / "cache", **kw)
    return root


def test_weights_beside_the_graph_decode_as_the_graph_in_one_file(pair):
    inline, external = pair / "inline", pair / "external"
    files = json.loads((external / "manifest.json").read_text())["files"]
    for graph in ("target.onnx", "draft.onnx"):
        assert graph + ".data" in files and not (inline / (graph + ".data")).exists()
        assert (external / graph).stat().st_size < (external / (graph + ".data")).stat().st_size
        assert abs(graph_bytes(external, graph) - graph_bytes(inline, graph)) < 0.05 * graph_bytes(inline, graph)
    from specdeploy.runtime.tools.report import describe

    assert "target.onnx + target.onnx.data (" in describe(load_bundle(external))  # inspect names both
    for prompt in PROMPTS[:3]:
        want = Session(inline).generate(prompt, max_new_tokens=16, speculate=False).token_ids
        assert Session(external).generate(prompt, max_new_tokens=16, speculate=False).token_ids == want
        assert Session(external).generate(prompt, max_new_tokens=16, draft_len=3).token_ids == want


def test_a_changed_or_unlisted_weights_file_is_refused(pair, tmp_path):
    import shutil

    changed = tmp_path / "changed"
    shutil.copytree(pair / "external", changed)
    data = changed / "target.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="target.onnx.data failed its checksum"):
        load_bundle(changed)
    unlisted = tmp_path / "unlisted"
    shutil.copytree(pair / "external", unlisted)
    manifest = json.loads((unlisted / "manifest.json").read_text())
    del manifest["files"]["draft.onnx.data"]
    manifest["sizes"].pop("draft.onnx.data", None)
    (unlisted / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="draft.onnx.data: a graph's weights file that 'files' does not list"):
        load_bundle(unlisted)


def test_the_graph_cache_keeps_and_gives_back_the_weights_file(pair, models, tmp_path):
    lines = []
    build_bundle(models["llama"], "ngram", tmp_path / "again", max_seq=96, max_draft=4, prefill_chunk=16,
                 cache=pair / "cache", log=lines.append)
    assert any("from the cache" in line for line in lines)
    again = tmp_path / "again"
    assert (again / "target.onnx.data").read_bytes() == (pair / "external" / "target.onnx.data").read_bytes()
    load_bundle(again)  # listed and checked
    want = Session(pair / "inline").generate(PROMPTS[4], max_new_tokens=12, speculate=False).token_ids
    assert Session(again).generate(PROMPTS[4], max_new_tokens=12).token_ids == want
