"""TensorRT: what can be proved without TensorRT or a GPU, and the real thing where they exist.

- the static op check (the parser's support table as data) on our graphs and on a bad one;
- the pure bookkeeping: profiles from the manifest, 256-byte alignment, the padded window,
  the graph-per-shape cache against a fake stream (capture failure included);
- the TrtEngine and build_engines code paths against a fake TensorRT and a fake CUDA stream
  whose "kernel" is ONNX Runtime on the same graph: the host side (staging, one copy each
  way, one synchronisation, addresses set once, KV aliased in place, graph replay) must give
  ONNX Runtime's logits and the same greedy tokens through the unchanged speculative loop;
- with real TensorRT and a GPU (skipped here, with the reason): the same on a real engine.
"""
from __future__ import annotations

import ctypes
import itertools
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from specdeploy.export.trt_build import build_engines, build_profiles, default_timing_cache, profile_shapes
from specdeploy.export.trt_ops import check_bundle, check_graph, load_table
from specdeploy.runtime import load_bundle
from specdeploy.runtime.backends import attention_mask
from specdeploy.runtime.backends.ort import OrtEngine
from specdeploy.runtime.backends.trt import TrtEngine, check_engine_compat
from specdeploy.runtime.backends.trt_layout import (
    ALIGNMENT, CaptureError, EnqueueError, ShapeKey, StepGraphs, align_up, engine_layout, fill_mask,
    padded_length, plan_layout, profiles_for, select_profile,
)
from specdeploy.runtime.errors import BundleError, ExportError

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
    manifest = {"max_seq": 128, "max_draft": 8, "prefill_chunk": 16}
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
    length = padded_length(start, t, 16, 128)
    assert length in (16, 32, 64, 128) and start + t <= length <= max(16, 2 * (start + t))
    padded = fill_mask(np.empty((t, length), np.float32), start, window)
    exact = attention_mask(start, t, window)[0, 0]
    assert np.array_equal(padded[:, : start + t], exact)
    assert np.all(padded[:, start + t :] == -np.inf)


def test_the_graph_gives_the_same_logits_over_a_padded_window(bundles):
    """The TensorRT runtime feeds L rounded up to a bucket (so a graph serves a bucket of
    positions); on the very same ONNX graph the logits must not change beyond float noise."""
    import onnxruntime as ort

    bundle = load_bundle(bundles("llama-self"))
    spec = bundle.model("target")
    session = ort.InferenceSession(str(bundle.file(spec.graph)), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    kv = {p: rng.standard_normal((1, spec.num_kv_heads, bundle.max_seq, spec.head_dim)).astype(np.float32)
          for p, _ in spec.kv_names}
    for start, t in [(0, 4), (17, 1), (40, 5)]:
        feeds = {
            "input_ids": rng.integers(0, spec.vocab_size, (1, t)), "position_ids": np.arange(start, start + t)[None],
            "write_indices": np.array([start]), **kv,
        }
        exact = session.run(["logits"], {**feeds, "attention_mask": attention_mask(start, t)})[0]
        length = padded_length(start, t, 16, bundle.max_seq)
        mask = fill_mask(np.empty((t, length), np.float32), start)[None, None]
        padded = session.run(["logits"], {**feeds, "attention_mask": mask})[0]
        np.testing.assert_allclose(padded, exact, rtol=0, atol=1e-5)
        assert np.array_equal(padded.argmax(-1), exact.argmax(-1))


# -- one CUDA graph per shape, against a fake stream -----------------------------------------------


class FakeDriver:
    def __init__(self, default_stream=False, fail_end=False, fail_enqueue_in_capture=False):
        self.is_default_stream = default_stream
        self.fail_end, self.fail_enqueue_in_capture = fail_end, fail_enqueue_in_capture
        self.calls, self.capturing, self.released = [], False, []
        self._ids = itertools.count()

    def run_eager(self, key):
        self.calls.append(("eager", key))

    def new_executor(self, key):
        self.calls.append(("new", key))
        return ("ctx", next(self._ids))

    def run(self, executor):
        self.calls.append(("capture-run" if self.capturing else "run", executor))
        if self.capturing and self.fail_enqueue_in_capture:
            raise EnqueueError("refused")

    def begin_capture(self):
        assert not self.capturing
        self.capturing = True
        self.calls.append(("begin",))

    def end_capture(self):
        self.capturing = False
        self.calls.append(("end",))
        if self.fail_end:
            raise CaptureError("cudaErrorStreamCaptureUnsupported")
        return "graph"

    def abort_capture(self):
        self.capturing = False
        self.calls.append(("abort",))

    def launch(self, graph):
        self.calls.append(("launch", graph))

    def release(self, executor, graph=None):
        self.released.append((executor, graph))


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


# -- a fake TensorRT and CUDA runtime: the documented API subset, ONNX Runtime as the kernel --------


class FakeStream:
    def __init__(self, handle):
        self.handle, self.pending, self.capture = handle, [], None

    def __int__(self):
        return self.handle

    def enqueue(self, op):
        (self.capture if self.capture is not None else self.pending).append(op)

    def flush(self):
        ops, self.pending = self.pending, []
        for op in ops:
            op()


class FakeCudart:
    """Device memory is host memory (so numpy can look at it); work queued on a stream runs
    only at cudaStreamSynchronize, so a missing synchronisation shows as stale logits."""

    cudaStreamNonBlocking = 1
    cudaError_t = SimpleNamespace(cudaSuccess=0)
    cudaMemcpyKind = SimpleNamespace(cudaMemcpyHostToDevice="H2D", cudaMemcpyDeviceToHost="D2H")
    cudaStreamCaptureMode = SimpleNamespace(cudaStreamCaptureModeGlobal="global")

    def __init__(self, fail_capture=False):
        self.fail_capture = fail_capture
        self.memory = {}  # address -> (array kept alive, nbytes, "device" | "host")
        self.streams = {}
        self.syncs = self.launches = 0

    def _alloc(self, nbytes, kind):
        raw = np.zeros(nbytes + 2 * ALIGNMENT, np.uint8)
        address = align_up(raw.ctypes.data)  # cudaMalloc's 256-byte (or better) alignment
        self.memory[address] = (raw, nbytes, kind)
        return (0, address)

    def check(self, address, nbytes, kind):
        for base, (_, size, k) in self.memory.items():
            if base <= address and address + nbytes <= base + size:
                assert k == kind, f"{address:#x} is {k} memory, used as {kind}"
                return
        raise AssertionError(f"[{address:#x}, +{nbytes}) is outside every allocation")

    def view(self, address, dtype, shape):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        self.check(address, nbytes, "device")
        return np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype).reshape(shape)

    def cudaGetErrorName(self, err):
        return (0, f"fakeCudaError{err}")

    def cudaGetDevice(self):
        return (0, 0)

    def cudaGetDeviceProperties(self, device):
        return (0, SimpleNamespace(name=b"Fake GPU\0\0\0", major=9, minor=0))

    def cudaStreamCreateWithFlags(self, flags):
        stream = FakeStream(100 + len(self.streams))
        self.streams[stream.handle] = stream
        return (0, stream)

    def cudaMalloc(self, nbytes):
        return self._alloc(nbytes, "device")

    def cudaMallocHost(self, nbytes):
        return self._alloc(nbytes, "host")

    def cudaMemsetAsync(self, address, value, nbytes, stream):
        self.check(address, nbytes, "device")
        stream.enqueue(lambda: ctypes.memset(address, value, nbytes))
        return (0,)

    def cudaMemcpyAsync(self, dst, src, nbytes, kind, stream):
        self.check(dst, nbytes, "device" if kind == "H2D" else "host")
        self.check(src, nbytes, "host" if kind == "H2D" else "device")
        stream.enqueue(lambda: ctypes.memmove(dst, src, nbytes))
        return (0,)

    def cudaStreamSynchronize(self, stream):
        assert stream.capture is None, "synchronising a capturing stream"
        stream.flush()
        self.syncs += 1
        return (0,)

    def cudaStreamBeginCapture(self, stream, mode):
        stream.capture = []
        return (0,)

    def cudaStreamEndCapture(self, stream):
        ops, stream.capture = stream.capture, None
        return (901, None) if self.fail_capture else (0, ops)

    def cudaGraphInstantiate(self, graph, flags):
        return (0, list(graph))

    def cudaGraphLaunch(self, graph, stream):
        for op in graph:
            stream.enqueue(op)
        self.launches += 1
        return (0,)

    def _ok(self, *args):
        return (0,)

    cudaGraphDestroy = cudaGraphExecDestroy = cudaFree = cudaFreeHost = cudaStreamDestroy = _ok


_ORT_TYPES = {"tensor(int64)": np.int64, "tensor(float)": np.float32, "tensor(float16)": np.float16}


class FakeEngine:
    """An ICudaEngine whose enqueue runs ONNX Runtime on the graph the plan names, reading its
    inputs from and writing its outputs (KV in place) to the addresses bound on the context."""

    def __init__(self, plan: dict, trt: "FakeTensorRT"):
        import onnx
        import onnxruntime as ort

        self.trt, self.profiles = trt, plan["profiles"]
        options = ort.SessionOptions()
        options.log_severity_level = 3  # the fake copies KV through run(); ORT would warn each pass
        self.session = ort.InferenceSession(plan["onnx"], options, providers=["CPUExecutionProvider"])
        io = list(self.session.get_inputs()) + list(self.session.get_outputs())
        self.names = [v.name for v in io]
        self.inputs = {v.name for v in self.session.get_inputs()}
        self.dtypes = {v.name: np.dtype(_ORT_TYPES[v.type]) for v in io}
        self.shapes = {v.name: tuple(d if isinstance(d, int) else -1 for d in v.shape) for v in io}
        graph = onnx.load(plan["onnx"], load_external_data=False).graph
        # What TensorRT derives from the KV-cache update layers: output -> the input it aliases.
        self.aliases = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "TensorScatter"}
        self.num_io_tensors, self.num_optimization_profiles = len(self.names), len(self.profiles)
        self.contexts = []

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return "INPUT" if name in self.inputs else "OUTPUT"

    def get_tensor_dtype(self, name):
        return self.dtypes[name]

    def get_tensor_shape(self, name):
        return self.shapes[name]

    def get_aliased_input_tensor(self, name):
        return self.aliases.get(name)

    def create_execution_context(self):
        ctx = FakeContext(self)
        self.contexts.append(ctx)
        return ctx

    def compute(self, shapes, addresses):
        cuda = self.trt.cudart
        feeds = {}
        for name in self.inputs:
            shape = shapes.get(name, self.shapes[name])
            feeds[name] = cuda.view(addresses[name], self.dtypes[name], shape).copy()
        outputs = self.session.run(None, feeds)
        for v, value in zip(self.session.get_outputs(), outputs):
            cuda.view(addresses[v.name], self.dtypes[v.name], value.shape)[...] = value


class FakeContext:
    def __init__(self, engine):
        self.engine, self.addresses, self.shapes = engine, {}, {}
        self.profile, self.address_calls = None, 0

    def set_optimization_profile_async(self, profile, stream):
        self.profile = profile
        return True

    def set_tensor_address(self, name, address):
        self.address_calls += 1
        self.addresses[name] = address
        return name in self.engine.names

    def set_input_shape(self, name, shape):
        lo, _, hi = self.engine.profiles[self.profile][name]
        if not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def execute_async_v3(self, stream):
        e = self.engine
        assert set(self.addresses) == set(e.names), "every I/O tensor needs an address"
        assert all(a % 256 == 0 for a in self.addresses.values()), "TensorRT wants 256-byte aligned addresses"
        for out, inp in e.aliases.items():
            assert self.addresses[out] == self.addresses[inp], f"{out} must share {inp}'s memory"
        assert self.shapes["input_ids"][1] == self.shapes["attention_mask"][2] == self.shapes["position_ids"][1]
        shapes, addresses = dict(self.shapes), dict(self.addresses)
        e.trt.cudart.streams[int(stream)].enqueue(lambda: e.compute(shapes, addresses))
        return True


class FakeTensorRT:
    """The module-level names of `tensorrt` the backend and the build use."""

    __version__ = "10.15.1.29"
    Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})
    TensorIOMode = SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
    NetworkDefinitionCreationFlag = SimpleNamespace(STRONGLY_TYPED=0)
    BuilderFlag = SimpleNamespace(TF32="TF32")
    MemoryPoolType = SimpleNamespace(WORKSPACE="WORKSPACE")

    def __init__(self, cudart=None):
        self.cudart = cudart
        self.built = []  # (network flags, workspace, profiles, timing cache bytes) per build

    @staticmethod
    def nptype(dtype):
        return dtype

    def Runtime(self, logger):
        return SimpleNamespace(deserialize_cuda_engine=lambda data: FakeEngine(json.loads(bytes(data)), self))

    def Builder(self, logger):
        fake = self

        class Builder:
            def create_network(self, flags):
                return SimpleNamespace(flags=flags, onnx=None)

            def create_builder_config(self):
                return FakeConfig()

            def create_optimization_profile(self):
                return FakeProfile()

            def build_serialized_network(self, network, config):
                fake.built.append((network.flags, config.workspace, config.profiles, config.cache.data, config.cleared))
                return json.dumps({"onnx": network.onnx, "profiles": config.profiles}).encode()

        return Builder()

    def OnnxParser(self, network, logger):
        def parse_from_file(path):
            network.onnx = path
            return True

        return SimpleNamespace(parse_from_file=parse_from_file, num_errors=0)


class FakeConfig:
    def __init__(self):
        self.workspace, self.profiles, self.cache, self.cleared = None, [], None, set()

    def clear_flag(self, flag):
        self.cleared.add(flag)

    def set_memory_pool_limit(self, pool, nbytes):
        assert pool == "WORKSPACE"
        self.workspace = nbytes

    def add_optimization_profile(self, profile):
        self.profiles.append(profile.recorded)
        return len(self.profiles) - 1

    def create_timing_cache(self, data):
        return SimpleNamespace(data=bytes(data), serialize=lambda: b"timing cache after " + bytes(data))

    def set_timing_cache(self, cache, ignore_mismatch):
        self.cache = cache
        return True


class FakeProfile:
    def __init__(self):
        self.recorded = {}

    def set_shape(self, name, lo, opt, hi):
        self.recorded[name] = [list(lo), list(opt), list(hi)]


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
    manifest = bundle.manifest
    profiles = [p.as_dict() for p in build_profiles(manifest)]
    for role in ("target", "draft"):
        entry = manifest["models"][role]["trt"]
        assert entry["plan"] == f"{role}.plan" and f"{role}.plan" in manifest["files"]
        assert (entry["tensorrt_version"], entry["gpu_name"], entry["compute_capability"]) == ("10.15.1.29", "Fake GPU", "9.0")
        assert entry["profiles"] == profiles and entry["onnx_sha256"] == manifest["files"][f"{role}.onnx"]
    flags, workspace, built_profiles, cache_in, cleared = trt.built[0]
    assert flags == 1 << 0 and workspace == 1 << 29  # STRONGLY_TYPED; 0.5 GiB
    assert cleared == {"TF32"} and manifest["models"]["target"]["trt"]["tf32"] is False  # fp32 bundle: fp32 math
    assert built_profiles == [{k: [list(s) for s in v] for k, v in shapes.items()} for shapes in profile_shapes(manifest)]
    assert (tmp_path / "timing.cache").read_bytes() == b"timing cache after "  # saved after the builds
    assert trt.built[1][3] == cache_in  # both models built with the one cache
    build_engines(bundle_dir, timing_cache=tmp_path / "timing.cache", modules=(trt, cudart))
    assert trt.built[-1][3] == b"timing cache after "  # loaded when present
    assert default_timing_cache(bundle_dir) == tmp_path / "bundle.trt-timing.cache"


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


def _assert_lossless(bundle_dir, modules, against_ort: bool):
    from specdeploy.runtime.drafters import ModelDrafter
    from specdeploy.runtime.loop import DraftLength, Stats, decode
    from specdeploy.runtime.sampling import SamplingParams
    from specdeploy.runtime.tokenizer import Tokenizer
    from tiny import PROMPTS

    bundle = load_bundle(bundle_dir)
    tok = Tokenizer(bundle.file(bundle.tokenizer["file"]), bundle.tokenizer)
    target = TrtEngine.from_bundle(bundle, bundle.model("target"), modules=modules, length_bucket=16)
    drafter = ModelDrafter(TrtEngine.from_bundle(bundle, bundle.model("draft"), modules=modules, length_bucket=16))
    reference = OrtEngine(bundle.file("target.onnx"), bundle.model("target"), bundle.max_seq)

    def run(engine, drafter, ids, k):
        out = decode(engine, drafter, ids, 24, DraftLength(8, fixed=k), [], bundle.prefill_chunk, SamplingParams(), Stats())
        return np.concatenate(list(out))

    for prompt in (PROMPTS[10], PROMPTS[16]):  # longer than every profile: the drafter's catch-up is chunked
        ids = np.asarray(tok.encode(prompt), dtype=np.int64)
        assert ids.shape[0] > max(p.t_max for p in target.profiles)
        plain = run(target, None, ids, 0)
        for k in (1, 4, 8):
            assert np.array_equal(run(target, drafter, ids, k), plain), (prompt, k)
        if against_ort:  # the fake's kernel is ONNX Runtime: the same tokens, exactly
            assert np.array_equal(run(reference, None, ids, 0), plain)
    return target, drafter


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
        from specdeploy.runtime.backends.trt import Cuda, import_modules

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
