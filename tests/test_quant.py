"""Quantized graphs: the ops against their eager meaning, GGUF block decoding against gguf-py,
bundles of every dtype, losslessness for a quantized target and a quantized draft."""
import json

import numpy as np
import pytest
import torch

from conftest import MAX_SEQ, PREFILL_CHUNK
from tiny import PROMPTS

from specdeploy.export.ops import rope_caches, rotary
from specdeploy.export.graph import _rotate_half
from specdeploy.export.quantize import (
    ACCURACY_LEVEL, BLOCK, GGUF_TYPES, Blocks, gather_block_quantized, gguf_blocks, matmul_nbits, pack, quantize_float,
)
from specdeploy.runtime import Session


def _single_node_session(op: str, inputs: dict, initializers: dict, order: list[str] | None = None, **attrs):
    """An ONNX Runtime session over one contrib op, with the attributes our exporter writes.
    Its inputs: the graph inputs, then the initializers, or the names in `order`."""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from specdeploy.export.ops import DOMAIN

    node = helper.make_node(op, order or [*inputs, *initializers], ["y"], domain=DOMAIN, **attrs)
    elem = {np.float32: onnx.TensorProto.FLOAT, np.int64: onnx.TensorProto.INT64}
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, elem[v.dtype.type], list(v.shape)) for n, v in inputs.items()],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, n) for n, v in initializers.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _random_gguf_blocks(kind: str, n: int, k: int, seed: int = 0) -> Blocks:
    rng = np.random.default_rng(seed)
    size, per, _, _ = GGUF_TYPES[kind]
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for at in FLOAT16_AT[kind]:
        raw[..., at:at + 2] = rng.uniform(-0.1, 0.1, size=(n, k // per, 1)).astype(np.float16).view(np.uint8)
    return gguf_blocks(kind, raw.reshape(n, -1), n, k)


@pytest.mark.parametrize("form", ["float4", "float8", *sorted(GGUF_TYPES)])
@pytest.mark.parametrize("rows", [1, 5])
def test_matmul_nbits_node_equals_its_eager_meaning(form, rows):
    """ONNX Runtime's MatMulNBits (accuracy level 4) on our packing == the eager op, which
    dequantizes the blocks and rounds activations to int8 blocks the same way: blocks quantized
    here, and every GGUF type's own (4- and 8-bit storage, blocks of 16 and 32, zero points)."""
    rng = np.random.default_rng(rows)
    n, k = 96, 256
    if form.startswith("float"):
        blocks = quantize_float(rng.standard_normal((n, k)).astype(np.float32), int(form[5:]))
    else:
        blocks = _random_gguf_blocks(form, n, k, seed=rows)
    blocks.mins = None  # the block minimum is a separate term in the graph, tested end to end
    packed, scales, zp = pack(blocks)
    x = (rng.standard_normal((1, rows, k)) * 3).astype(np.float32)
    sess = _single_node_session(
        "MatMulNBits", {"x": x}, {"B": packed, "s": scales, "z": zp}, K=k, N=n, bits=blocks.bits,
        block_size=blocks.block, accuracy_level=ACCURACY_LEVEL,
    )
    got = sess.run(None, {"x": x})[0]
    want = matmul_nbits(*map(torch.from_numpy, (x, packed, scales, zp)), k, n, blocks.bits, blocks.block).numpy()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-5 * scale
    # and the eager op is the dequantized weight (up to the activation rounding it models)
    plain = x @ blocks.dequantize().T
    assert np.abs(want - plain).max() <= 0.05 * scale


def test_gather_block_quantized_node_equals_its_eager_meaning():
    """ONNX Runtime's GatherBlockQuantized over MatMulNBits' own 4-bit packing (the fast
    scheme's embedding reads the tied head's blocks) == the eager op == the dequantized rows."""
    rng = np.random.default_rng(3)
    n, k = 70, 96
    blocks = quantize_float(rng.standard_normal((n, k)).astype(np.float32), 4, "none")
    packed, scales, _ = pack(blocks)
    ids = np.array([[0, 5, 69, 5], [12, 1, 33, 68]], dtype=np.int64)
    sess = _single_node_session(
        "GatherBlockQuantized", {"ids": ids}, {"data": packed.reshape(n, k // 2), "s": scales.reshape(n, k // BLOCK)},
        order=["data", "ids", "s"], gather_axis=0, quantize_axis=1, block_size=BLOCK, bits=4,
    )
    got = sess.run(None, {"ids": ids})[0]
    want = gather_block_quantized(torch.from_numpy(packed), torch.from_numpy(ids), torch.from_numpy(scales), n, k).numpy()
    assert got.shape == (2, 4, k) and np.array_equal(got, want)
    assert np.array_equal(want, blocks.dequantize()[ids])


def test_rotary_node_equals_the_standard_op_rope():
    rng = np.random.default_rng(0)
    heads, d, t = 3, 16, 5
    inv_freq = torch.tensor(1.0 / (10000 ** (np.arange(0, d, 2) / d)), dtype=torch.float32)
    cos, sin = rope_caches(inv_freq, 1.0, 64)
    x = rng.standard_normal((1, t, heads * d)).astype(np.float32)
    pos = np.arange(7, 7 + t, dtype=np.int64)[None]
    sess = _single_node_session(
        "RotaryEmbedding", {"x": x, "pos": pos}, {"cos": cos.numpy(), "sin": sin.numpy()}, interleaved=0, num_heads=heads
    )
    got = sess.run(None, {"x": x, "pos": pos})[0]
    eager = rotary(torch.from_numpy(x), torch.from_numpy(pos), cos, sin, heads).numpy()
    # the fp32/fp16 graphs' formula: x * cos + rotate_half(x) * sin over full-width angles
    freqs = torch.from_numpy(pos)[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), -1)[:, None]  # [1, 1, T, D]
    xh = torch.from_numpy(x).view(1, t, heads, d).transpose(1, 2)
    standard = (xh * emb.cos() + _rotate_half(xh) * emb.sin()).transpose(1, 2).reshape(1, t, heads * d).numpy()
    assert np.abs(got - eager).max() < 1e-5
    assert np.abs(eager - standard).max() < 1e-5


# Where each block type keeps its float16 fields (d, and m or dmin), by byte offset.
FLOAT16_AT = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def test_every_gguf_type_has_its_float16_fields_listed():
    assert sorted(FLOAT16_AT) == sorted(GGUF_TYPES)


@pytest.mark.parametrize("kind", sorted(GGUF_TYPES))
def test_gguf_blocks_decode_as_gguf_py_dequantizes(kind):
    """Our reading of ggml's block layout, against gguf-py's reference dequantizer, bit for bit:
    random bytes (every field's every bit pattern) under finite float16 scales."""
    import gguf

    rng = np.random.default_rng(len(kind) + ord(kind[1]))
    size, per, bits, block = GGUF_TYPES[kind]
    n, k = 6, 2 * per
    raw = rng.integers(0, 256, size=(n, k // per, size), dtype=np.uint8)
    for at in FLOAT16_AT[kind]:
        raw[..., at:at + 2] = rng.uniform(-0.1, 0.1, size=(n, k // per, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(n, -1)
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(n, k)
    blocks = gguf_blocks(kind, raw, n, k)
    assert (blocks.bits, blocks.block) == (bits, block) and blocks.q.max() < 1 << bits
    assert np.array_equal(blocks.dequantize(), want)


def test_a_wrong_gguf_decoder_fails_the_comparison():
    """Companion: the comparison above catches a decoder that misreads one field (Q6_K's zero)."""
    import gguf

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(2, 1, 210), dtype=np.uint8)
    raw[..., 208:210] = rng.uniform(0.01, 0.1, size=(2, 1, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(2, -1)
    blocks = gguf_blocks("Q6_K", raw, 2, 256)
    blocks.zero[:] = 31
    assert not np.array_equal(blocks.dequantize(), gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K))


@pytest.mark.parametrize("bits", [4, 8])
def test_float_quantization_error_is_at_most_half_a_step(bits):
    w = np.random.default_rng(bits).standard_normal((8, 64)).astype(np.float32)
    b = quantize_float(w, bits)
    step = np.repeat(b.scale, BLOCK, axis=1)
    assert (np.abs(b.dequantize() - w) <= step / 2 + 1e-6).all()
    assert b.q.max() <= (15 if bits == 4 else 255)


def test_blocks_concat_and_rows_keep_values():
    rng = np.random.default_rng(3)
    a, b = (quantize_float(rng.standard_normal((n, 64)).astype(np.float32), 4) for n in (4, 6))
    fused = Blocks.concat([a, b])
    assert np.array_equal(fused.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    rows = np.array([3, 0, 2, 1])
    assert np.array_equal(a.take_rows(rows).dequantize(), a.dequantize()[rows])


# -- bundles -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quant_bundles(models, shared, tmp_path_factory):
    from specdeploy.export import build_bundle

    root = tmp_path_factory.mktemp("quant")
    made = {}

    def get(name):
        if name not in made:
            target, draft, dtype, draft_dtype = {
                "int4-self": ("llama", "self:layers=1", "int4", None),  # quantized target and draft
                "int8-self": ("llama", "self:layers=1", "int8", None),
                "fp32-int4draft": ("llama", str(models["llama_draft"]), "fp32", "int4"),  # quantized draft only
                "fp16-none": ("llama", "none", "fp16", None),
            }[name]
            build_bundle(models[target], draft, root / name, max_seq=MAX_SEQ, max_draft=8, dtype=dtype,
                         prefill_chunk=PREFILL_CHUNK, draft_dtype=draft_dtype, cache=shared / "graphs")
            made[name] = root / name
        return made[name]

    return get


@pytest.mark.parametrize("name", ["int4-self", "int8-self", "fp32-int4draft", "fp16-none"])
def test_each_dtype_exports_loads_and_runs(quant_bundles, name):
    path = quant_bundles(name)
    manifest = json.loads((path / "manifest.json").read_text())
    for role, entry in manifest["models"].items():
        q = entry.get("quantization")
        if entry["dtype"] in ("int4", "int8"):
            bits = int(entry["dtype"][3:])
            # both keep the exact scheme (head int8); a quantized draft's graph is the fused one
            fused = role == "draft"
            assert q["quant_scheme"] == "exact" and entry["attention"] == ("fused" if fused else "exact")
            head = 8
            assert q["scheme"] == entry["dtype"] and q["linear_bits"] == bits and q["head_bits"] == head
            layers = entry["num_layers"]
            want = {f"float->int{bits}": 7 * layers}
            want[f"float->int{head}"] = want.get(f"float->int{head}", 0) + 1  # the head
            assert q["tensors"] == want
            assert q["imported_exactly"] == 0 and q["quantized_from_float"] == 7 * layers + 1
            # the target's K/V in float16 (export's default for an int target on the CPU), the draft's float32
            assert entry["kv_dtype"] == ("float32" if fused else "float16")
            graph = (path / entry["graph"]).read_bytes()
            assert b"MatMulNBits" in graph
            assert (b"GroupQueryAttention" if fused else b"RotaryEmbedding") in graph
        else:
            assert q is None
    session = Session(path)
    session.eos_token_ids = []  # every requested token comes back
    for prompt in PROMPTS[:4]:
        plain = session.generate(prompt, max_new_tokens=12, speculate=False)
        assert len(plain.token_ids) == 12 and plain.stats.finish_reason == "length"
        for k in (2, 8):
            spec = session.generate(prompt, max_new_tokens=12, draft_len=k)
            assert spec.token_ids == plain.token_ids, (prompt, k)
    # Each graph's logits against its float source model (a self draft: the source's first
    # layers with its norm and head) over a 60-token sequence, as relative RMS error. Measured
    # on these tiny random models: int4 0.17-0.23, int8 <= 0.025, fp16 7e-4, fp32 5e-7; a 4-bit
    # rounding that floors instead of rounds gives 0.3-1.2, scales 5% off give 0.27-0.72 (int4)
    # and 0.08-0.1 (int8).
    bound = {"int4": 0.35, "int8": 0.05, "fp16": 5e-3, "fp32": 1e-4}
    from transformers import AutoModelForCausalLM

    from specdeploy.runtime.backends import make_engine

    ids = np.array(session.encode(" ".join(PROMPTS[:6])))[:60]
    assert len(ids) == 60
    chunk = session.bundle.prefill_chunk
    for role in manifest["models"]:
        spec = session.bundle.model(role)
        engine = make_engine("ort", session.bundle, spec, None)
        got = np.concatenate([engine.forward(ids[a : a + chunk], a).copy() for a in range(0, len(ids), chunk)])
        source = AutoModelForCausalLM.from_pretrained(spec.source, dtype=torch.float32).eval()
        source.model.layers = source.model.layers[: spec.num_layers]
        with torch.no_grad():
            want = source(torch.from_numpy(ids)[None]).logits[0].numpy()
        error = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert error <= bound[spec.dtype], (role, spec.dtype, error)


def test_fp16_bundle_records_fp16_kv(quant_bundles):
    entry = json.loads((quant_bundles("fp16-none") / "manifest.json").read_text())["models"]["target"]
    assert entry["dtype"] == "fp16" and entry["kv_dtype"] == "float16"


@pytest.mark.parametrize("name", ["int4-self", "int8-self", "fp32-int4draft"])
def test_speculation_is_lossless_over_quantized_engines(quant_bundles, name):
    """Greedy speculative output == plain decoding of the same (quantized) target, on every
    prompt, at several draft lengths."""
    session = Session(quant_bundles(name))
    drafted = 0
    for prompt in PROMPTS:
        plain = session.generate(prompt, max_new_tokens=24, speculate=False)
        for k in (1, 4, "auto"):
            spec = session.generate(prompt, max_new_tokens=24, draft_len=k)
            assert spec.token_ids == plain.token_ids, (prompt, k)
            drafted += spec.stats.drafted
    assert drafted > 0


def test_int4_verify_rows_equal_single_steps(quant_bundles):
    """What losslessness rests on: MatMulNBits rounds each row's activations on its own, so a
    verify pass's rows are bit-identical to single steps at the same positions."""
    session = Session(quant_bundles("int4-self"))
    engine = session.target
    ids = np.random.default_rng(0).integers(0, engine.vocab_size, 60)
    engine.forward(ids[:20], 0)
    for start in (20, 29, 38):
        multi = engine.forward(ids[start : start + 9], start).copy()
        single = np.stack([engine.forward(ids[start + i : start + i + 1], start + i)[0].copy() for i in range(9)])
        assert np.array_equal(multi, single)


def test_a_width_that_blocks_cannot_tile_is_a_one_line_error(tmp_path):
    import tiny

    from specdeploy.export import build_bundle
    from specdeploy.core.errors import ExportError

    tiny.make_model(tmp_path / "m", "llama", seed=0, layers=1, hidden_size=48, num_attention_heads=4,
                    num_key_value_heads=2)
    with pytest.raises(ExportError, match=r"input dimension 48 is not a multiple of the 32-weight block"):
        build_bundle(tmp_path / "m", "none", tmp_path / "b", max_seq=32, dtype="int4")
    assert not (tmp_path / "b").exists()
