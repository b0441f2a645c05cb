"""Fakes for tests/test_trt.py: the documented subset of TensorRT's Python API and of
cuda-python's runtime module that the backend and the build call, so their host-side code runs
(and is checked) on a machine with neither.

- `FakeDriver`: the stream operations `trt_layout.StepGraphs` drives, recorded as calls.
- `FakeCudart`: device memory is host memory (so numpy can look at it); work queued on a
  `FakeStream` runs only when the stream is synchronised or waited on through a `FakeEvent`,
  so a missing synchronisation or wait shows as stale logits or tokens.
- `FakeTensorRT`: builder, network, config, profiles and runtime; `FakeEngine` runs ONNX
  Runtime on the plan's graph as its kernel, reading and writing (KV in place) the addresses
  bound on its `FakeContext`, and asserting the rules TensorRT documents (every tensor bound,
  256-byte alignment, aliased KV sharing memory, shapes inside the profile).
"""
from __future__ import annotations

import atexit
import ctypes
import itertools
import json
import os
import tempfile
import time
from types import SimpleNamespace

import numpy as np

from specdeploy.runtime.backends.trt_layout import ALIGNMENT, CaptureError, EnqueueError, align_up

# -- the stream operations StepGraphs drives ---------------------------------------------------------


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

    def flush_until(self, op):
        """Run this stream's work up to and including `op` (another stream waits on it)."""
        if op in self.pending:
            i = self.pending.index(op)
            ops, self.pending = self.pending[: i + 1], self.pending[i + 1 :]
            for o in ops:
                o()


class FakeEvent:
    def __init__(self):
        self.stream = self.op = self.time = None


class FakeCudart:
    """Device memory is host memory (so numpy can look at it); work queued on a stream runs
    only at cudaStreamSynchronize, or when a stream that waits on one of its events runs, so a
    missing synchronisation or wait shows as stale logits or tokens."""

    cudaStreamNonBlocking = 1
    cudaError_t = SimpleNamespace(cudaSuccess=0)
    cudaMemcpyKind = SimpleNamespace(cudaMemcpyHostToDevice="H2D", cudaMemcpyDeviceToHost="D2H", cudaMemcpyDeviceToDevice="D2D")
    cudaStreamCaptureMode = SimpleNamespace(cudaStreamCaptureModeGlobal="global")
    _COPY = {"H2D": ("host", "device"), "D2H": ("device", "host"), "D2D": ("device", "device")}  # (source, destination)

    def __init__(self, fail_capture=False):
        self.fail_capture = fail_capture
        self.memory = {}  # address -> (array kept alive, nbytes, "device" | "host")
        self.streams = {}
        self.syncs = self.launches = 0
        self.copied = {"H2D": 0, "D2H": 0, "D2D": 0}  # bytes enqueued, per kind

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
        source, destination = self._COPY[kind]
        self.check(dst, nbytes, destination)
        self.check(src, nbytes, source)
        self.copied[kind] += nbytes
        stream.enqueue(lambda: ctypes.memmove(dst, src, nbytes))
        return (0,)

    def cudaEventCreate(self):
        return (0, FakeEvent())

    def cudaEventRecord(self, event, stream):
        assert stream.capture is None, "recording an event on a capturing stream"

        def record():
            event.time = time.perf_counter()

        event.stream, event.op, event.time = stream, record, None
        stream.enqueue(record)
        return (0,)

    def cudaStreamWaitEvent(self, stream, event, flags):
        source, op = event.stream, event.op  # the event's latest record, as at the call
        stream.enqueue(lambda: source.flush_until(op))
        return (0,)

    def cudaEventElapsedTime(self, start, end):
        if start.time is None or end.time is None:
            return (600, None)  # cudaErrorNotReady
        return (0, (end.time - start.time) * 1e3)

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

    cudaGraphDestroy = cudaGraphExecDestroy = cudaFree = cudaFreeHost = cudaStreamDestroy = cudaEventDestroy = _ok


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
        # Outputs the build added to the parsed network, computed by its recorded layers.
        self.added = {t.name: t for t in trt.networks[plan["network"]].marked} if "network" in plan else {}
        for name, tensor in self.added.items():
            self.names.append(name)
            self.dtypes[name], self.shapes[name] = tensor.dtype, tensor.shape
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
        outputs = dict(zip([v.name for v in self.session.get_outputs()], self.session.run(None, feeds)))
        outputs.update({name: tensor.fn({**feeds, **outputs}) for name, tensor in self.added.items()})
        for name, value in outputs.items():
            assert value.dtype == self.dtypes[name], (name, value.dtype)
            cuda.view(addresses[name], self.dtypes[name], value.shape)[...] = value


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


class FakeTensor:
    """An ITensor of the fake network: name, shape, numpy dtype, and how to compute it from the
    engine's named inputs and ONNX outputs (`env`)."""

    def __init__(self, name, shape, dtype, fn):
        self.name, self.shape, self.dtype, self.fn = name, tuple(shape), np.dtype(dtype), fn


def _layer(tensor):
    return SimpleNamespace(get_output=lambda i: tensor)


class FakeNetwork:
    """The INetworkDefinition calls the build makes after parsing: the parsed graph's I/O as
    tensors, and the layers it adds, recorded with their documented meaning (and the documented
    rank and dtype rules asserted), so the fake engine computes an added output as built."""

    def __init__(self, flags):
        self.flags, self.onnx, self.marked = flags, None, []

    def _io(self, which):
        import onnx
        from onnx.helper import tensor_dtype_to_np_dtype

        graph = onnx.load(self.onnx, load_external_data=False).graph
        return [
            FakeTensor(v.name, [d.dim_value or -1 for d in v.type.tensor_type.shape.dim],
                       tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type), lambda env, n=v.name: env[n])
            for v in getattr(graph, which)
        ]

    num_inputs = property(lambda self: len(self._io("input")))
    num_outputs = property(lambda self: len(self._io("output")))

    def get_input(self, i):
        return self._io("input")[i]

    def get_output(self, i):
        return self._io("output")[i]

    @staticmethod
    def _axes(bitmask, rank):
        return tuple(a for a in range(rank) if bitmask >> a & 1)

    def add_reduce(self, x, op, axes, keep_dims):
        reduce = {"MAX": np.max, "MIN": np.min}[op]
        axis = self._axes(axes, len(x.shape))
        shape = [1 if a in axis else d for a, d in enumerate(x.shape)]
        return _layer(FakeTensor("", shape, x.dtype, lambda env: reduce(x.fn(env), axis=axis, keepdims=keep_dims)))

    def add_elementwise(self, a, b, op):
        assert op == "EQUAL" and len(a.shape) == len(b.shape) and a.dtype == b.dtype and a.dtype.kind == "f"
        return _layer(FakeTensor("", a.shape, bool, lambda env: a.fn(env) == b.fn(env)))

    def add_constant(self, shape, weights):
        value = np.asarray(weights).reshape(shape)
        return _layer(FakeTensor("", shape, value.dtype, lambda env: value))

    def add_select(self, condition, then, otherwise):
        assert condition.dtype == bool and then.dtype == otherwise.dtype
        assert len(condition.shape) == len(then.shape) == len(otherwise.shape)
        return _layer(FakeTensor("", condition.shape, then.dtype,
                                 lambda env: np.where(condition.fn(env), then.fn(env), otherwise.fn(env))))

    def mark_output(self, tensor):
        assert tensor.name, "an output needs a name"
        self.marked.append(tensor)


class FakeTensorRT:
    """The module-level names of `tensorrt` the backend and the build use."""

    __version__ = "10.15.1.29"
    Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})
    TensorIOMode = SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
    NetworkDefinitionCreationFlag = SimpleNamespace(STRONGLY_TYPED=0)
    BuilderFlag = SimpleNamespace(TF32="TF32")
    MemoryPoolType = SimpleNamespace(WORKSPACE="WORKSPACE")
    ReduceOperation = SimpleNamespace(MAX="MAX", MIN="MIN")
    ElementWiseOperation = SimpleNamespace(EQUAL="EQUAL")
    Weights = staticmethod(np.asarray)

    def __init__(self, cudart=None):
        self.cudart = cudart
        self.built = []  # (network flags, workspace, profiles, timing cache bytes) per build
        self.networks = []  # every network built, in order; a plan names its own

    @staticmethod
    def nptype(dtype):
        return dtype

    def Runtime(self, logger):
        return SimpleNamespace(deserialize_cuda_engine=lambda data: FakeEngine(json.loads(bytes(data)), self))

    def Builder(self, logger):
        fake = self

        class Builder:
            def create_network(self, flags):
                return FakeNetwork(flags)

            def create_builder_config(self):
                return FakeConfig()

            def create_optimization_profile(self):
                return FakeProfile()

            def build_serialized_network(self, network, config):
                fake.built.append((network.flags, config.workspace, config.profiles, config.cache.data, config.cleared))
                fake.networks.append(network)
                plan = {"onnx": network.onnx, "profiles": config.profiles, "network": len(fake.networks) - 1}
                return json.dumps(plan).encode()

        return Builder()

    def OnnxParser(self, network, logger):
        def parse_from_file(path):
            network.onnx = path
            return True

        def parse(model: bytes, path: str | None = None):
            """The graph as the build handed it over, kept in a file for the engines' sessions."""
            fd, name = tempfile.mkstemp(suffix=".onnx", prefix="fake-plan-")
            with os.fdopen(fd, "wb") as f:
                f.write(model)
            atexit.register(os.unlink, name)
            network.onnx = name
            return True

        return SimpleNamespace(parse_from_file=parse_from_file, parse=parse, num_errors=0)


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
