"""A source is exactly the file's model or it is refused (export/source_check.py): a config or
GGUF header that disagrees with the file's tensors, a weight missing or left over, a number no
model has, a non-finite weight: each one line naming the file and the field or tensor, before
anything is built, never a traceback and never a model that is not the file's."""
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import tiny
from specdeploy.cli import main
from specdeploy.core.errors import ExportError
from specdeploy.export import source_check
from specdeploy.export.load import load_source

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
GGUF = FIXTURES / "llama-Q4_K_M.gguf"


def numeric_slot(path: Path, key: str) -> tuple[int, np.dtype]:
    """(byte offset, dtype) of a GGUF metadata field's scalar value."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.get_field(key)
    part = field.parts[field.data[0]]
    return part.ctypes.data - reader.data.ctypes.data, part.dtype


def patched(path: Path, out: Path, key: str, value) -> Path:
    """A copy of a GGUF file with one metadata value replaced, in place (the same layout)."""
    at, dtype = numeric_slot(path, key)
    data = bytearray(path.read_bytes())
    data[at:at + dtype.itemsize] = np.array([value]).astype(dtype).tobytes()
    out.write_bytes(bytes(data))
    return out


def refusal(path) -> str:
    with pytest.raises(ExportError) as e:
        load_source(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.mark.parametrize("count", [2, 4, 1000])
def test_a_block_count_that_is_not_the_files_is_refused_before_anything_is_built(tmp_path, monkeypatch, count):
    """Seen on 509f627: 2 exported a 2-layer model with exit 0, 4 a random fourth layer, 1000
    hung building random layers. The layer count is read off the tensor names first."""
    def never(cfg):
        raise AssertionError("a model was built from a header the tensors contradict")
    monkeypatch.setattr(source_check, "expected_tensors", never)
    message = refusal(patched(GGUF, tmp_path / "m.gguf", "llama.block_count", count))
    assert f"block_count {count} but the file's tensors hold 3 layer(s)" in message


@pytest.mark.parametrize("key, value, says", [
    ("llama.attention.head_count", 0, "head_count: 0: expected a positive integer"),  # was ZeroDivisionError
    ("llama.attention.key_length", 0, "key_length: 0"),  # was ZeroDivisionError
    ("llama.attention.key_length", 2 ** 31, "key_length: 2147483648"),  # was RuntimeError
    ("llama.attention.head_count", 3, "not a multiple of the number of attention heads"),  # was a traceback
    ("llama.attention.head_count_kv", 3, "num_key_value_heads: 3 does not divide"),  # was ValueError (reshape)
    ("llama.vocab_size", 999, "token_embd.weight has shape [320, 256] where the config implies [999, 256]"),
    ("tokenizer.ggml.eos_token_id", 10 ** 9, "eos_token_id: 1000000000: expected a token id in 0..319"),  # IndexError
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), "layer_norm_rms_epsilon: nan"),  # was exported
    ("llama.attention.layer_norm_rms_epsilon", -1.0, "layer_norm_rms_epsilon: -1.0"),  # was an ORT load failure
    ("llama.rope.freq_base", float("inf"), "freq_base: inf"),  # was "differ by inf"
    ("llama.embedding_length", 0, "embedding_length: 0"),
    # transformers would take the head width from the rotary width, and export read key_length: loaded
    ("llama.rope.dimension_count", 32, "rope.dimension_count: 32 where the heads are 64 wide"),
])
def test_a_gguf_number_no_model_has_is_one_line_naming_it(tmp_path, key, value, says):
    assert says in refusal(patched(GGUF, tmp_path / "m.gguf", key, value))


def test_a_truncated_or_overlong_gguf_is_one_line(tmp_path):
    data = GGUF.read_bytes()
    inside_table = data.find(b"blk.1.ffn_up") + 5
    for name, body in [("table", data[:inside_table]), ("data", data[:-1000])]:  # was struct.error
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(body)
        assert "not a readable GGUF file" in refusal(path)
    at, dtype = numeric_slot(GGUF, "tokenizer.ggml.merges")  # the array's element type; its length follows
    path = tmp_path / "array.gguf"
    path.write_bytes(data[:at + 4] + struct.pack("<Q", 1 << 40) + data[at + 12:])  # 2^40 merges: was struct.error
    refusal(path)


def test_a_non_finite_block_scale_is_named_where_it_is_found(tmp_path):
    """A NaN in a Q4_K super-block's scale: seen on 509f627 only as "logits differ by inf"."""
    import gguf

    reader = gguf.GGUFReader(str(GGUF))
    tensor = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
    at = tensor.data_offset  # the first super-block's d (float16)
    data = bytearray(GGUF.read_bytes())
    data[at:at + 2] = np.float16(np.nan).tobytes()
    path = tmp_path / "nan.gguf"
    path.write_bytes(bytes(data))
    assert "tensor model.layers.1.self_attn.q_proj.weight holds" in refusal(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    tiny.make_model(path, "llama", layers=3)
    return path


def edited(folder: Path, to: Path, config=None, weights=None) -> Path:
    shutil.copytree(folder, to)
    if config:
        cfg = json.loads((to / "config.json").read_text())
        config(cfg)
        (to / "config.json").write_text(json.dumps(cfg))
    if weights:
        tensors = load_file(to / "model.safetensors")
        weights(tensors)
        save_file(tensors, to / "model.safetensors", metadata={"format": "pt"})
    return to


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


@pytest.mark.parametrize("name, config, weights, says", [
    # seen on 509f627: loaded, the weight filled with random values
    ("deleted", None, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"),
     "tensor model.layers.1.mlp.up_proj.weight is missing from the file"),
    ("extra", None, _set("model.layers.1.mlp.extra.weight", torch.zeros(2)),
     "tensor model.layers.1.mlp.extra.weight in the file has no place"),
    ("reshaped", None, _set("model.norm.weight", torch.ones(32)),
     "tensor model.norm.weight has shape [32] where the config implies [64]"),
    ("fewer layers", _set("num_hidden_layers", 2), None, "num_hidden_layers 2 but the file's tensors hold 3"),
    ("more layers", _set("num_hidden_layers", 4), None, "num_hidden_layers 4 but the file's tensors hold 3"),
    ("nan weight", None, lambda w: w["model.norm.weight"].__setitem__(0, float("nan")),
     "tensor model.norm.weight holds 1 non-finite value(s) (NaN)"),
    ("inf weight", None, lambda w: w["model.layers.0.self_attn.o_proj.weight"].__setitem__((0, 0), -float("inf")),
     "tensor model.layers.0.self_attn.o_proj.weight holds 1 non-finite value(s) (-inf)"),
    ("nan eps", _set("rms_norm_eps", float("nan")), None, "config rms_norm_eps: nan"),
    ("negative eps", _set("rms_norm_eps", -1e-6), None, "config rms_norm_eps: -1e-06"),
    ("yarn -3", _set("rope_parameters", {"rope_type": "yarn", "factor": -3.0, "rope_theta": 10000.0,
                                         "original_max_position_embeddings": 256}), None,
     "config rope_parameters['factor']: -3.0"),
    ("infinite base", lambda d: d["rope_parameters"].__setitem__("rope_theta", float("inf")), None,
     "config rope_parameters['rope_theta']: inf"),
    ("no heads", _set("num_attention_heads", 0), None, "cannot read the model config"),
    ("eos", _set("eos_token_id", 10 ** 9), None, "config eos_token_id: 1000000000"),
])
def test_a_folder_that_is_not_its_configs_model_is_one_line(folder, tmp_path, name, config, weights, says):
    assert says in refusal(edited(folder, tmp_path / "m", config, weights))


def test_export_of_a_contradicted_gguf_exits_1_and_writes_nothing(tmp_path):
    source = patched(GGUF, tmp_path / "m.gguf", "llama.block_count", 2)
    run = CliRunner().invoke(main, ["export", "--target", str(source), "--draft", "ngram", "--out", str(tmp_path / "out"),
                                    "--max-seq", "64"])
    assert run.exit_code == 1, run.output
    assert run.stderr.strip().splitlines()[-1:] == [
        f"error: {source}: the config says block_count 2 but the file's tensors hold 3 layer(s); refusing a model "
        "that is not the file's"]
    assert not (tmp_path / "out").exists()


# -- a fuzzer over GGUF headers and metadata -------------------------------------------------------

def _slots(path: Path) -> list[tuple[int, str]]:
    """(offset, dtype) of every number in a GGUF's header: metadata counts, types, lengths and
    values, each tensor's name length, dimensions, type and offset."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    base = reader.data.ctypes.data
    slots = []
    for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        for part in field.parts[:64]:  # a long array's first elements stand for the rest
            if part.dtype != np.uint8 and part.size == 1:
                slots.append((part.ctypes.data - base, part.dtype.str))
    return slots


SLOTS = _slots(GGUF)
HEADER_END = max(at for at, _ in SLOTS) + 16


def _value(dtype: str):
    kind = np.dtype(dtype)
    if kind.kind == "f":
        return st.one_of(st.sampled_from([0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e30]),
                         st.floats(width=32 if kind.itemsize == 4 else 64))
    info = np.iinfo(kind)
    return st.one_of(st.sampled_from([0, 1, 2, 3, 4, 1000, info.max, info.min]),
                     st.integers(int(info.min), int(info.max)))


MUTATION = st.one_of(
    st.sampled_from(SLOTS).flatmap(lambda slot: _value(slot[1]).map(lambda v: ("set", slot, v))),
    st.integers(0, HEADER_END).map(lambda n: ("truncate", n, None)),
    st.tuples(st.integers(0, HEADER_END), st.integers(0, 255)).map(lambda t: ("byte", t[0], t[1])),
)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3))
def test_fuzzed_gguf_headers_load_as_the_file_or_are_one_line(tmp_path_factory, mutations):
    data = bytearray(GGUF.read_bytes())
    for kind, where, value in mutations:
        if kind == "set":
            at, dtype = where
            data[at:at + np.dtype(dtype).itemsize] = np.array([value]).astype(dtype).tobytes()
        elif kind == "truncate":
            del data[where:]
        elif where < len(data):
            data[where] = value
    path = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    path.write_bytes(bytes(data))
    try:
        source = load_source(path)
    except ExportError as e:
        assert "\n" not in str(e) and str(path) in str(e)
        return
    # Whatever loads is the file's model: every weight finite, the layer count the tensors hold.
    assert source.config.num_hidden_layers == 3
    assert all(bool(torch.isfinite(p).all()) for p in source.model.parameters())


def test_what_transformers_rightly_drops_is_not_refused(tmp_path):
    """A tied head saved beside the embedding it equals, and the rotary frequencies older
    checkpoints saved, load as before: they are not weights of another model."""
    path = tmp_path / "tied"
    tiny.make_model(path, "llama", layers=2, tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert load_source(path).config.num_hidden_layers == 2
