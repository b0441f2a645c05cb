"""TensorRT backend: a bundle's `.plan` engine over device buffers allocated once.

Written against the documented TensorRT Python API (10.15+ and 11.x: name-based I/O with
`set_input_shape` / `set_tensor_address` / `execute_async_v3`) and cuda-python's runtime
module (what TensorRT's own samples use since 10.13; the runtime never imports torch).
Not run in this project's CI: no machine here has TensorRT or a GPU. What can be proved
without them is proved in tests/test_trt.py against a fake TensorRT and a fake stream.

One pass (`forward`):

    stage inputs in pinned host memory -> one host-to-device copy -> graph replay or
    execute_async_v3 -> one device-to-host copy of the logits -> one stream synchronisation

Buffers: one cudaMalloc'd pool holds the staged inputs, the logits and every KV buffer, each
at a 256-byte aligned offset (trt_layout). Each KV buffer is bound as both `past_*` (input)
and `present_*` (output), the pair TensorRT reports through `get_aliased_input_tensor`:
the KV-cache update layer writes in place, so rollback stays "move the length back".
Addresses are set once per execution context, when the context is created.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from ..bundle import ModelSpec
from ..errors import BundleError, InputError
from . import check_pass
from .trt_layout import (
    STAGED_INPUTS, CaptureError, EnqueueError, Profile, ShapeKey, StepGraphs, engine_layout, fill_mask,
    padded_length, select_profile,
)

DEFAULT_LENGTH_BUCKET = 64  # the smallest attention window a pass runs with (see padded_length)
_INSTALL = "pip install 'specdeploy[trt]' (TensorRT >= 10.15 and cuda-python, on a machine with an NVIDIA GPU)"


def import_modules(what: str = "backend 'trt'"):
    """(tensorrt, cuda-python's runtime module), imported only when TensorRT is chosen."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise InputError(f"{what} needs TensorRT's Python package, which is not installed ({e}): {_INSTALL}") from None
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python
        except ImportError as e:
            raise InputError(f"{what} needs cuda-python, which is not installed ({e}): {_INSTALL}") from None
    return trt, cudart


class CudaError(RuntimeError):
    pass


class Cuda:
    """The few CUDA runtime calls the backend makes, through cuda-python, each checked.

    cuda-python returns (cudaError_t, *results) from every call."""

    def __init__(self, cudart):
        self.rt = cudart

    def call(self, name: str, *args):
        result = getattr(self.rt, name)(*args)
        err, rest = result[0], result[1:]
        if err != self.rt.cudaError_t.cudaSuccess:
            what = self.rt.cudaGetErrorName(err)[1]
            raise CudaError(f"{name}: {what.decode() if isinstance(what, bytes) else what}")
        return rest[0] if len(rest) == 1 else rest

    def device(self) -> tuple[str, str]:
        """(GPU name, compute capability "major.minor") of the current device."""
        prop = self.call("cudaGetDeviceProperties", self.call("cudaGetDevice"))
        name = prop.name
        if isinstance(name, (bytes, bytearray)):
            name = bytes(name).split(b"\0", 1)[0].decode(errors="replace")
        return str(name).strip(), f"{prop.major}.{prop.minor}"

    def host_view(self, address: int, nbytes: int) -> np.ndarray:
        """A numpy uint8 view of host memory at `address` (pinned memory from cudaMallocHost)."""
        return np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=np.uint8)


def check_engine_compat(where: str, entry: dict, tensorrt_version: str, gpu: tuple[str, str]) -> None:
    """A TensorRT engine loads only into the TensorRT version that built it, on the kind of
    GPU it was built for; say so, and how to fix it, instead of failing inside TensorRT."""
    built = entry.get("tensorrt_version")
    if built != tensorrt_version:
        raise BundleError(
            f"{where}: engine built with TensorRT {built}, this machine has TensorRT {tensorrt_version}; "
            "engines do not load across TensorRT versions: rebuild it with `specdeploy build BUNDLE`"
        )
    name, cc = gpu
    if (entry.get("gpu_name"), entry.get("compute_capability")) != (name, cc):
        raise BundleError(
            f"{where}: engine built on {entry.get('gpu_name')} (compute capability {entry.get('compute_capability')}), "
            f"this machine has {name} (compute capability {cc}); rebuild it here with `specdeploy build BUNDLE`"
        )


class _Loaded:
    """One deserialized engine and what was checked about it, shared by forks."""

    def __init__(self, runtime, engine, dtypes: dict[str, np.dtype]):
        self.runtime, self.engine, self.dtypes = runtime, engine, dtypes


def _load_engine(trt, plan_path: Path, spec: ModelSpec, entry: dict, max_seq: int) -> _Loaded:
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(plan_path.read_bytes())
    if engine is None:
        raise BundleError(f"{plan_path}: TensorRT could not deserialize the engine; rebuild it with `specdeploy build BUNDLE`")
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = {n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
    want_in = set(STAGED_INPUTS) | {i for i, _ in spec.kv_names}
    want_out = {"logits"} | {o for _, o in spec.kv_names}
    if inputs != want_in or set(names) - inputs != want_out:
        raise BundleError(
            f"{plan_path}: engine I/O {sorted(names)} does not match the manifest's graph contract; rebuild the engine"
        )
    for past, present in spec.kv_names:
        # The KV-cache update layer writes in place. ICudaEngine::getAliasedInputTensor names the
        # input an output "should alias with" (NvInferRuntime.h, TensorRT 10.15), and both must be
        # bound to one address: "If different addresses are assigned, TensorRT reports an API
        # error" (TensorRT developer guide, KV Cache).
        aliased = engine.get_aliased_input_tensor(present)
        if aliased != past:
            raise BundleError(
                f"{plan_path}: TensorRT aliases {present} to {aliased!r}, not {past}: the KV cache would not be "
                "written in place; rebuild with TensorRT >= 10.15 from an opset-24 TensorScatter graph"
            )
    dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
    kv_in = spec.kv_names[0][0]
    kv_shape = (1, spec.num_kv_heads, max_seq, spec.head_dim)
    if dtypes[kv_in] != np.dtype(spec.kv_dtype) or tuple(engine.get_tensor_shape(kv_in)) != kv_shape:
        raise BundleError(
            f"{plan_path}: KV tensor {kv_in} is {dtypes[kv_in]} {tuple(engine.get_tensor_shape(kv_in))}, the manifest "
            f"says {spec.kv_dtype} {kv_shape}; rebuild the engine"
        )
    if engine.num_optimization_profiles != len(entry["profiles"]):
        raise BundleError(
            f"{plan_path}: engine has {engine.num_optimization_profiles} optimization profiles, the manifest "
            f"records {len(entry['profiles'])}; rebuild the engine"
        )
    return _Loaded(runtime, engine, dtypes)


class TrtEngine:
    """One graph of a bundle as a TensorRT engine, on one CUDA stream of its own."""

    def __init__(
        self, plan_path: Path, spec: ModelSpec, max_seq: int, entry: dict, *,
        length_bucket: int = DEFAULT_LENGTH_BUCKET, cuda_graphs: bool = True, max_graphs: int = 64, modules=None,
        _loaded: _Loaded | None = None,
    ):
        self.spec = spec
        self.plan_path = Path(plan_path)
        self.entry = entry
        self.name = f"{spec.role} ({self.plan_path.name})"
        self.max_seq = max_seq
        self.vocab_size = spec.vocab_size
        self.length_bucket = length_bucket
        self._modules = modules or import_modules()
        trt, cudart = self._modules
        self._cuda = cuda = Cuda(cudart)
        if _loaded is None:
            check_engine_compat(str(self.plan_path), entry, trt.__version__, cuda.device())
            _loaded = _load_engine(trt, self.plan_path, spec, entry, max_seq)
        self._loaded = _loaded
        self.profiles = [Profile.from_dict(p) for p in entry["profiles"]]
        self.t_max = max(p.t_max for p in self.profiles)
        dtypes = _loaded.dtypes
        kv_in = [i for i, _ in spec.kv_names]
        kv_nbytes = int(np.prod((1, spec.num_kv_heads, max_seq, spec.head_dim))) * np.dtype(spec.kv_dtype).itemsize
        itemsize = {n: dtypes[n].itemsize for n in (*STAGED_INPUTS, "logits")}
        self.layout = layout = engine_layout(self.t_max, max_seq, spec.vocab_size, kv_in, kv_nbytes, itemsize)

        # A non-blocking stream of our own: CUDA graphs cannot be captured on the default stream, and
        # TensorRT adds cudaDeviceSynchronize() calls on it ("please use non-default stream instead",
        # IExecutionContext.execute_async_v3, TensorRT 10.15 Python docs).
        self._stream = cuda.call("cudaStreamCreateWithFlags", cudart.cudaStreamNonBlocking)
        self._stream_handle = int(self._stream)
        self._pool = int(cuda.call("cudaMalloc", layout.total))
        # Zero-filled once: slots past the length hold finite values, so the padded window
        # (masked -inf) adds exact zeros.
        cuda.call("cudaMemsetAsync", self._pool, 0, layout.total, self._stream)
        staged = layout.end("logits")  # the host mirror of [staged inputs | logits]
        self._host = int(cuda.call("cudaMallocHost", staged))
        raw = cuda.host_view(self._host, staged)
        self._h = {
            n: raw[layout.offset(n) : layout.end(n)].view(dtypes[n]) for n in (*STAGED_INPUTS, "logits")
        }
        self._addresses = {n: self._pool + layout.offset(n) for n in (*STAGED_INPUTS, "logits", *kv_in)}
        for past, present in spec.kv_names:
            self._addresses[present] = self._addresses[past]  # one buffer: aliased input and output
        self._driver = _Driver(self)
        self._contexts = [self._new_context(i) for i in range(len(self.profiles))]  # eager runs, per profile
        capture_max_t = max((p.t_max for p in self.profiles if p.name != "prefill"), default=1)
        self.graphs = StepGraphs(enabled=cuda_graphs, max_t=capture_max_t, max_graphs=max_graphs)
        self._chunked: dict[int, np.ndarray] = {}
        self.last_mode = ""
        cuda.call("cudaStreamSynchronize", self._stream)  # the memset, once, before any pass

    @classmethod
    def from_bundle(cls, bundle, spec: ModelSpec, **kwargs) -> "TrtEngine":
        entry = bundle.manifest["models"][spec.role].get("trt")
        if entry is None:
            raise BundleError(
                f"{bundle.path}: no TensorRT engine for the {spec.role} model; build it with `specdeploy build {bundle.path}`"
            )
        onnx_sha = bundle.manifest["files"].get(spec.graph)
        if entry.get("onnx_sha256") not in (None, onnx_sha):
            raise BundleError(
                f"{bundle.file(entry['plan'])}: built from another {spec.graph}; rebuild it with `specdeploy build {bundle.path}`"
            )
        return cls(bundle.file(entry["plan"]), spec, bundle.max_seq, entry, **kwargs)

    def fork(self) -> "TrtEngine":
        """Another engine over the same deserialized weights, with its own stream, buffers,
        contexts and graphs."""
        return TrtEngine(
            self.plan_path, self.spec, self.max_seq, self.entry, length_bucket=self.length_bucket,
            cuda_graphs=self.graphs.enabled, max_graphs=self.graphs.max_graphs, modules=self._modules,
            _loaded=self._loaded,
        )

    def kv_addresses(self) -> list[int]:
        return [self._addresses[past] for past, _ in self.spec.kv_names]

    @property
    def graph_status(self) -> dict:
        return self.graphs.status

    @property
    def stats(self) -> dict:
        return {**self.graphs.stats(), "length_bucket": self.length_bucket, "last_mode": self.last_mode}

    def forward(self, token_ids: np.ndarray, start: int) -> np.ndarray:
        """token_ids [T] at positions start..start+T-1 -> logits [T, V].

        The returned array views this engine's pinned host buffer: valid until the next pass.
        """
        token_ids = np.asarray(token_ids, dtype=np.int64)
        check_pass(self.name, token_ids, start, self.max_seq, self.vocab_size)
        t = token_ids.shape[0]
        if t > self.t_max:
            return self._forward_chunked(token_ids, start)
        length = padded_length(start, t, self.length_bucket, self.max_seq)
        key = ShapeKey(select_profile(self.profiles, t), t, length)
        h, cuda, stream = self._h, self._cuda, self._stream
        h["input_ids"][:t] = token_ids
        h["position_ids"][:t] = np.arange(start, start + t)
        h["write_indices"][0] = start
        fill_mask(h["attention_mask"][: t * length].reshape(t, length), start, self.spec.sliding_window)
        staged = self.layout.offset("attention_mask") + t * length * h["attention_mask"].itemsize
        # The staging buffer is rewritten only after the previous pass's synchronisation: memory bound
        # to a pass must not change before the stream is synchronised (execute_async_v3 docs).
        cuda.call("cudaMemcpyAsync", self._pool, self._host, staged, self._kind("HostToDevice"), stream)
        self.last_mode = self.graphs.run(key, self._driver)
        nbytes = t * self.vocab_size * h["logits"].itemsize
        logits_at = self.layout.offset("logits")
        cuda.call("cudaMemcpyAsync", self._host + logits_at, self._pool + logits_at, nbytes, self._kind("DeviceToHost"), stream)
        # The one host synchronisation of the pass: the caller needs the logits on the host.
        cuda.call("cudaStreamSynchronize", stream)
        logits = h["logits"][: t * self.vocab_size].reshape(t, self.vocab_size)
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)

    def _forward_chunked(self, token_ids: np.ndarray, start: int) -> np.ndarray:
        """A pass longer than every profile (a drafter catching up on a whole prompt) runs as
        chunks of at most t_max tokens, one synchronisation each."""
        t = token_ids.shape[0]
        out = self._chunked.get(t)
        if out is None:
            out = self._chunked[t] = np.empty((t, self.vocab_size), dtype=np.float32)
        for s in range(0, t, self.t_max):
            rows = self.forward(token_ids[s : s + self.t_max], start + s)
            out[s : s + rows.shape[0]] = rows
        return out

    def _kind(self, direction: str):
        return getattr(self._cuda.rt.cudaMemcpyKind, f"cudaMemcpy{direction}")

    def _new_context(self, profile: int):
        # Several contexts may select one profile: since 10.x setOptimizationProfileAsync no longer
        # asks for a profile unused by other contexts (NvInferRuntime.h, TensorRT 10.15 and 11.1);
        # the profile switch is enqueued on our stream, the one every pass of the context uses.
        ctx = self._loaded.engine.create_execution_context()
        if ctx is None:
            raise CudaError(f"{self.name}: TensorRT could not create an execution context (out of device memory?)")
        if not ctx.set_optimization_profile_async(profile, self._stream_handle):
            raise CudaError(f"{self.name}: could not select optimization profile {profile}")
        for name, address in self._addresses.items():
            if not ctx.set_tensor_address(name, address):
                raise CudaError(f"{self.name}: set_tensor_address({name}) refused address {address:#x}")
        return ctx

    def _set_shapes(self, ctx, key: ShapeKey) -> None:
        profile = self.profiles[key.profile]
        allowed = profile.shapes()
        for name, shape in (("input_ids", (1, key.t)), ("position_ids", (1, key.t)), ("attention_mask", (1, 1, key.t, key.length))):
            if not ctx.set_input_shape(name, shape):
                raise InputError(
                    f"{self.name}: {name} shape {list(shape)} is outside the engine's '{profile.name}' profile "
                    f"[min, opt, max] = {[list(s) for s in allowed[name]]}"
                )

    def close(self) -> None:
        """Release graphs, contexts and memory (also done when the engine is collected)."""
        cuda, stream = self._cuda, getattr(self, "_stream", None)
        if stream is None:
            return
        cuda.call("cudaStreamSynchronize", stream)
        if hasattr(self, "graphs"):
            self.graphs.close(self._driver)
        self._contexts = []  # contexts go with their last reference, before the memory they point at
        for free, attr in (("cudaFree", "_pool"), ("cudaFreeHost", "_host")):
            if getattr(self, attr, None) is not None:
                cuda.call(free, getattr(self, attr))
                setattr(self, attr, None)
        cuda.call("cudaStreamDestroy", stream)
        self._stream = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Driver:
    """`trt_layout.Driver` over a TrtEngine's contexts and stream (cuda-python)."""

    def __init__(self, engine: TrtEngine):
        self.e = engine
        self.is_default_stream = engine._stream_handle == 0

    def run_eager(self, key: ShapeKey) -> None:
        ctx = self.e._contexts[key.profile]
        self.e._set_shapes(ctx, key)
        self.run(ctx)

    def new_executor(self, key: ShapeKey):
        ctx = self.e._new_context(key.profile)
        self.e._set_shapes(ctx, key)
        return ctx

    def run(self, ctx) -> None:
        if not ctx.execute_async_v3(self.e._stream_handle):
            raise EnqueueError(f"{self.e.name}: execute_async_v3 returned False")

    def begin_capture(self) -> None:
        rt = self.e._cuda.rt
        try:
            # Global mode, as in TensorRT's CUDA graph example; capture needs a non-default stream.
            self.e._cuda.call("cudaStreamBeginCapture", self.e._stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal)
        except CudaError as e:
            raise CaptureError(str(e)) from None

    def end_capture(self):
        cuda = self.e._cuda
        try:
            graph = cuda.call("cudaStreamEndCapture", self.e._stream)
        except CudaError as e:  # e.g. cudaErrorStreamCaptureInvalidated: the stream is out of capture mode
            raise CaptureError(str(e)) from None
        try:
            return cuda.call("cudaGraphInstantiate", graph, 0)
        except CudaError as e:
            raise CaptureError(str(e)) from None
        finally:
            cuda.call("cudaGraphDestroy", graph)  # the executable graph keeps what it needs

    def abort_capture(self) -> None:
        try:
            graph = self.e._cuda.call("cudaStreamEndCapture", self.e._stream)  # leaves capture mode
            self.e._cuda.call("cudaGraphDestroy", graph)
        except CudaError:
            pass  # an invalidated capture has no graph to destroy

    def launch(self, graph) -> None:
        self.e._cuda.call("cudaGraphLaunch", graph, self.e._stream)

    def release(self, executor, graph=None) -> None:
        if graph is not None:
            self.e._cuda.call("cudaGraphExecDestroy", graph)
        del executor  # the context goes with its last reference


__all__ = ["Cuda", "TrtEngine", "check_engine_compat", "import_modules"]
