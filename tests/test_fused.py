"""The fused graph (--attention fused) and the fast quantization scheme: every fused op against
its eager meaning, bundles that use them, and the exactness each one keeps."""
import json

import numpy as np
import onnx
import pytest
import torch

from conftest import MAX_SEQ, PREFILL_CHUNK
from test_quant import _single_node_session
from tiny import PROMPTS

from specdeploy.core.errors import ExportError
from specdeploy.export.ops import DOMAIN, fused_attention_eager, rope_caches, skip_rms_norm
from specdeploy.export.graph import kv_write_inplace
from specdeploy.export.quantize import ACCURACY_LEVEL, BLOCK, matmul_nbits, pack, quantize_float
from specdeploy.runtime import Session


@pytest.mark.parametrize("zero", ["none", "int"])
def test_fast_4bit_forms_need_no_minimum_term(zero):
    """Symmetric (zero point 8) and integer-zero-point blocks: no float minimum, and every
    weight within one step of its value (a block's extreme may be clipped by one step)."""
    w = np.random.default_rng(len(zero)).standard_normal((16, 128)).astype(np.float32)
    b = quantize_float(w, 4, zero)
    assert b.mins is None
    step = np.abs(np.repeat(b.scale, BLOCK, axis=1))
    err = np.abs(b.dequantize() - w)
    assert (err <= step + 1e-6).all()
    assert err.mean() <= 0.3 * step.mean()  # round to nearest: about a quarter step on average
    if zero == "none":
        assert (b.zero == 8).all()
    else:
        assert b.zero.min() >= 0 and b.zero.max() <= 15


@pytest.mark.parametrize("rows", [1, 4])
def test_symmetric_matmul_nbits_without_zero_points_equals_its_eager_meaning(rows):
    """No zero-point input: ONNX Runtime takes 8 for every block, as the eager op does."""
    rng = np.random.default_rng(rows)
    n, k = 64, 96
    blocks = quantize_float(rng.standard_normal((n, k)).astype(np.float32), 4, "none")
    packed, scales, _ = pack(blocks)
    x = (rng.standard_normal((1, rows, k)) * 2).astype(np.float32)
    sess = _single_node_session("MatMulNBits", {"x": x}, {"B": packed, "s": scales}, K=k, N=n, bits=4,
                                block_size=BLOCK, accuracy_level=ACCURACY_LEVEL)
    got = sess.run(None, {"x": x})[0]
    want = matmul_nbits(torch.from_numpy(x), torch.from_numpy(packed), torch.from_numpy(scales), None, k, n, 4).numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_skip_norm_node_equals_its_eager_meaning():
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    x, skip = (rng.standard_normal((1, 5, 64)).astype(np.float32) for _ in range(2))
    gamma = rng.standard_normal(64).astype(np.float32)
    node = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["y", "", "", "sum"],
                            domain=DOMAIN, epsilon=1e-5)
    vi = lambda n: helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [1, 5, 64])  # noqa: E731
    graph = helper.make_graph([node], "g", [vi("x"), vi("skip")], [vi("y"), vi("sum")],
                              [numpy_helper.from_array(gamma, "gamma")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got_y, got_sum = sess.run(None, {"x": x, "skip": skip})
    want_y, want_sum = skip_rms_norm(torch.from_numpy(x), torch.from_numpy(skip), torch.from_numpy(gamma), 1e-5)
    assert np.array_equal(got_sum, want_sum.numpy())
    assert np.abs(got_y - want_y.numpy()).max() < 1e-5


def _gqa_session(heads, kv_heads, d, max_seq, cos, sin):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto as P
    from onnx import helper, numpy_helper

    width = (heads + 2 * kv_heads) * d
    node = helper.make_node(
        "GroupQueryAttention", ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin"],
        ["out", "present_key", "present_value"], domain=DOMAIN, num_heads=heads, kv_num_heads=kv_heads, do_rotary=1,
        rotary_interleaved=0, scale=d**-0.5,
    )
    cache = [1, kv_heads, max_seq, d]
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("qkv", P.FLOAT, [1, "T", width]),
         helper.make_tensor_value_info("past_key", P.FLOAT, cache), helper.make_tensor_value_info("past_value", P.FLOAT, cache),
         helper.make_tensor_value_info("seqlens_k", P.INT32, [1]), helper.make_tensor_value_info("total", P.INT32, [])],
        [helper.make_tensor_value_info("out", P.FLOAT, [1, "T", heads * d]),
         helper.make_tensor_value_info("present_key", P.FLOAT, cache),
         helper.make_tensor_value_info("present_value", P.FLOAT, cache)],
        [numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_group_query_attention_node_equals_its_eager_meaning():
    """GroupQueryAttention with past and present bound to one buffer (as the runtime binds
    them): prefill, steps, verify passes and a chunk at later positions, against the eager
    meaning our exporter translates it from (rotary, KV write at the write index, causal
    attention over the first L slots). Outputs and the written cache rows agree to 1e-5."""
    import onnxruntime as ort

    from specdeploy.core.graph_io import attention_mask

    heads, kv_heads, d, max_seq = 6, 2, 16, 48
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rope_caches(inv_freq, 1.0, max_seq)
    sess = _gqa_session(heads, kv_heads, d, max_seq, cos.numpy(), sin.numpy())
    key, value = (np.zeros((1, kv_heads, max_seq, d), np.float32) for _ in range(2))
    ref_key, ref_value = (torch.zeros(1, kv_heads, max_seq, d) for _ in range(2))
    binding = sess.io_binding()
    for name, array in (("key", key), ("value", value)):
        buffer = ort.OrtValue.ortvalue_from_numpy(array)
        binding.bind_ortvalue_input(f"past_{name}", buffer)
        binding.bind_ortvalue_output(f"present_{name}", buffer)
    rng = np.random.default_rng(0)
    for start, t in ((0, 9), (9, 1), (10, 4), (14, 1), (15, 7)):
        qkv = rng.standard_normal((1, t, (heads + 2 * kv_heads) * d)).astype(np.float32)
        binding.bind_cpu_input("qkv", qkv)
        binding.bind_cpu_input("seqlens_k", np.array([start + t - 1], np.int32))
        binding.bind_cpu_input("total", np.array(start + t, np.int32))
        binding.bind_output("out")
        sess.run_with_iobinding(binding)
        got = binding.copy_outputs_to_cpu()[-1]
        want, _, _ = fused_attention_eager(
            torch.from_numpy(qkv), ref_key, ref_value, torch.tensor([start]),
            torch.from_numpy(attention_mask(start, t, None)), cos, sin, heads, kv_heads, d**-0.5, kv_write_inplace,
        )
        assert np.abs(got - want.numpy()).max() < 1e-5, (start, t)
        assert np.abs(key[:, :, : start + t] - ref_key[:, :, : start + t].numpy()).max() < 1e-5
        assert np.abs(value - ref_value.numpy()).max() < 1e-6


# -- bundles -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fused_bundles(models, shared, tmp_path_factory):
    from specdeploy.export import build_bundle

    root = tmp_path_factory.mktemp("fused")
    made = {}

    def get(name):
        if name not in made:
            target, draft, options = {
                "fp32-fused": ("llama", "none", dict(attention="fused")),
                "int4-fast-fused": ("llama", "none", dict(dtype="int4", quant_scheme="fast", attention="fused")),
                # the default draft graph of a quantized self-draft: fused, the exact scheme
                "fp32-selfint4": ("llama", "self:dtype=int4", dict()),
            }[name]
            build_bundle(models[target], draft, root / name, max_seq=MAX_SEQ, max_draft=8, prefill_chunk=PREFILL_CHUNK,
                         cache=shared / "graphs", **options)
            made[name] = root / name
        return made[name]

    return get


def _ops(path):
    import onnx

    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def test_fused_graph_uses_the_fused_ops_and_records_it(fused_bundles):
    import onnx

    path = fused_bundles("fp32-fused")
    ops = _ops(path / "target.onnx")
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops
    # its norms write no statistics nothing reads (they cost time when named)
    nodes = onnx.load(str(path / "target.onnx"), load_external_data=False).graph.node
    norms = [n for n in nodes if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert norms and all(list(n.output[1:3]) in (["", ""], []) and n.output[0] for n in norms)
    assert sum(len(n.output) == 4 and bool(n.output[3]) for n in norms) == len(norms) - 1  # all but the last carry the sum
    assert not {"TensorScatter", "Softmax"} & ops
    # each attention reads q|k|v packed from one MatMul, not three MatMuls and a Concat
    producer = {out: n for n in nodes for out in n.output}
    attention = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    assert attention and all(producer[n.input[0]].op_type == "MatMul" for n in attention)
    assert "Concat" not in {producer[i].op_type for n in attention for i in producer[n.input[0]].input if i in producer}
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["models"]["target"]["attention"] == "fused"
    assert manifest["models"]["target"]["parity"]["max_rel_diff_ort_vs_eager"] <= 1e-4


def test_fused_fp32_verify_rows_equal_single_steps_up_to_rounding(fused_bundles):
    """What the fused graph gives up, measured: its rows are not bit-identical to single
    steps (the exact graph's are: tests/test_quant.py), but equal to float rounding."""
    engine = Session(fused_bundles("fp32-fused")).target
    ids = np.random.default_rng(0).integers(0, engine.vocab_size, 40)
    engine.forward(ids[:20], 0)
    multi = engine.forward(ids[20:26], 20).copy()
    single = np.stack([engine.forward(ids[20 + i : 21 + i], 20 + i)[0].copy() for i in range(6)])
    assert np.abs(multi - single).max() <= 1e-5 * max(1.0, np.abs(single).max())


def test_fast_int4_fused_target_runs_and_records_its_scheme(fused_bundles):
    path = fused_bundles("int4-fast-fused")
    q = json.loads((path / "manifest.json").read_text())["models"]["target"]["quantization"]
    assert (q["quant_scheme"], q["zero"], q["head_bits"], q["imported_exactly"]) == ("fast", "none", 4, 0)
    assert q["embedding"] in ("int4", "int4 (the head's blocks)")
    graph = onnx.load(str(path / "target.onnx"), load_external_data=False).graph
    lookups = {n.op_type for n in graph.node if "input_ids" in n.input}
    assert lookups == {"GatherBlockQuantized"}  # no float table: the one Gather left picks the head's rows
    result = Session(path).generate(PROMPTS[0], max_new_tokens=12, speculate=False)
    assert len(result.token_ids) == 12


def test_parity_check_catches_a_wrong_quantized_embedding(models, tmp_path):
    """The int graphs' export check (on text) passes the fast graph and refuses the same graph
    against an eager module whose embedding unpacks its nibbles in the wrong order."""
    from specdeploy.export.build import model_entry, source_graph
    from specdeploy.export.load import load_source
    from specdeploy.export.onnx_export import PARITY_TEXT, TORCH_DTYPE, check_parity, export_onnx

    source = load_source(models["llama"])
    graph = source_graph(source, "int4", quant_scheme="fast")
    graph.use_contrib_ops(MAX_SEQ, fused=True)
    export_onnx(graph, tmp_path / "t.onnx", MAX_SEQ, TORCH_DTYPE["int4"], optimize=False)
    spec = model_entry(graph, source, "target", "t.onnx", "int4", MAX_SEQ)
    text = source.tokenizer.encode(PARITY_TEXT)
    check = lambda: check_parity(graph, tmp_path / "t.onnx", spec, MAX_SEQ, 8, PREFILL_CHUNK, "int4", text_ids=text)  # noqa: E731
    assert check()["max_rel_diff_ort_vs_eager"] <= 0.25
    packed = graph.embed_tokens.packed
    graph.embed_tokens.packed = ((packed & 0x0F) << 4) | (packed >> 4)
    with pytest.raises(ExportError, match="differ from PyTorch eager"):
        check()


def test_a_fused_quantized_self_draft_stays_lossless(fused_bundles):
    """The default self-draft graph is fused: it owes no exactness, the exact target still
    decides every token (greedy speculative == plain on every prompt)."""
    path = fused_bundles("fp32-selfint4")
    draft = json.loads((path / "manifest.json").read_text())["models"]["draft"]
    assert draft["attention"] == "fused" and draft["quantization"]["quant_scheme"] == "exact"
    session = Session(path)
    accepted = 0
    for prompt in PROMPTS:
        plain = session.generate(prompt, max_new_tokens=20, speculate=False)
        for k in (2, 5):
            spec = session.generate(prompt, max_new_tokens=20, draft_len=k)
            assert spec.token_ids == plain.token_ids, (prompt, k)
            accepted += spec.stats.accepted
    assert accepted > 0


def test_fused_attention_with_a_sliding_window_is_a_one_line_error(models, tmp_path):
    from specdeploy.export import build_bundle

    with pytest.raises(ExportError, match=r"--attention fused: .* sliding window of 40"):
        build_bundle(models["mistral"], "none", tmp_path / "b", max_seq=MAX_SEQ, attention="fused")
    assert not (tmp_path / "b").exists()


def test_a_fused_quantized_target_with_a_draft_is_refused(models, tmp_path):
    """Its rows differ from single steps past near-ties (measured on SmolLM2 int4: 15 of 20
    prompts' speculative output left plain's, margins 0.03-0.26): speculation would not be
    lossless, so only plain decoding (--draft none) may use it."""
    from specdeploy.export import build_bundle

    with pytest.raises(ExportError, match=r"--attention fused with an int4 target: .* --draft none"):
        build_bundle(models["llama"], "ngram", tmp_path / "b", max_seq=MAX_SEQ, dtype="int4", attention="fused")
    assert not (tmp_path / "b").exists()
