"""TensorRT: what can be proved without TensorRT or a GPU, and the real thing where they exist.

- the static op check (the parser's support table as data) on our graphs and on a bad one;
- the pure bookkeeping: profiles from the manifest, 256-byte alignment, the padded window,
  the graph-per-shape cache against a fake stream (capture failure included);
- the TrtEngine and build_engines code paths against a fake TensorRT and a fake CUDA stream
  whose "kernel" is ONNX Runtime on the same graph (tests/trt_fakes.py): the host side
  (staging, one copy each way, one synchronisation, addresses set once, KV aliased in place,
  graph replay) must give ONNX Runtime's logits and the same greedy tokens through the
  unchanged speculative loop;
- the fused greedy round (the build's argmax output, device-to-device token copies, one
  staging slot per draft step, the target's stream waiting on the draft's event): the
  per-pass tokens, one synchronisation per round, only tokens coming down; engines built
  without the output, and sampled rounds, keep the per-pass round and its output;
- with real TensorRT and a GPU (skipped here, with the reason): the same on a real engine.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from specdeploy.core.errors import BundleError, ExportError
from specdeploy.core.graph_io import attention_mask, fill_mask, window_length
from specdeploy.core.trt_profiles import profiles_for, select_profile
from specdeploy.export.trt_build import build_engines, build_profiles, default_timing_cache, profile_shapes
from specdeploy.export.trt_ops import check_bundle, check_graph, load_table
from specdeploy.runtime import load_bundle
from specdeploy.runtime.backends.ort import OrtEngine
from specdeploy.runtime.backends.trt import TrtEngine
from specdeploy.runtime.backends.trt_layout import ALIGNMENT, ShapeKey, StepGraphs, align_up, engine_layout, plan_layout
from specdeploy.runtime.backends.trt_plan import check_engine_compat
from trt_fakes import FakeCudart, FakeDriver, FakeTensorRT

# -- the operator table and the static check --------------------------------------------------------


def test_op_table_records_version_and_source():
    table = load_table()
    assert table.tensorrt_version == "10.15" and (table.opset_min, table.opset_max) == (9, 24)
    assert table.source["repository"] == "https://github.com/onnx/onnx-tensorrt"
    assert table.source["path"] == "docs/operators.md" and table.source["url"].startswith("https://")
    scatter = table.operators["TensorScatter"]
    assert scatter["supported"] and "`axis` must be -2" in scatter["restrictions"]
    assert not table.operators["Unique"]["supported"]
    assert all(set(e) == {"supported", "types", "restrictions"} for e in table.operators.values())


def test_our_tiny_graphs_pass(bundles):
    bundle = bundles("llama-self")  # target and a layer-truncated draft: two graphs
    assert check_bundle(bundle) == []
    import onnx

    for role in ("target", "draft"):
        ops = {n.op_type for n in onnx.load(str(bundle / f"{role}.onnx"), load_external_data=False).graph.node}
        assert {"TensorScatter", "Softmax", "MatMul"} <= ops  # the KV write and the attention were checked


def _bad_graph(path: Path) -> Path:
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h

    f = lambda name, dims, t=T.FLOAT: h.make_tensor_value_info(name, t, dims)  # noqa: E731
    nodes = [
        h.make_node("Unique", ["x"], ["u"], name="dedupe"),
        h.make_node("GroupQueryAttention", ["x"], ["g"], name="ort_gqa", domain="com.microsoft"),
        h.make_node("Identity", ["past"], ["past_copy"], name="copy"),
        h.make_node("TensorScatter", ["past_copy", "upd", "wi"], ["present"], name="kv_write", axis=2, mode="circular"),
        h.make_node("Shape", ["x"], ["axes"], name="shape"),
        h.make_node("ReduceMean", ["x", "axes"], ["m"], name="mean"),
    ]
    graph = h.make_graph(
        nodes, "bad",
        [f("past", [1, 2, 16, 4]), f("upd", [1, 2, 3, 4], T.FLOAT16), f("wi", [1], T.INT64), f("x", [5])],
        [f("present", [1, 2, 16, 4]), f("u", None), f("g", None), f("m", None)],
        value_info=[f("past_copy", [1, 2, 16, 4])],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 24), h.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path))
    return path


def test_a_graph_with_unsupported_operators_fails_naming_node_and_reason(tmp_path):
    problems = check_graph(_bad_graph(tmp_path / "bad.onnx"))
    by_node = {}
    for p in problems:
        by_node.setdefault(p.node, []).append(p.reason)
    assert set(by_node) == {"dedupe", "ort_gqa", "kv_write", "mean"}
    assert "not supported" in by_node["dedupe"][0]
    assert "com.microsoft" in by_node["ort_gqa"][0]
    kv = " | ".join(by_node["kv_write"])
    assert "`axis` is 2; it must be -2" in kv and "LINEAR" in kv and "network input" in kv
    assert "`past_cache` is FP32 but `update` is FP16" in kv
    assert "`axes`" in by_node["mean"][0]
    assert str(problems[0]).startswith("bad.onnx: node 'dedupe' (Unique): ")


def test_check_bundle_names_a_kv_alias_tensorrt_would_not_honour(bundles, tmp_path):
    bundle = tmp_path / "b"
    shutil.copytree(bundles("llama-self"), bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    aliases = manifest["models"]["target"]["kv_aliases"]
    aliases["present_key_0"] = "past_value_0"  # not what the graph's TensorScatter writes
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    problems = check_bundle(bundle)
    assert [(p.node, p.op_type, p.graph) for p in problems] == [("present_key_0", "TensorScatter", "target.onnx")]
    assert "would not alias" in problems[0].reason


# -- profiles, alignment, the padded window -----------------------------------------------------------


def test_profile_shapes_follow_the_manifest():
    manifest = SimpleNamespace(max_seq=128, max_draft=8, prefill_chunk=16)
    profiles = build_profiles(manifest)
    assert [(p.name, p.t_min, p.t_max) for p in profiles] == [("step", 1, 1), ("verify", 2, 9), ("prefill", 10, 16)]
    for t in range(1, 17):  # the T ranges partition 1..max(k+1, chunk)
        assert sum(p.t_min <= t <= p.t_max for p in profiles) == 1 and select_profile(profiles, t) >= 0
    assert select_profile(profiles, 17) == -1
    for shapes in profile_shapes(manifest):
        assert set(shapes) == {"input_ids", "position_ids", "attention_mask"}
        for lo, opt, hi in shapes.values():
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi))
        assert shapes["attention_mask"][2][3] == 128  # L up to max_seq
    # A prefill chunk no longer than a verify pass needs no profile of its own.
    assert [p.name for p in profiles_for(128, 8, 8)] == ["step", "verify"]


def test_alignment_and_layout():
    assert [align_up(n) for n in (0, 1, 255, 256, 257)] == [0, 256, 256, 256, 512]
    # SmolLM2-135M's target: 60 KV buffers [1, 3, 1024, 64] fp32, V = 49152, T up to 64.
    kv = [f"past_{k}_{i}" for i in range(30) for k in ("key", "value")]
    sizes = {"input_ids": 8, "position_ids": 8, "write_indices": 8, "attention_mask": 4, "logits": 4}
    layout = engine_layout(64, 1024, 49152, kv, 3 * 1024 * 64 * 4, sizes)
    spans = sorted(layout.slots.values())
    assert all(off % ALIGNMENT == 0 for off, _ in spans)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # no overlap
    assert layout.total % ALIGNMENT == 0 and layout.total >= spans[-1][0] + spans[-1][1]
    assert layout.offset("attention_mask") < layout.offset("logits") < layout.offset("past_key_0")
    odd = plan_layout([("a", 3), ("b", 5)], alignment=256)
    assert odd.slots == {"a": (0, 3), "b": (256, 5)} and odd.total == 512


@pytest.mark.parametrize("start,t,window", [(0, 1, None), (5, 3, None), (62, 5, None), (30, 4, 8), (120, 8, None)])
def test_padded_mask_equals_the_exact_mask_plus_masked_padding(start, t, window):
    length = window_length(start, t, 16, 128)
    assert length in (16, 32, 64, 128) and start + t <= length <= max(16, 2 * (start + t))
    padded = fill_mask(np.empty((t, length), np.float32), start, window)
    exact = attention_mask(start, t, window)[0, 0]
    assert np.array_equal(padded[:, : start + t], exact)
    assert np.all(padded[:, start + t :] == -np.inf)


def test_the_graph_gives_the_same_logits_over_a_padded_window(bundles):
    """The TensorRT runtime feeds L rounded up to a bucket (so a graph serves a bucket of
    positions); on the very graph a plan is built from the logits must not change beyond float noise."""
    import onnx
    import onnxruntime as ort

    from specdeploy.export.trt_build import every_row

    bundle = load_bundle(bundles("llama-self"))
    spec = bundle.model("target")
    graph = every_row(onnx.load(str(bundle.file(spec.graph))))
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    kv = {p: rng.standard_normal((1, spec.num_kv_heads, bundle.max_seq, spec.head_dim)).astype(np.float32)
          for p, _ in spec.kv_names}
    for start, t in [(0, 4), (17, 1), (40, 5)]:
        feeds = {
            "input_ids": rng.integers(0, spec.vocab_size, (1, t)), "position_ids": np.arange(start, start + t)[None],
            "write_indices": np.array([start]), **kv,
        }
        exact = session.run(["logits"], {**feeds, "attention_mask": attention_mask(start, t)})[0]
        length = window_length(start, t, 16, bundle.max_seq)
        mask = fill_mask(np.empty((t, length), np.float32), start)[None, None]
        padded = session.run(["logits"], {**feeds, "attention_mask": mask})[0]
        np.testing.assert_allclose(padded, exact, rtol=0, atol=1e-5)
        assert np.array_equal(padded.argmax(-1), exact.argmax(-1))


# -- one CUDA graph per shape, against a fake stream -----------------------------------------------


def test_graphs_capture_after_a_warm_up_run_then_replay():
    graphs, driver = StepGraphs(max_t=9), FakeDriver()
    key = ShapeKey(0, 1, 64)
    assert graphs.run(key, driver) == "captured"
    ctx = ("ctx", 0)
    # The pass runs eagerly on the key's own context (the warm-up TensorRT asks for), then the
    # same enqueue is recorded on the non-default stream.
    assert driver.calls == [("new", key), ("run", ctx), ("begin",), ("capture-run", ctx), ("end",)]
    driver.calls.clear()
    assert [graphs.run(key, driver) for _ in range(3)] == ["replay"] * 3
    assert driver.calls == [("launch", "graph")] * 3
    other = ShapeKey(1, 5, 64)
    assert graphs.run(other, driver) == "captured"  # another shape gets its own context and graph
    assert graphs.status == {key: "graph", other: "graph"}
    assert graphs.counts == {"captured": 2, "replayed": 3, "eager": 0, "capture_failed": 0}
    graphs.close(driver)
    assert len(driver.released) == 2 and all(g == "graph" for _, g in driver.released)


@pytest.mark.parametrize("failure", ["end", "enqueue"])
def test_capture_failure_falls_back_to_plain_enqueue_and_says_so(failure):
    driver = FakeDriver(fail_end=failure == "end", fail_enqueue_in_capture=failure == "enqueue")
    graphs, key = StepGraphs(), ShapeKey(0, 1, 64)
    assert graphs.run(key, driver) == "eager"
    assert ("run", ("ctx", 0)) in driver.calls  # the pass itself ran before the capture
    assert (("abort",) in driver.calls) == (failure == "enqueue")  # a half-made capture is always ended
    assert driver.released == [(("ctx", 0), None)]
    assert graphs.status[key].startswith("eager: capture failed")
    driver.calls.clear()
    assert graphs.run(key, driver) == "eager" and driver.calls == [("eager", key)]  # never retried
    assert graphs.counts == {"captured": 0, "replayed": 0, "eager": 1, "capture_failed": 1}


def test_shapes_that_are_not_captured_say_why():
    cases = [
        (StepGraphs(enabled=False), FakeDriver(), ShapeKey(0, 1, 64), "CUDA graphs off"),
        (StepGraphs(), FakeDriver(default_stream=True), ShapeKey(0, 1, 64), "default stream"),
        (StepGraphs(max_t=9), FakeDriver(), ShapeKey(2, 16, 64), "above the capture limit 9"),
    ]
    for graphs, driver, key, why in cases:
        assert graphs.run(key, driver) == "eager" and why in graphs.status[key]
        assert driver.calls == [("eager", key)]
    full, driver = StepGraphs(max_graphs=1), FakeDriver()
    full.run(ShapeKey(0, 1, 64), driver)
    assert full.run(ShapeKey(0, 1, 128), driver) == "eager" and "cache full" in full.status[ShapeKey(0, 1, 128)]


# -- engine compatibility -----------------------------------------------------------------------------


def test_an_engine_from_another_tensorrt_or_gpu_is_a_clear_bundle_error():
    entry = {"tensorrt_version": "10.15.1.29", "gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
    check_engine_compat("target.plan", entry, "10.15.1.29", ("NVIDIA H100 80GB HBM3", "9.0"))
    with pytest.raises(BundleError, match=r"TensorRT 10.15.1.29, this machine has TensorRT 11.0.0.1.*rebuild"):
        check_engine_compat("target.plan", entry, "11.0.0.1", ("NVIDIA H100 80GB HBM3", "9.0"))
    with pytest.raises(BundleError, match=r"built on NVIDIA H100.*has NVIDIA L4 \(compute capability 8.9\).*rebuild"):
        check_engine_compat("target.plan", entry, "10.15.1.29", ("NVIDIA L4", "8.9"))


def test_building_without_tensorrt_is_one_line_export_error(bundles):
    try:
        import tensorrt  # noqa: F401

        pytest.skip("TensorRT is installed here: the missing-TensorRT message cannot be shown")
    except ImportError:
        pass
    with pytest.raises(ExportError) as e:
        build_engines(bundles("llama-self"))
    assert "TensorRT" in str(e.value) and "\n" not in str(e.value)


def test_the_trt_backend_without_an_engine_says_to_build_one(bundles):
    bundle = load_bundle(bundles("llama-self"))
    with pytest.raises(BundleError, match="specdeploy build"):
        TrtEngine.from_bundle(bundle, bundle.model("target"), modules=(FakeTensorRT(), FakeCudart()))


# -- the engine and the build against the fakes ------------------------------------------------------


@pytest.fixture
def built(bundles, tmp_path):
    """A copy of the llama-self bundle with (fake) engines built into it."""
    bundle = tmp_path / "bundle"
    shutil.copytree(bundles("llama-self"), bundle)
    cudart = FakeCudart()
    trt = FakeTensorRT(cudart)
    build_engines(bundle, workspace_gb=0.5, timing_cache=tmp_path / "timing.cache", modules=(trt, cudart))
    return bundle, (trt, cudart)


def test_build_engines_records_plans_profiles_and_gpu_in_the_manifest(built, tmp_path):
    bundle_dir, (trt, cudart) = built
    bundle = load_bundle(bundle_dir)  # verifies every sha256, the plans' included
    manifest = bundle.manifest.as_dict()
    profiles = [p.as_dict() for p in build_profiles(bundle.manifest)]
    for role in ("target", "draft"):
        entry = manifest["models"][role]["trt"]
        assert entry["plan"] == f"{role}.plan" and f"{role}.plan" in manifest["files"]
        assert (entry["tensorrt_version"], entry["gpu_name"], entry["compute_capability"]) == ("10.15.1.29", "Fake GPU", "9.0")
        assert entry["profiles"] == profiles and entry["onnx_sha256"] == manifest["files"][f"{role}.onnx"]
        assert entry["argmax_output"] == "next_tokens"
    flags, workspace, built_profiles, cache_in, cleared = trt.built[0]
    assert flags == 1 << 0 and workspace == 1 << 29  # STRONGLY_TYPED; 0.5 GiB
    assert cleared == {"TF32"} and manifest["models"]["target"]["trt"]["tf32"] is False  # fp32 bundle: fp32 math
    assert built_profiles == [{k: [list(s) for s in v] for k, v in shapes.items()}
                              for shapes in profile_shapes(bundle.manifest, "target")]
    # the graphs take a batch dimension: every profile ranges B over 1..max_batch, the KV buffers included
    assert all(p["B"] == [1, 1, bundle.manifest.max_batch] for p in profiles)
    assert built_profiles[0]["past_key_0"][2][0] == bundle.manifest.max_batch == 8
    assert built_profiles[0]["write_indices"] == [[1], [1], [8]]
    assert (tmp_path / "timing.cache").read_bytes() == b"timing cache after "  # saved after the builds
    assert trt.built[1][3] == cache_in  # both models built with the one cache
    build_engines(bundle_dir, timing_cache=tmp_path / "timing.cache", modules=(trt, cudart))
    assert trt.built[-1][3] == b"timing cache after "  # loaded when present
    assert default_timing_cache(bundle_dir) == tmp_path / "bundle.trt-timing.cache"


def test_the_argmax_output_is_the_first_index_of_the_maximum(built):
    """The layers the build adds give numpy's argmax, ties to the lowest index: the token the
    per-pass round picks on the host, so a fused round never parts from it at a tie."""
    bundle_dir, (trt, _) = built
    vocab = load_bundle(bundle_dir).model("target").vocab_size
    (argmax,) = trt.networks[0].marked
    assert (argmax.name, argmax.dtype, argmax.shape[-1]) == ("next_tokens", np.dtype(np.int64), 1)
    logits = np.random.default_rng(5).standard_normal((1, 4, vocab)).astype(np.float32)
    logits[0, 0, [3, 7]] = 9.0  # a tie
    logits[0, 1] = 0.5  # a row of equal values
    logits[0, 2, :-1], logits[0, 2, -1] = -np.inf, -1.0  # the maximum in the last column
    got = argmax.fn({"logits": logits})
    assert got.shape == (1, 4, 1) and np.array_equal(got[..., 0], logits.argmax(-1))
    assert got[0, :3, 0].tolist() == [3, 0, vocab - 1]


def _schedule():
    # (start, T): a prefill chunk, single steps and verify passes, shapes repeating so graphs replay,
    # positions crossing the 16-slot buckets.
    return [(0, 16), (16, 1), (17, 5), (22, 1), (23, 1), (24, 5), (29, 1), (30, 3), (33, 1), (34, 5), (39, 1)]


def _engines(bundle_dir, modules, length_bucket=16):
    bundle = load_bundle(bundle_dir)
    spec = bundle.model("target")
    engine = TrtEngine.from_bundle(bundle, spec, modules=modules, length_bucket=length_bucket)
    return engine, OrtEngine(bundle.file(spec.graph), spec, bundle.max_seq)


def test_trt_engine_host_side_matches_onnx_runtime(built):
    bundle_dir, modules = built
    engine, reference = _engines(bundle_dir, modules)
    cudart = modules[1]
    addresses_before = engine.kv_addresses()
    ids = np.random.default_rng(1).integers(0, engine.vocab_size, size=40)
    modes = []
    for start, t in _schedule():
        syncs = cudart.syncs
        got = engine.forward(ids[start : start + t], start).copy()
        assert cudart.syncs - syncs == 1  # one host synchronisation per pass
        want = reference.forward(ids[start : start + t], start)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
        modes.append(engine.last_mode)
    assert "captured" in modes and "replay" in modes and modes[0] == "eager"  # T=16 is prefill: eager
    assert engine.stats["replayed"] >= 3 and all(v in ("graph",) or v.startswith("eager: T=16") for v in engine.graph_status.values())
    assert engine.kv_addresses() == addresses_before  # buffers never move
    fake_engine = engine._loaded.engine
    assert len(fake_engine.contexts) == len(engine.profiles) + engine.stats["graphs"]  # shared ones + one per graph
    for ctx in fake_engine.contexts:
        assert ctx.address_calls == fake_engine.num_io_tensors  # addresses set once, when the context was made


def test_trt_engine_falls_back_when_capture_fails_with_the_same_logits(built):
    bundle_dir, modules = built
    modules[1].fail_capture = True
    engine, reference = _engines(bundle_dir, modules)
    ids = np.random.default_rng(2).integers(0, engine.vocab_size, size=40)
    for start, t in _schedule():
        np.testing.assert_allclose(engine.forward(ids[start : start + t], start), reference.forward(ids[start : start + t], start), atol=1e-5)
    assert engine.stats["captured"] == 0 and engine.stats["capture_failed"] >= 3 and modules[1].launches == 0
    assert any("capture failed (cudaStreamEndCapture: fakeCudaError901)" in v for v in engine.graph_status.values())


def test_speculative_decoding_on_the_trt_backend_is_the_same_loop_and_lossless(built):
    """The loop, the drafter and greedy verification are the ort code, unchanged; only the
    engines differ. Speculative output equals plain decoding token for token."""
    bundle_dir, modules = built
    target, drafter = _assert_lossless(bundle_dir, modules, against_ort=True)
    assert target.stats["replayed"] > 0 and drafter.engine.stats["replayed"] > 0


def _decoder(bundle_dir, modules):
    """(bundle, tokenizer, TRT target, ModelDrafter over the TRT draft, ORT target, run) where
    run(target, drafter, ids, k, params) -> (tokens, Stats); k an int or "auto"."""
    from specdeploy.runtime.decoding.drafters import ModelDrafter
    from specdeploy.runtime.decoding.loop import DecodeSettings, decode
    from specdeploy.runtime.decoding.policy import DraftLength
    from specdeploy.runtime.decoding.stats import Stats
    from specdeploy.runtime.decoding.sampling import SamplingParams
    from specdeploy.runtime.decoding.tokenizer import Tokenizer

    bundle = load_bundle(bundle_dir)
    tok = Tokenizer(bundle.file(bundle.tokenizer.file), bundle.tokenizer)
    target = TrtEngine.from_bundle(bundle, bundle.model("target"), modules=modules, length_bucket=16)
    drafter = ModelDrafter(TrtEngine.from_bundle(bundle, bundle.model("draft"), modules=modules, length_bucket=16))
    reference = OrtEngine(bundle.file("target.onnx"), bundle.model("target"), bundle.max_seq)

    def run(engine, drafter, ids, k, params=SamplingParams()):
        length = DraftLength(bundle.max_draft, fixed=None if k == "auto" else k)
        stats = Stats()
        out = decode(engine, drafter, ids, DecodeSettings(24, (), bundle.prefill_chunk, params, length), stats)
        return np.concatenate(list(out)), stats

    return bundle, tok, target, drafter, reference, run


def _assert_lossless(bundle_dir, modules, against_ort: bool):
    from tiny import PROMPTS

    bundle, tok, target, drafter, reference, run = _decoder(bundle_dir, modules)
    assert drafter.fused_with(target)  # both engines carry the argmax output: greedy rounds run fused
    for prompt in (PROMPTS[10], PROMPTS[16]):  # longer than every profile: the drafter's catch-up is chunked
        ids = np.asarray(tok.encode(prompt), dtype=np.int64)
        assert ids.shape[0] > max(p.t_max for p in target.profiles)
        plain, _ = run(target, None, ids, 0)
        for k in (1, 3, 4, 8, "auto"):
            fused = target.stats["fused"]
            assert np.array_equal(run(target, drafter, ids, k)[0], plain), (prompt, k)
            assert target.stats["fused"] > fused, (prompt, k)
        if against_ort:  # the fake's kernel is ONNX Runtime: the same tokens, exactly
            assert np.array_equal(run(reference, None, ids, 0)[0], plain)
    return target, drafter


def test_a_fused_round_gives_the_per_pass_tokens_with_one_sync_and_only_tokens_down(built):
    """draft_chain + verify_chain, round after round, against the same passes on ONNX Runtime
    run one by one: the same k draft tokens and k+1 target argmaxes; one synchronisation per
    round (plus one per leading chunk of a pending text longer than every profile); the draft
    never synchronises; only 2k+1 token ids come down, never logits."""
    from specdeploy.runtime.decoding.accept import accept_greedy

    bundle_dir, modules = built
    cudart = modules[1]
    bundle, _, target, drafter, ref_target, _ = _decoder(bundle_dir, modules)
    draft = drafter.engine
    ref_draft = OrtEngine(bundle.file("draft.onnx"), bundle.model("draft"), bundle.max_seq)
    ids = list(np.random.default_rng(4).integers(0, target.vocab_size, size=20))
    for engine in (target, ref_target):
        engine.forward(np.array(ids[:16]), 0)
        engine.forward(np.array(ids[16:19]), 16)
    fed = 0  # tokens the draft's cache holds, all equal to ids[:fed]
    for k in (3, 1, 8, 2, 5, 8):
        n, pending = len(ids), np.array(ids[fed:])
        want_drafts, pos = [], n
        logits = ref_draft.forward(pending, fed)
        for _ in range(k):
            want_drafts.append(int(logits[-1].argmax()))
            logits, pos = ref_draft.forward(np.array(want_drafts[-1:]), pos), pos + 1
        want_target = ref_target.forward(np.array([ids[-1], *want_drafts]), n - 1).argmax(-1)
        syncs, down, draft_syncs = cudart.syncs, cudart.copied["D2H"], draft.host_syncs
        lead = (len(pending) - 1) // draft.t_max  # plain passes before the chain (the first round here)
        chain = draft.draft_chain(pending, fed, k)
        assert cudart.syncs - syncs == lead and draft.host_syncs - draft_syncs == lead  # nothing waited on
        checked = target.verify_chain(ids[-1], chain, n - 1)
        drafts, target_argmax = checked.draft_tokens, checked.target_tokens
        assert drafts.tolist() == want_drafts and target_argmax.tolist() == want_target.tolist(), k
        assert cudart.syncs - syncs == 1 + lead
        assert cudart.copied["D2H"] - down == (2 * k + 1) * 8 + lead * draft.t_max * draft.vocab_size * 4
        assert draft.chain_seconds() > 0
        accepted, token = accept_greedy(drafts, target_argmax)
        fed = n + min(accepted, k - 1)  # the chain fed pending and every draft but the last
        ids += [*drafts[:accepted].tolist(), token]
    assert target.stats["fused"] == 6 == draft.stats["fused"]


def test_greedy_decoding_over_trt_engines_synchronises_once_per_round(built):
    """The loop as it stands: fused greedy rounds give ONNX Runtime's plain output token for
    token, at k = 1, 3 and the adaptive length, and the host synchronises once per prefill
    pass and once per round, counted by the fake CUDA runtime and by the engines."""
    from tiny import PROMPTS

    bundle_dir, modules = built
    cudart = modules[1]
    bundle, tok, target, drafter, reference, run = _decoder(bundle_dir, modules)
    for prompt in PROMPTS[:4]:
        ids = np.asarray(tok.encode(prompt), dtype=np.int64)
        assert ids.shape[0] <= target.t_max  # the first round's pending text opens the chain at once
        want, _ = run(reference, None, ids, 0)
        for k in (1, 3, "auto"):
            syncs, engine_syncs = cudart.syncs, target.host_syncs + drafter.engine.host_syncs
            got, stats = run(target, drafter, ids, k)
            assert np.array_equal(got, want), (prompt, k)
            prefill = -(-(ids.shape[0] - 1) // bundle.prefill_chunk)
            rounds = stats.target_passes
            assert cudart.syncs - syncs == prefill + rounds == target.host_syncs + drafter.engine.host_syncs - engine_syncs
            assert stats.drafted > 0


def _strip_argmax(bundle_dir: Path, roles, record: bool = False) -> None:
    """Make the engines of `roles` look built before the argmax output existed: the plan without
    it and (unless `record`) the manifest without its record; checksums updated."""
    from specdeploy.core.manifest import sha256_file

    manifest_path = bundle_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for role in roles:
        entry = manifest["models"][role]["trt"]
        if not record:
            del entry["argmax_output"]
        plan_path = bundle_dir / entry["plan"]
        plan = json.loads(plan_path.read_text())
        del plan["network"]
        plan_path.write_text(json.dumps(plan))
        manifest["files"][entry["plan"]] = sha256_file(plan_path)
        manifest["sizes"][entry["plan"]] = plan_path.stat().st_size
    manifest_path.write_text(json.dumps(manifest, indent=2))


@pytest.mark.parametrize("old", [("draft",), ("target",), ("draft", "target")])
def test_engines_without_the_argmax_output_keep_the_per_pass_round(built, old):
    from tiny import PROMPTS

    bundle_dir, modules = built
    cudart = modules[1]
    _strip_argmax(bundle_dir, old)
    bundle, tok, target, drafter, reference, run = _decoder(bundle_dir, modules)
    assert not drafter.fused_with(target)
    for role, engine in (("target", target), ("draft", drafter.engine)):
        assert engine.chains == (role not in old)
    ids = np.asarray(tok.encode(PROMPTS[2]), dtype=np.int64)
    syncs = cudart.syncs
    got, stats = run(target, drafter, ids, 4)
    assert np.array_equal(got, run(reference, None, ids, 0)[0])
    prefill = -(-(ids.shape[0] - 1) // bundle.prefill_chunk)
    assert cudart.syncs - syncs == prefill + stats.draft_passes + stats.target_passes  # one per pass
    assert target.stats["fused"] == drafter.engine.stats["fused"] == 0


def test_a_manifest_recording_an_argmax_the_engine_lacks_is_a_bundle_error(built):
    bundle_dir, modules = built
    _strip_argmax(bundle_dir, ["target"], record=True)
    bundle = load_bundle(bundle_dir)
    with pytest.raises(BundleError, match="does not match the manifest's graph contract; rebuild"):
        TrtEngine.from_bundle(bundle, bundle.model("target"), modules=modules)


def test_sampled_rounds_on_trt_run_pass_by_pass_and_stay_lossless(built):
    """Under sampling a round is not fused: the draft's passes come back to the host, which
    samples. With top-k 1 every distribution is a point mass on the argmax, so the output must
    be greedy's exactly; a seed replays; every pass synchronises once."""
    from specdeploy.runtime.decoding.sampling import SamplingParams
    from tiny import PROMPTS

    bundle_dir, modules = built
    cudart = modules[1]
    bundle, tok, target, drafter, reference, run = _decoder(bundle_dir, modules)
    ids = np.asarray(tok.encode(PROMPTS[0]), dtype=np.int64)
    want, _ = run(reference, None, ids, 0)
    syncs = cudart.syncs
    got, stats = run(target, drafter, ids, 3, SamplingParams(temperature=1.0, top_k=1, seed=1))
    assert np.array_equal(got, want) and stats.drafted > 0
    prefill = -(-(ids.shape[0] - 1) // bundle.prefill_chunk)
    assert cudart.syncs - syncs == prefill + stats.draft_passes + stats.target_passes
    assert target.stats["fused"] == drafter.engine.stats["fused"] == 0
    params = SamplingParams(temperature=1.0, seed=7)
    assert np.array_equal(run(target, drafter, ids, 3, params)[0], run(target, drafter, ids, 3, params)[0])


def test_fork_shares_the_engine_and_owns_its_buffers(built):
    bundle_dir, modules = built
    engine, _ = _engines(bundle_dir, modules)
    twin = engine.fork()
    assert twin._loaded is engine._loaded
    assert set(twin.kv_addresses()).isdisjoint(engine.kv_addresses())
    ids = np.arange(8) % engine.vocab_size
    np.testing.assert_array_equal(engine.forward(ids, 0).copy(), twin.forward(ids, 0))


# -- real TensorRT on a GPU (skipped where either is missing) ----------------------------------------


def _real_tensorrt():
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (no machine of this project has it)")
    try:
        from specdeploy.runtime.backends.cuda import Cuda, import_modules

        trt, cudart = import_modules()
        Cuda(cudart).device()
    except Exception as e:  # no cuda-python, no driver, no GPU
        pytest.skip(f"no usable CUDA GPU for TensorRT: {e}")
    return trt, cudart


def test_real_tensorrt_engine_matches_onnx_runtime_and_decodes_losslessly(bundles, tmp_path):
    modules = _real_tensorrt()
    bundle_dir = tmp_path / "bundle"
    shutil.copytree(bundles("llama-self"), bundle_dir)
    build_engines(bundle_dir, workspace_gb=1.0, modules=modules)
    assert check_bundle(bundle_dir) == []
    engine, reference = _engines(bundle_dir, modules)
    ids = np.random.default_rng(3).integers(0, engine.vocab_size, size=40)
    for start, t in _schedule():
        got = engine.forward(ids[start : start + t], start).copy()
        want = reference.forward(ids[start : start + t], start)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * max(1.0, float(np.abs(want).max())))  # fp32, no TF32
    assert engine.stats["captured"] > 0, engine.stats
    _assert_lossless(bundle_dir, modules, against_ort=False)
