"""A tampered or careless bundle, and bad inputs at the library and CLI boundary: each is a
one-line error naming the thing, never a traceback, a hang or a huge allocation; a bundle
cannot make the runtime open a file outside itself or one its manifest does not check."""
import copy
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdeploy.cli import main
from specdeploy.core.errors import BundleError, InputError, SpecdeployError
from specdeploy.core.manifest import sha256_file
from specdeploy.runtime import Session, load_bundle

from test_errors import assert_one_line_error


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def edit_manifest(path: Path, change) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def rehash(path: Path, name: str) -> None:
    """What a tamperer who knows the format does: the file's checksum and size made to match."""
    def change(m):
        m["files"][name] = sha256_file(path / name)
        m.setdefault("sizes", {})[name] = (path / name).stat().st_size

    edit_manifest(path, change)


# -- the manifest's schema -----------------------------------------------------------------------

@pytest.mark.parametrize("change,fragment", [
    (lambda m: m.pop("max_seq"), "missing field 'max_seq'"),
    (lambda m: m["models"]["target"].pop("num_layers"), "models.target: missing field 'num_layers'"),
    (lambda m: m.__setitem__("max_seq", "128"), "field 'max_seq' must be int"),
    (lambda m: m.__setitem__("max_seq", -5), "field 'max_seq' is -5, outside [1, 1048576]"),
    (lambda m: m.__setitem__("max_seq", 10**12), "outside [1, 1048576]"),
    (lambda m: m.__setitem__("prefill_chunk", 0), "field 'prefill_chunk' is 0"),
    (lambda m: m.__setitem__("max_draft", 10**9), "field 'max_draft' is 1000000000, outside [1, 32]"),
    (lambda m: m["models"]["target"].__setitem__("kv_dtype", "int64"), "'kv_dtype' is 'int64'"),
    (lambda m: m["draft"].__setitem__("kind", "oracle"), "kind 'oracle' is not one of"),
    (lambda m: m.__setitem__("models", {}), "models has no 'target' entry"),
    (lambda m: m["tokenizer"].__setitem__("eos_token_ids", ["2"]), "'eos_token_ids' must be a list of token ids"),
    # numbers of the right type that the graph contradicts: named when the graph loads, not at its first pass
    (lambda m: m["models"]["target"].__setitem__("num_kv_heads", 1), "past_key_0 is ['B', 2, 128, 16] in the graph"),
    (lambda m: m["models"]["target"].__setitem__("vocab_size", 4), "logits is ['B', 'R', 320] in the graph"),
])
def test_manifest_fields_are_checked(copy_of, change, fragment):
    path = copy_of()
    edit_manifest(path, change)
    assert_one_line_error(run("generate", path, "--prompt", "hi"), fragment)


def test_kv_buffers_past_the_memory_budget_are_refused_before_allocating(copy_of):
    path = copy_of()
    edit_manifest(path, lambda m: m.update(max_seq=1 << 20) or m["models"]["target"].update(num_layers=1024))
    assert_one_line_error(run("generate", path, "--prompt", "hi"), "KV buffers need", "memory budget")
    bundle = load_bundle(copy_of("llama-ngram"))
    with pytest.raises(BundleError, match="more than the memory budget of 0.0 GiB"):
        bundle.check_memory(budget=1000)
    bundle.check_memory(budget=bundle.manifest.kv_bytes())  # exactly enough is enough


# -- files: inside the bundle, listed, checked ---------------------------------------------------

@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/etc/passwd", "sub/target.onnx", ".."])
def test_file_names_that_leave_the_folder_are_refused_unopened(copy_of, name):
    path = copy_of()
    edit_manifest(path, lambda m: m["files"].__setitem__(name, "0" * 64))
    assert_one_line_error(run("inspect", path), "is not a plain file name inside the bundle folder")
    edit_manifest(path, lambda m: (m["files"].pop(name), m["models"]["target"].__setitem__("graph", name)))
    assert_one_line_error(run("generate", path, "--prompt", "hi"), "is not a plain file name")


def test_a_graph_not_listed_in_files_is_refused(copy_of):
    path = copy_of()
    edit_manifest(path, lambda m: m["files"].pop("draft.onnx"))
    assert_one_line_error(run("generate", path, "--prompt", "hi"), "draft.onnx is used but not listed in 'files'")


def test_a_symlink_out_of_the_bundle_is_refused(copy_of, tmp_path):
    path = copy_of()
    outside = tmp_path / "elsewhere.onnx"
    shutil.move(path / "draft.onnx", outside)
    os.symlink(outside, path / "draft.onnx")
    assert_one_line_error(run("generate", path, "--prompt", "hi"), "links outside the bundle folder")


def test_a_broken_graph_with_a_matching_checksum_is_a_one_line_error(copy_of):
    path = copy_of()
    data = (path / "draft.onnx").read_bytes()
    (path / "draft.onnx").write_bytes(data[: len(data) // 3])
    rehash(path, "draft.onnx")
    assert_one_line_error(run("generate", path, "--prompt", "hi"), "draft.onnx: ONNX Runtime cannot load this graph")
    h = onnx.helper
    x = h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    other = h.make_model(h.make_graph([h.make_node("Identity", ["x"], ["y"])], "other", [x], [y]),
                         opset_imports=[h.make_opsetid("", 17)])
    other.ir_version = 8
    onnx.save(other, path / "draft.onnx")
    rehash(path, "draft.onnx")
    assert_one_line_error(run("generate", path, "--prompt", "hi"), "draft.onnx: its inputs and outputs are not the graph contract's")


def test_weights_that_give_nan_stop_the_generation(copy_of):
    path = copy_of("llama-ngram")
    model = onnx.load(path / "target.onnx")
    weight = max((i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT), key=lambda i: np.prod(i.dims))
    array = onnx.numpy_helper.to_array(weight).copy()
    array[...] = np.nan
    weight.CopyFrom(onnx.numpy_helper.from_array(array, weight.name))
    onnx.save(model, path / "target.onnx")
    rehash(path, "target.onnx")
    assert_one_line_error(run("generate", path, "--prompt", "hi", "--max-new-tokens", "4"), "non-finite logits")


# -- inputs ---------------------------------------------------------------------------------------

def test_bad_inputs_are_one_line_errors(bundles):
    path = bundles("llama-ngram")
    assert_one_line_error(run("generate", path, "--prompt", "hi", "--seed", "-1", "--temperature", "1"),
                          "seed -1 is outside [0, 2**64)")
    assert_one_line_error(run("generate", path, "--prompt-ids", str(10**23)), "prompt token ids must be integers")
    session = Session(path)
    with pytest.raises(InputError, match="lone surrogate"):
        session.generate("bad \ud800 text", max_new_tokens=2)
    with pytest.raises(InputError, match="seed"):
        session.generate("hi", max_new_tokens=2, temperature=1.0, seed=1 << 64)


# -- the torch backend's source -------------------------------------------------------------------

def test_the_torch_source_is_recorded_resolved_and_checked(models, tmp_path, monkeypatch):
    from specdeploy.export import build_bundle

    work = tmp_path / "work"
    shutil.copytree(models["llama"], work / "src")
    monkeypatch.chdir(work)
    build_bundle("src", "self:layers=1", tmp_path / "b", max_seq=64, max_draft=4)
    target = load_bundle(tmp_path / "b").model("target")
    assert target.source == str((work / "src").resolve()) and len(target.source_sha256) == 64
    monkeypatch.chdir(tmp_path)  # another folder: the recorded path still finds the source
    ids = Session(tmp_path / "b").encode("hello there")
    want = Session(tmp_path / "b").generate(prompt_ids=ids, max_new_tokens=6, speculate=False).token_ids
    assert Session(tmp_path / "b", backend="torch").generate(prompt_ids=ids, max_new_tokens=6).token_ids == want
    weights = next((work / "src").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b"\0")
    with pytest.raises(BundleError, match="changed after export"):
        Session(tmp_path / "b", backend="torch")


# -- a fuzzer over the manifest --------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def _paths(node, prefix=()):
    """Every (path, value) in a JSON tree."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@pytest.fixture(scope="module")
def fuzz_bundle(bundles, tmp_path_factory):
    dst = tmp_path_factory.mktemp("fuzz") / "b"
    shutil.copytree(bundles("llama-ngram"), dst)
    return dst, json.loads((dst / "manifest.json").read_text())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_manifests_load_or_fail_in_one_line(fuzz_bundle, data):
    """Replace or delete any field with any JSON value: the loader and a Session either work
    (and then generate) or raise a SpecdeployError of one line; nothing else."""
    path, original = fuzz_bundle
    manifest = copy.deepcopy(original)
    paths = [p for p in _paths(manifest) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(paths))
        parent = manifest
        try:
            for key in where[:-1]:
                parent = parent[key]
            if data.draw(st.booleans()):
                parent[where[-1]] = data.draw(JSON)
            elif isinstance(parent, dict):
                del parent[where[-1]]
        except (KeyError, IndexError, TypeError):
            pass  # an earlier change removed or replaced this branch
    (path / "manifest.json").write_text(json.dumps(manifest))
    try:
        session = Session(path, threads=1)
        session.generate(prompt_ids=[1, 2, 3], max_new_tokens=2)
    except SpecdeployError as e:
        assert "\n" not in str(e) and str(e)
    finally:
        (path / "manifest.json").write_text(json.dumps(original))
