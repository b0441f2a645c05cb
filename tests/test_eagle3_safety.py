"""An EAGLE-3 head folder is a user's file: whatever it holds, importing it (export/eagle3.py:
`is_head_folder`, `HeadConfig.read`, `read_weights`, `load_head`) either gives the head the
file describes or one line naming the file and the field or tensor (an ExportError, which the
CLI prints as `error: ...`). Never a traceback, never a silently different model: a number
transformers would quietly ignore or turn into a rotary of zeros, a weight that is not
finite, a tensor of the wrong kind. A Hypothesis fuzzer over mutated head folders closes it."""
import json
import math
import pickle
import tempfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

import tiny
from specdeploy.core.errors import ExportError
from test_eagle3 import _broken, target_folder  # noqa: F401  (a fixture: the 7-layer tiny target)


def refused(folder: Path, target: Path, *fragments: str) -> str:
    """load_head refuses the folder in one line holding every fragment; the line, for more checks."""
    from specdeploy.export.eagle3 import load_head

    with pytest.raises(ExportError) as err:
        load_head(folder, AutoConfig.from_pretrained(target))
    message = str(err.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def loads(folder: Path, target: Path):
    from specdeploy.export.eagle3 import Eagle3Head, load_head

    target_config = AutoConfig.from_pretrained(target)
    head = load_head(folder, target_config)
    module = Eagle3Head.from_head(head, torch.nn.Embedding(target_config.vocab_size, target_config.hidden_size))
    return head, module


# -- config.json -----------------------------------------------------------------------------------

def test_an_unknown_activation_is_one_line_naming_the_field_and_the_allowed(target_folder, tmp_path):
    """Was a KeyError traceback from transformers' ACT2FN when the layer was built."""
    folder = _broken(tmp_path, target_folder, hidden_act="evil_act")
    refused(folder, target_folder, "config.json", "hidden_act", "'evil_act'", "silu")


@pytest.mark.parametrize("act", [5, None, "prelu"])
def test_an_activation_that_is_no_string_or_has_weights_is_refused(target_folder, tmp_path, act):
    """5 was read as the activation "5" (KeyError); prelu has a weight the published layout
    lacks (a RuntimeError from load_state_dict)."""
    folder = _broken(tmp_path, target_folder, hidden_act=act)
    refused(folder, target_folder, "config.json", "hidden_act")


def test_the_cli_prints_a_bad_head_as_one_line(target_folder, tmp_path):
    from specdeploy.cli import main
    from test_errors import assert_one_line_error

    folder = _broken(tmp_path, target_folder, hidden_act="evil_act")
    result = CliRunner().invoke(main, ["export", "--target", str(target_folder), "--draft", str(folder),
                                       "--out", str(tmp_path / "b"), "--max-seq", "64"])
    assert_one_line_error(result, "config.json", "hidden_act")


def test_architectures_given_as_a_string_is_refused_not_read_as_a_model(target_folder, tmp_path):
    """Was: not recognised as a head (the string's characters were compared with the class
    names), loaded as an ordinary model of the head's tensors, then a RuntimeError."""
    from specdeploy.export.drafts import Eagle3Draft, parse_draft

    folder = _broken(tmp_path, target_folder, architectures="LlamaForCausalLMEagle3")
    assert isinstance(parse_draft(str(folder)), Eagle3Draft)
    refused(folder, target_folder, "config.json", "architectures", "a list")


@pytest.mark.parametrize("archs", [{"LlamaForCausalLMEagle3": 1}, ["LlamaForCausalLMEagle3", 3]])
def test_architectures_that_are_not_a_list_of_names_are_refused(target_folder, tmp_path, archs):
    folder = _broken(tmp_path, target_folder, architectures=archs)
    refused(folder, target_folder, "config.json", "architectures")


def test_a_config_nested_past_the_parser_is_one_line(target_folder, tmp_path):
    """json's RecursionError on a deeply nested config.json was a traceback from parse_draft."""
    from specdeploy.export.drafts import parse_draft
    from specdeploy.export.eagle3 import HeadConfig, is_head_folder

    folder = tiny.make_eagle3_head(tmp_path / "h", target_folder)
    (folder / "config.json").write_text("[" * 100_000)
    assert not is_head_folder(folder)
    parse_draft(str(folder))  # not a head: a path for the model loader, no traceback here
    with pytest.raises(ExportError, match="config.json") as err:
        HeadConfig.read(folder)
    assert "\n" not in str(err.value)


INF, NAN = math.inf, math.nan


@pytest.mark.parametrize("config, fragments", [
    # each of these exported with "parity ok" or failed later with a traceback
    ({"rope_theta": INF}, ["rope_theta"]),  # inv_freq [1, 0, 0, ...]: no rotary at all
    ({"rope_theta": NAN}, ["rope_theta"]),
    ({"rope_theta": 1e-300}, ["rope"]),  # finite, but its frequencies overflow float32
    ({"rms_norm_eps": NAN}, ["rms_norm_eps"]),
    ({"rms_norm_eps": INF}, ["rms_norm_eps"]),
    ({"rms_norm_eps": 10**400}, ["rms_norm_eps"]),  # past float's range: OverflowError
    ({"rope_scaling": {"rope_type": "linear", "factor": INF}}, ["rope_scaling", "factor"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, ["rope_scaling", "factor"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, ["rope_scaling", "factor"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, ["rope_scaling", "factor"]),
    ({"rope_scaling": {"factor": 8.0}}, ["rope_scaling", "factor", "rope_type"]),  # transformers drops the factor
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ["rope_scaling", "dynamic"]),  # the graph's angles are fixed
    ({"rope_scaling": {"rope_type": "bogus"}}, ["rope_scaling", "bogus"]),  # KeyError when the module was built
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 256}}, ["rope_scaling", "low_freq_factor"]),  # ZeroDivisionError
    # Llama's default rope ignores a partial_rotary_factor; the other types rotate part of the head
    ({"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}}, ["rope_scaling", "partial_rotary_factor"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}}, ["rope_scaling", "rotary"]),
    ({"rope_parameters": {"rope_type": "linear", "factor": NAN, "rope_theta": 10000.0}}, ["rope_parameters", "factor"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}}, ["rope_parameters", "rope_theta"]),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, ["rope_parameters"]),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
      "rope_scaling": {"rope_type": "default", "rope_theta": 10000.0}}, ["rope_scaling", "rope_parameters"]),
    ({"rope_scaling": [2.0]}, ["rope_scaling"]),
    ({"hidden_size": 0}, ["hidden_size"]),
    ({"hidden_size": -64}, ["hidden_size"]),
    ({"num_key_value_heads": 3}, ["num_key_value_heads", "divide"]),  # was a shape mismatch of k_proj
    ({"num_attention_heads": 6, "head_dim": ...}, ["num_attention_heads", "divide"]),  # ... : the field left out
    ({"intermediate_size": 10**12}, ["intermediate_size", "past the largest"]),
    ({"max_position_embeddings": 10**30}, ["max_position_embeddings"]),
    ({"vocab_size": "320"}, ["vocab_size"]),
    ({"draft_vocab_size": 1000}, ["draft_vocab_size", "vocab_size"]),
    ({"num_hidden_layers": True}, ["num_hidden_layers"]),
    ({"head_dim": 15}, ["head_dim"]),
    ({"norm_before_residual": "false"}, ["norm_before_residual"]),  # bool("false") is True: another model
    ({"eagle_config": ["eagle_aux_hidden_state_layer_ids"]}, ["eagle_config"]),  # AttributeError
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}, "eagle_aux_hidden_state_layer_ids": [2, 3, 4]},
     ["eagle_aux_hidden_state_layer_ids"]),
])
def test_a_number_no_model_has_is_refused_naming_the_field(target_folder, tmp_path, config, fragments):
    folder = tiny.make_eagle3_head(tmp_path / "h", target_folder)  # the tensors of the valid head
    written = {**json.loads((folder / "config.json").read_text()), **config}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in written.items() if v is not ...}))
    refused(folder, target_folder, "config.json", *fragments)


def test_heads_transformers_will_not_build_are_one_line(target_folder, tmp_path):
    """transformers 5's LlamaConfig wants hidden_size a multiple of the heads even where
    head_dim is given: 3 heads of 16 over 64, with tensors of those shapes, loaded and then
    was a StrictDataclassClassValidationError traceback when the module was built."""
    def three_heads(t):
        for name in ("q_proj", "k_proj", "v_proj"):
            t[f"midlayer.self_attn.{name}.weight"] = t["midlayer.self_attn.q_proj.weight"][:48].clone()
        t["midlayer.self_attn.o_proj.weight"] = t["midlayer.self_attn.o_proj.weight"][:, :48].contiguous()

    folder = _broken(tmp_path, target_folder, three_heads, num_attention_heads=3, num_key_value_heads=3)
    refused(folder, target_folder, "config.json", "transformers cannot build", "attention heads (3)")


def test_rope_parameters_are_read_as_transformers_reads_them(target_folder, tmp_path):
    """A head saved by transformers 5 spells its rope `rope_parameters` (no top-level
    rope_theta): its base is the one the head was trained with. Was: ignored, base 10000."""
    folder = _broken(tmp_path, target_folder, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    config = json.loads((folder / "config.json").read_text())
    del config["rope_theta"]
    (folder / "config.json").write_text(json.dumps(config))
    head, module = loads(folder, target_folder)
    d = head.config.head_dim
    want = 1.0 / 500000.0 ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    torch.testing.assert_close(module.rotary.inv_freq, want)


def test_a_malformed_distill_record_is_one_line(target_folder, tmp_path):
    """Was a JSONDecodeError traceback."""
    folder = tiny.make_eagle3_head(tmp_path / "h", target_folder)
    (folder / "distill.json").write_text("{not json")
    refused(folder, target_folder, "distill.json")
    (folder / "distill.json").write_text("[1, 2]")  # drafts.py reads it as a mapping
    refused(folder, target_folder, "distill.json")


# -- the weights ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, value", [
    ("fc.weight", NAN), ("norm.weight", INF), ("midlayer.input_layernorm.weight", -INF),
    ("midlayer.mlp.down_proj.weight", NAN), ("lm_head.weight", INF),
])
def test_a_weight_that_is_not_finite_is_refused_naming_it(target_folder, tmp_path, name, value):
    """Was: imported, and found (if at all) as a parity failure after the export."""
    def poison(tensors):
        tensors[name].view(-1)[3] = value

    folder = _broken(tmp_path, target_folder, poison)
    refused(folder, target_folder, "model.safetensors", name, "non-finite")


def test_a_weight_that_is_not_finite_in_a_bin_is_refused(target_folder, tmp_path):
    folder = tiny.make_eagle3_head(tmp_path / "h", target_folder, weights="pytorch_model.bin")
    tensors = torch.load(folder / "pytorch_model.bin", weights_only=True)
    tensors["midlayer.self_attn.q_proj.weight"][0, 0] = NAN
    torch.save(tensors, folder / "pytorch_model.bin")
    refused(folder, target_folder, "pytorch_model.bin", "midlayer.self_attn.q_proj.weight", "non-finite")


def test_a_float64_weight_past_float32_is_refused(target_folder, tmp_path):
    """The head runs in float32: a float64 weight of 1e300 would become infinity there."""
    def big(tensors):
        tensors["fc.weight"] = tensors["fc.weight"].double()
        tensors["fc.weight"][0, 0] = 1e300

    refused(_broken(tmp_path, target_folder, big), target_folder, "fc.weight", "non-finite")


@pytest.mark.parametrize("edit, fragments", [
    # d2t of floats: 0.9 was truncated to 0, another token than the file's
    (lambda t: t.update({"d2t": t["d2t"].double() + 0.9}), ["'d2t'", "integer"]),
    (lambda t: t.update({"fc.weight": (t["fc.weight"] * 100).long()}), ["'fc.weight'", "float"]),
    (lambda t: t.update({"norm.weight": t["norm.weight"].bool()}), ["'norm.weight'", "float"]),
    (lambda t: t.update({"t2d": t["t2d"].float()}), ["'t2d'"]),
    (lambda t: t.update({"t2d": t["t2d"].long() * 3}), ["'t2d'"]),
    (lambda t: t.update({"d2t": t["d2t"].bool()}), ["'d2t'"]),
])
def test_a_tensor_of_the_wrong_kind_is_refused(target_folder, tmp_path, edit, fragments):
    refused(_broken(tmp_path, target_folder, edit), target_folder, "model.safetensors", *fragments)


class _Hostile:
    def __reduce__(self):
        return (print, ("pickle code ran",))


@pytest.mark.parametrize("content", [
    [torch.zeros(2)],  # a list, not a state dict: was an AttributeError
    {"fc.weight": 3},  # a number where a tensor belongs: was an AttributeError
    {1: torch.zeros(2)},  # a key that is no name: was a TypeError when names were sorted
    {"fc.weight": torch.zeros(64, 192).to_sparse()},  # not a plain tensor
])
def test_a_bin_that_is_not_a_state_dict_is_one_line(target_folder, tmp_path, content):
    folder = tiny.make_eagle3_head(tmp_path / "h", target_folder, weights="pytorch_model.bin")
    torch.save(content, folder / "pytorch_model.bin")
    refused(folder, target_folder, "pytorch_model.bin")


def test_a_pickle_with_code_is_refused_without_running_it(target_folder, tmp_path, capsys):
    folder = tiny.make_eagle3_head(tmp_path / "h", target_folder, weights="pytorch_model.bin")
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"fc.weight": _Hostile()}))
    refused(folder, target_folder, "pytorch_model.bin", "cannot read")
    assert "pickle code ran" not in capsys.readouterr().out


@pytest.mark.parametrize("data", [b"", b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage", b"\xff" * 64])
def test_a_damaged_safetensors_is_one_line_naming_it(target_folder, tmp_path, data):
    folder = tiny.make_eagle3_head(tmp_path / "h", target_folder)
    (folder / "model.safetensors").write_bytes(data)
    refused(folder, target_folder, "model.safetensors", "cannot read")


def test_every_deserialiser_states_its_safe_mode():
    """torch.load with weights_only=True, np.load with allow_pickle=False, in every file that
    reads a head or its bundle's vocabulary map."""
    import re

    root = Path(__file__).parent.parent
    for name in ("export/eagle3.py", "export/eagle3_export.py", "runtime/decoding/drafters/eagle3.py"):
        text = (root / name).read_text()
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (name, call)
        for call in re.findall(r"np\.load\([^)]*\)", text):
            assert "allow_pickle=False" in call, (name, call)
        assert "pickle.load" not in text, name


def test_a_valid_head_reads_as_before(target_folder, tmp_path):
    """The checks take nothing from a valid head: its config and tensors come through as written."""
    from safetensors.torch import load_file

    from specdeploy.export.eagle3 import HeadConfig

    folder = tiny.make_eagle3_head(tmp_path / "h", target_folder, layers=[1, 3, 5])
    head, module = loads(folder, target_folder)
    assert head.config == HeadConfig(hidden_size=64, target_hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                     intermediate_size=128, vocab_size=320, draft_vocab_size=96, rms_norm_eps=1e-6,
                                     rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
                                     hidden_act="silu", aux_layers=(1, 3, 5))
    written = load_file(str(folder / "model.safetensors"))
    assert set(head.weights) == set(written) and all(torch.equal(head.weights[k], written[k]) for k in written)


# -- the fuzzer -------------------------------------------------------------------------------------

TENSORS = ("fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.k_proj.weight", "midlayer.mlp.up_proj.weight",
           "norm.weight", "lm_head.weight", "d2t", "t2d")
DELETE = "<left out>"  # longer than any fuzzed text: the key is removed
# Hostile values: every JSON type, signs, NaN and infinities, integers past any size, text.
HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf, 1e-300, 1e300]),
    st.text(max_size=6))
OTHER = st.one_of(HOSTILE, st.lists(HOSTILE, max_size=3), st.just(DELETE),
                  st.dictionaries(st.sampled_from(["rope_type", "type", "factor", "rope_theta"]), HOSTILE, max_size=3))
ROPE = st.one_of(st.none(), st.fixed_dictionaries(
    {"rope_type": st.sampled_from(["default", "linear", "llama3", "yarn", "dynamic", "longrope"])},
    optional={"factor": st.one_of(st.sampled_from([1.0, 2.0, 8.0]), HOSTILE), "rope_theta": st.sampled_from([1e4, 5e5, 1e-300]),
              "low_freq_factor": st.sampled_from([1.0, 4.0, 0]), "high_freq_factor": st.sampled_from([4.0, 1.0]),
              "original_max_position_embeddings": st.sampled_from([256, 8192]),
              "partial_rotary_factor": st.sampled_from([0.5, 1.0])}))
# Each key's values a real head might hold, some valid (so the fuzzer gets past the config to
# the weights and the forward), some just wrong (a head count that does not divide).
NEAR = {
    "architectures": st.sampled_from([["LlamaForCausalLMEagle3"], ["Eagle3LlamaForCausalLM"], "LlamaForCausalLMEagle3",
                                      ["LlamaForCausalLM"], []]),
    "hidden_size": st.sampled_from([64, 32, 128]), "target_hidden_size": st.sampled_from([64, 32]),
    "num_attention_heads": st.sampled_from([4, 2, 8, 3]), "num_key_value_heads": st.sampled_from([2, 4, 1, 3]),
    "head_dim": st.sampled_from([16, 8, 32, 15]), "intermediate_size": st.sampled_from([128, 64, 256]),
    "vocab_size": st.sampled_from([320, 300]), "draft_vocab_size": st.sampled_from([96, 320, 95, 400]),
    "rms_norm_eps": st.sampled_from([1e-6, 1e-5, 0.1, 1e300, 1e-300]),
    "rope_theta": st.sampled_from([10000.0, 500000.0, 1.5, 1e-300, 1e300]),
    "rope_scaling": ROPE, "rope_parameters": ROPE, "max_position_embeddings": st.sampled_from([512, 2048, 1, 8192]),
    "hidden_act": st.sampled_from(["silu", "gelu", "gelu_pytorch_tanh", "relu", "prelu", "xielu", "relu2", "evil_act"]),
    "num_hidden_layers": st.sampled_from([1, 2]),
    "eagle_config": st.one_of(st.just({}), st.fixed_dictionaries(
        {"eagle_aux_hidden_state_layer_ids": st.lists(st.integers(-1, 7), min_size=2, max_size=4)})),
    "norm_before_residual": st.booleans(),
}
CONFIG_EDITS = st.lists(st.sampled_from(sorted(NEAR)).flatmap(
    lambda key: st.tuples(st.just(key), st.one_of(NEAR[key], NEAR[key], NEAR[key], OTHER))), max_size=2)
TENSOR_EDITS = st.lists(st.tuples(st.sampled_from(TENSORS + ("extra.weight",)),
                                  st.sampled_from(["delete", "add", "narrow", "widen", "int64", "float16", "bool",
                                                   "float64", "nan", "inf", "scalar"])), max_size=2)


@pytest.fixture(scope="module")
def valid_head(target_folder, tmp_path_factory):
    from safetensors.torch import load_file

    folder = tiny.make_eagle3_head(tmp_path_factory.mktemp("valid") / "h", target_folder)
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def _edit_tensor(tensors: dict, name: str, how: str) -> None:
    t = tensors.get(name)
    if how == "delete" or (t is None and how != "add"):
        tensors.pop(name, None)
    elif how == "add":
        tensors[name] = torch.zeros(3)
    elif how in ("narrow", "widen") and t.dim() == 0:  # made a scalar by an earlier edit
        tensors[name] = t.reshape(1)
    elif how in ("narrow", "widen"):
        tensors[name] = t[..., :-1].contiguous() if how == "narrow" and t.shape[-1] > 1 else torch.cat([t, t[..., :1]], -1)
    elif how in ("int64", "float16", "bool", "float64"):
        tensors[name] = t.to(getattr(torch, how))
    elif how == "scalar":
        tensors[name] = torch.tensor(1.0)
    elif t.is_floating_point():  # nan, inf
        t = t.clone()
        t.view(-1)[0] = math.nan if how == "nan" else math.inf
        tensors[name] = t


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(config_edits=CONFIG_EDITS, tensor_edits=TENSOR_EDITS, bin_file=st.booleans())
def test_fuzzed_head_folders_load_or_are_one_line(target_folder, valid_head, config_edits, tensor_edits, bin_file):
    """Mutations of a valid head's config values (types, signs, NaN/inf, huge integers,
    strings) and of its tensors (missing, extra, wrong shape or dtype, non-finite): the
    import gives a head that builds and runs with finite outputs, or one ExportError line;
    nothing else."""
    from safetensors.torch import save_file

    from specdeploy.export.drafts import parse_draft
    from specdeploy.export.eagle3 import is_head_folder

    config, tensors = json.loads(json.dumps(valid_head[0])), dict(valid_head[1])
    for key, value in config_edits:
        if value == DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    for name, how in tensor_edits:
        _edit_tensor(tensors, name, how)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(config))
        if bin_file:
            torch.save(tensors, folder / "pytorch_model.bin")
        else:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        if is_head_folder(folder):  # a bool, never an exception
            parse_draft(str(folder))
        try:
            head, module = loads(folder, target_folder)
        except ExportError as e:
            assert "\n" not in str(e) and str(e), str(e)
            return
        # it loaded: it is a head that runs, over finite numbers
        t = head.config.target_hidden_size
        with torch.no_grad():
            states = torch.randn(1, 3, 3 * t, generator=torch.Generator().manual_seed(0))
            out, logits, _ = module(torch.tensor([[1, 2, 3]]), states, torch.arange(3)[None])
        assert torch.isfinite(out).all() and torch.isfinite(logits).all(), config_edits
