"""export --for cpu|cuda|tensorrt: the device picks the defaults, and a bundle for TensorRT keeps to
standard ONNX (int8/int4 as blocked DequantizeLinear + MatMul), checked by check-trt at export.

The rewrite MatMulNBits -> DequantizeLinear + MatMul holds the very same weight values (checked
element for element); ONNX Runtime runs both forms on the CPU, so the DequantizeLinear bundle is
also proved lossless under speculation here. TensorRT itself installs nowhere here: that it
builds and runs these graphs is not proved (docs/backends.md)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import tiny
from specdeploy.core.errors import ExportError
from specdeploy.export import build_bundle
from specdeploy.export.architectures import ARCHITECTURES
from specdeploy.export.blocks import pack, quantize_float
from specdeploy.export.gguf_blocks import GGUF_TYPES
from specdeploy.export.ops import ACCURACY_LEVEL
from specdeploy.export.qdq import to_dequantize_linear
from specdeploy.export.trt_ops import check_bundle
from specdeploy.runtime import Session
from test_quant import _random_gguf_blocks
from tiny import PROMPTS


def _matmul_nbits_model(blocks):
    import onnx
    from onnx import helper, numpy_helper

    from specdeploy.export.ops import DOMAIN

    packed, scales, zp = pack(blocks)
    n, k = blocks.shape
    symmetric = bool((blocks.zero == 1 << (blocks.bits - 1)).all())
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "s")]
    if not symmetric:
        inits.append(numpy_helper.from_array(zp, "z"))
    node = helper.make_node("MatMulNBits", ["x", "B", "s"] + ([] if symmetric else ["z"]), ["y"], domain=DOMAIN,
                            K=k, N=n, bits=blocks.bits, block_size=blocks.block, accuracy_level=ACCURACY_LEVEL)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, "T", k])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])


# Blocks whose q - zero fits TensorRT's symmetric int4 (-8..7): symmetric 4-bit, Q4_0, Q3_K (q - 4),
# Q2_K (0..3). Q4_1/Q4_K's 0..15 and every 5- to 8-bit type do not.
INT4_FORMS = {"float4-symmetric", "Q4_0", "Q3_K", "Q2_K"}


@pytest.mark.parametrize("form", ["float4-symmetric", "float4-min", "float8", *sorted(GGUF_TYPES)])
def test_the_rewrite_holds_the_same_weights(form):
    """DequantizeLinear's weights, dequantized, equal the blocks' (q - zero) * scale element for
    element; symmetric 4-bit blocks stay 4-bit, the rest become exact 8-bit values."""
    import ml_dtypes
    import onnxruntime as ort
    from onnx import numpy_helper

    rng = np.random.default_rng(1)
    n, k = 64, 256
    if form.startswith("float"):
        bits, zero = (4, form.split("-")[1].replace("symmetric", "none")) if form.startswith("float4") else (8, "none")
        blocks = quantize_float(rng.standard_normal((n, k)).astype(np.float32), bits, zero)
    else:
        blocks = _random_gguf_blocks(form, n, k)
    blocks.mins = None  # the minimum term is standard ops already, outside the rewrite
    model = _matmul_nbits_model(blocks)
    counts = to_dequantize_linear(model)
    assert [n.op_type for n in model.graph.node] == ["DequantizeLinear", "MatMul"]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    weight = next(v for name, v in inits.items() if name.endswith("dq_weight"))
    scale = next(v for name, v in inits.items() if name.endswith("dq_scale"))
    four = weight.dtype == ml_dtypes.int4
    assert counts == {"int4": int(four), "int8": int(not four)}
    assert four == (form in INT4_FORMS)
    dequantized = (weight.astype(np.float32).reshape(k // blocks.block, blocks.block, n) * scale[:, None, :]).reshape(k, n)
    assert np.array_equal(dequantized.T, blocks.dequantize())
    x = rng.standard_normal((1, 3, k)).astype(np.float32)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x @ blocks.dequantize().T
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()  # int8 activation rounding where ORT fuses it


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("for") / "llama"
    tiny.make_model(folder, "llama", seed=3, layers=3)
    return folder


@pytest.mark.bundle
def test_an_int4_bundle_for_tensorrt_is_standard_onnx_and_lossless(llama, tmp_path):
    out = tmp_path / "b"
    build_bundle(llama, "self:layers=1", out, max_seq=128, max_draft=8, dtype="int4", prefill_chunk=16,
                 device="tensorrt")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["device"] == "tensorrt"
    for role, entry in manifest["models"].items():
        graph = (out / entry["graph"]).read_bytes()
        assert b"MatMulNBits" not in graph and b"com.microsoft" not in graph and b"DequantizeLinear" in graph
        q = entry["quantization"]
        # a layer's nodes: q|k|v fused, o, gate, up, down (symmetric blocks: no minimum term to share)
        assert q["zero"] == "none" and q["dequantize_linear"]["int4"] == 5 * entry["num_layers"]
        assert q["dequantize_linear"]["int8"] == 1  # the head, int8 under the exact scheme
        assert entry["attention"] == "exact"  # a quantized draft's fused default does not apply
    assert check_bundle(out) == []
    session = Session(out)
    session.eos_token_ids = []
    for prompt in PROMPTS[:4]:
        plain = session.generate(prompt, max_new_tokens=20, speculate=False)
        for k in (1, 3, 8):
            assert session.generate(prompt, max_new_tokens=20, draft_len=k).token_ids == plain.token_ids, (prompt, k)


@pytest.mark.bundle
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3_text", "smollm3",
                                  "gpt_oss", "gemma4_text"])
def test_every_family_exported_for_tensorrt_by_default_passes_check_trt(arch, tmp_path):
    """--for tensorrt with no other choice: fp16 (fp32 for Gemma and gpt-oss, whose activations
    overflow fp16), a self-draft, and check-trt run by export itself (it raises on a refused node); the
    bundle decodes on ONNX Runtime's CPU provider, speculative == plain."""
    tiny.make_model(tmp_path / "m", arch, layers=2)
    lines: list[str] = []
    build_bundle(tmp_path / "m", "self:layers=1", tmp_path / "b", max_seq=64, dtype=None, device="tensorrt",
                 log=lines.append)
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    want = "fp16" if ARCHITECTURES[arch].fp16 else "fp32"
    assert {e["dtype"] for e in manifest["models"].values()} == {want}
    assert f"--for tensorrt: --dtype {want}" in lines and check_bundle(tmp_path / "b") == []
    session = Session(tmp_path / "b")
    session.eos_token_ids = []
    plain = session.generate(PROMPTS[1], max_new_tokens=16, speculate=False)
    for k in (1, 4):
        assert session.generate(PROMPTS[1], max_new_tokens=16, draft_len=k).token_ids == plain.token_ids, k


@pytest.mark.parametrize("choice", [dict(attention="fused"), dict(quant_scheme="fast"), dict(draft_attention="fused"),
                                    dict(dtype="bf16")])
def test_contrib_op_choices_for_tensorrt_are_one_line(choice, llama, tmp_path):
    with pytest.raises(ExportError) as e:
        build_bundle(llama, "self:layers=1", tmp_path / "b", max_seq=64, device="tensorrt", **{"dtype": "int4", **choice})
    assert "--for tensorrt" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "b").exists()


def test_an_unknown_device_is_one_line(llama, tmp_path):
    with pytest.raises(ExportError, match="--for 'tpu': expected one of cpu, cuda, tensorrt"):
        build_bundle(llama, "none", tmp_path / "b", device="tpu")


@pytest.mark.bundle
def test_a_bf16_bundle_runs_on_the_torch_backend_losslessly_and_ort_refuses_it_in_one_line(llama, tmp_path):
    """bf16 weights and KV: the ONNX graphs hold bfloat16; the torch backend runs the bundle (here on
    the CPU), speculative == plain token for token, its logits near the source's own bf16 forward;
    ONNX Runtime, with no bfloat16 CPU kernels, refuses it in one line."""
    import onnx
    import torch
    from transformers import AutoModelForCausalLM

    from specdeploy.core.errors import InputError
    from specdeploy.runtime.backends import make_engine

    out = tmp_path / "b"
    build_bundle(llama, "self:layers=1", out, max_seq=128, max_draft=8, dtype="bf16", prefill_chunk=16, device="cuda")
    manifest = json.loads((out / "manifest.json").read_text())
    assert {(e["dtype"], e["kv_dtype"]) for e in manifest["models"].values()} == {("bf16", "bfloat16")}
    graph = onnx.load(str(out / "target.onnx"))
    assert {t.data_type for t in graph.graph.initializer if len(t.dims) == 2} == {onnx.TensorProto.BFLOAT16}
    with pytest.raises(InputError) as e:
        Session(out)
    assert "bf16 graph" in str(e.value) and "--backend torch" in str(e.value) and "\n" not in str(e.value)
    session = Session(out, backend="torch")
    session.eos_token_ids = []
    for prompt in PROMPTS[:4]:
        plain = session.generate(prompt, max_new_tokens=20, speculate=False)
        for k in (1, 3, 8):
            assert session.generate(prompt, max_new_tokens=20, draft_len=k).token_ids == plain.token_ids, (prompt, k)
    ids = np.array(session.encode(" ".join(PROMPTS[:6])))[:48]
    engine = make_engine("torch", session.bundle, session.bundle.model("target"), None)
    got = np.concatenate([engine.forward(ids[a : a + 16], a).copy() for a in range(0, len(ids), 16)])
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)[None]).logits[0].float().numpy()
    assert np.abs(got - want).max() <= 0.08 * np.abs(want).max()  # PARITY_RTOL["bf16"]
