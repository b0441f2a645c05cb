"""ONNX Runtime backend: IOBinding over KV buffers allocated once on the device and written in place.

Every KV buffer is an OrtValue allocated once on the engine's device (the CPU, or a GPU through
the CUDA or TensorRT execution provider), zero-filled, and bound as both `past_*` input and
`present_*` output, so the graph's TensorScatter writes into it where it lies. A pass copies
its small inputs up in one `update_inplace` and its logits come back once: on a GPU, one
host-to-device and one device-to-host copy; on the CPU the same calls are memcpys and the
logits a view. The CPU and the GPU run the same lines; only the provider list differs.

An int8/int4 graph exported for the CPU reads its K/V as bound, [B, Hkv, L, D] at the pass's window L
(export/onnx_export.py read_bound_kv): on the CPU the engine lays each buffer's slots out at a
capacity a little above the window (`kv_capacity`, `_fit`), so what it binds is the live prefix;
captured passes and GPUs bind it at max_seq.

CUDA graphs (ONNX Runtime's `enable_cuda_graph`, on by default on CUDA): a captured graph
replays the addresses and shapes it was captured with, so every pass shape (T up to the
largest verify pass, attention window L bucketed to a power of two by `window_length`) gets
an IOBinding of its own, bound once, and a `gpu_graph_id` of its own in its RunOptions;
longer passes (prefill chunks, a draft's first catch-up) run uncaptured (`gpu_graph_id` -1)
with the exact window. `Placement(capture=True)` on the CPU runs the same bookkeeping (graph
ids, bindings, windows) with nothing to capture: how the suite tests it.

ONNX Runtime falls back to the CPU on its own when a provider fails to load; here that is an
error, checked against `session.get_providers()`.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdeploy.core.errors import BundleError, InputError
from specdeploy.core.graph_io import AUX_HIDDEN, GRAPH_FACTS, LOGITS_ROWS, fill_mask, fill_tree_mask, graph_facts, io_names, window_length
from specdeploy.core.choices import DTYPES, FLOAT_DTYPES, NUMPY_DTYPES
from specdeploy.core.manifest import ModelSpec, kept_positions
from specdeploy.runtime.decoding.engine import EngineBase
from specdeploy.runtime.decoding.tree import TreeLayout

from . import devices
from .devices import Device, DeviceError
from .recurrent import RecurrentStates

log = logging.getLogger("specdeploy.runtime")

CPU, CUDA, TENSORRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"

# The bundle dtypes each execution provider runs. int8/int4 graphs use ONNX Runtime contrib ops
# (MatMulNBits, RotaryEmbedding): the CPU and CUDA providers have kernels for them (CUDA: 4-bit
# MatMulNBits since ORT 1.17, 8-bit since 1.22); TensorRT parses none of them.
PROVIDER_DTYPES = {
    CPU: NUMPY_DTYPES,
    CUDA: NUMPY_DTYPES,
    TENSORRT: tuple(d for d in FLOAT_DTYPES if d in NUMPY_DTYPES),
}
assert set(NUMPY_DTYPES) <= set(DTYPES)


def no_bfloat16(spec: ModelSpec, graph: str, backend: str) -> str:
    """The one line a bf16 bundle gets from a backend without bfloat16 kernels or buffers."""
    return (f"{graph} ({spec.role}) is a bf16 graph: {backend} here has no bfloat16 kernels or host buffers; run it "
            "with --backend torch (CPU or GPU), or export with --dtype fp16 or fp32")

MIN_WINDOW = 64  # the smallest attention window of a captured pass (see window_length)
ALIGN = 256  # bytes between the starts of the staged inputs (CUDA allocations are 256-byte aligned)

GPU_PACKAGE = "pip uninstall -y onnxruntime && pip install onnxruntime-gpu"
CUDA_LIBRARIES = ("onnxruntime-gpu needs the CUDA and cuDNN libraries it was built for: "
                  "pip install 'onnxruntime-gpu[cuda,cudnn]', or import torch first")


def session_options(threads: int | None = None, spinning: bool = True, shared: bool = False) -> ort.SessionOptions:
    """`shared`: the session runs on the process's one intra-op thread pool (see
    share_cpu_threads); otherwise on a pool of its own, `threads` wide. `spinning` (a pool of
    its own only): whether its threads spin a while after each run, waiting for the next (ONNX
    Runtime's default). A draft's must not: after its step they would spin on the very cores the
    target's verify pass needs. Measured on 2 cores, SmolLM2 int4 target with a 1-layer int8
    draft: a T = 2 verify right after a draft step took 18.7 ms with the draft spinning and
    10.1 ms without (a plain T = 1 step: 8.8-9.4 ms)."""
    so = ort.SessionOptions()
    if shared:
        so.use_per_session_threads = False  # and no thread counts: the pool's are fixed
    else:
        if not spinning:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.intra_op_num_threads = threads or os.cpu_count() or 1
        so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 4  # fatal only: a graph that fails to load is our one-line error, not its log
    return so


_pool_lock = threading.Lock()
_pool_threads: int | None = None  # the process's shared pool once made (0: made by other code, width unknown)
FOREIGN_POOL = "use_per_session_threads must be false"  # onnxruntime's refusal once any global pool exists


def share_cpu_threads(threads: int | None = None) -> int:
    """Run every ONNX Runtime session of this process on one intra-op thread pool, `threads`
    wide (None: every core), and return its width. For good: ONNX Runtime makes the pool once
    and never resizes it, and from then on refuses any session of the process, ours or not,
    that asks for threads of its own. So call it once, before loading a bundle, in a process
    whose ONNX Runtime sessions are all ours (the `specdeploy` command does, and so does a Session
    whose bundle has a draft graph unless told otherwise: settle_thread_pool). Without it each
    session has a pool of its own.

    Why: a target and its draft take turns on the same cores, pass after pass. On pools of
    their own, either the draft's threads sleep between its steps (each of a step's hundreds
    of parallel sections then waits for them to wake) or they spin through the target's
    verify pass (see session_options). On one pool the threads that ran a draft step spin
    straight into the next step, or into the verify pass. Measured on 2 cores, SmolLM2 fp32
    target with its int4 self-draft, rounds of 4 draft steps and a 5-token verify (scratch
    runs, medians over 27 rounds, 3 runs each): 87-93 ms a round on one pool against 99-103 ms
    on two (a draft step 13-14 ms against 16-17 ms; the verify 34-35 ms either way)."""
    global _pool_threads
    want = threads or os.cpu_count() or 1
    with _pool_lock:
        if _pool_threads is None:
            try:
                ort.set_global_thread_pool_sizes(want, 1)
            except Exception:  # onnxruntime's Fail: made already, by other code of this process
                _pool_threads = 0
                raise InputError("this process's ONNX Runtime thread pool was made elsewhere; its width is not ours to set") from None
            _pool_threads = want
        elif _pool_threads != want:
            raise InputError(f"this process's ONNX Runtime sessions share a pool of {_pool_threads or 'unknown'} threads; "
                             f"ONNX Runtime cannot remake it {want} wide")
        return _pool_threads


THREAD_POOLS = ("auto", "shared", "own")
THREAD_POOL_ENV = "SPECDEPLOY_THREAD_POOL"  # the default of Session(thread_pool=None), for a deployer


def thread_pool_choice(request: str | None) -> str:
    """The pool a Session asks for, checked: `request`, else $SPECDEPLOY_THREAD_POOL, else "auto"."""
    if request is not None and request not in THREAD_POOLS:
        raise InputError(f"thread_pool {request!r:.40} is not one of {', '.join(THREAD_POOLS)}")
    want = request if request is not None else os.environ.get(THREAD_POOL_ENV) or "auto"
    if want not in THREAD_POOLS:
        raise InputError(f"{THREAD_POOL_ENV} {want!r:.40} is not one of {', '.join(THREAD_POOLS)}")
    return want


def settle_thread_pool(want: str, threads: int | None, alternating: bool) -> str:
    """Whether a session's CPU engines run on the process's one thread pool ("shared") or on
    pools of their own ("own"), decided before any engine loads (ONNX Runtime fixes a
    session's pool when it makes the session).

    `want` (thread_pool_choice): "auto" shares when `alternating` (the bundle has a draft
    graph: target and draft take turns on the same cores, where one pool is the fast
    configuration, see share_cpu_threads) and keeps pools of their own otherwise (a target
    alone gains nothing from it). Once the process has a shared pool, ONNX Runtime runs every
    later session on it, so that is what a session gets, whatever it asked. The pool is for
    good and ONNX Runtime then refuses other code's sessions that ask for threads of their
    own: a process that runs other ONNX Runtime sessions asks for "own"."""
    if _pool_threads is not None:
        if want == "own":
            log.warning("thread_pool 'own' cannot be had: this process's ONNX Runtime sessions share one pool already")
        return "shared"
    if want == "own" or (want == "auto" and not alternating):
        return "own"
    try:
        width = share_cpu_threads(threads)
    except InputError:  # made by other code of this process: the engines join it when they load
        return "shared"
    log.info(f"ONNX Runtime: this process's sessions now share one pool of {width} threads (target and draft "
             f"take turns on it); other ONNX Runtime sessions of the process must set use_per_session_threads = False, "
             f"or pass Session(thread_pool='own') / {THREAD_POOL_ENV}=own")
    return "shared"


@dataclass(frozen=True)
class Placement:
    """Where and how a graph runs on ONNX Runtime.

    capture: one CUDA graph per pass shape of T <= capture_max_t tokens (on the CPU: the same
    bookkeeping, nothing captured). trt_ep: the TensorRT execution provider first, the CUDA
    provider for what it does not take, its engine and timing caches in `trt_cache`."""

    device: Device = Device("cpu")
    trt_ep: bool = False
    capture: bool = False
    capture_max_t: int = 0
    trt_cache: Path | None = None

    @classmethod
    def for_bundle(cls, bundle, device: "str | Device | None" = None, trt_ep: bool = False,
                   capture: bool | None = None) -> "Placement":
        """Defaults: the CPU; on CUDA, graphs captured for draft steps and verify passes (T up
        to max draft + 1); the TensorRT caches beside the bundle folder (they belong to a GPU
        and a TensorRT version, not to the bundle)."""
        device = Device.parse(device or "cpu")
        if trt_ep and device.kind != "cuda":
            raise InputError("--trt-ep (ONNX Runtime's TensorRT execution provider) needs --device cuda[:N]")
        if capture is None:
            capture = device.kind == "cuda" and not trt_ep
        path = Path(bundle.path)
        return cls(device, trt_ep, capture, bundle.max_draft + 1 if capture else 0,
                   path.parent / f"{path.name}.ort-trt-cache" if trt_ep else None)

    @property
    def provider(self) -> str:
        """The provider the graph must run on (ONNX Runtime's first choice)."""
        return TENSORRT if self.trt_ep else CUDA if self.device.kind == "cuda" else CPU

    def providers(self, spec: ModelSpec, max_seq: int) -> list[tuple[str, dict]]:
        """The `providers` argument of InferenceSession, first choice first, with their options."""
        if self.device.kind == "cpu":
            return [(CPU, {})]
        cuda = {"device_id": self.device.index,
                "use_tf32": 0}  # fp32 graphs stay fp32: TF32 would round matmul inputs to 10 bits
        if self.capture:
            cuda["enable_cuda_graph"] = 1
        chain = [(CUDA, cuda), (CPU, {})]
        if self.trt_ep:
            chain.insert(0, (TENSORRT, trt_options(self, spec, max_seq)))
        return chain

    def fallback(self) -> "Placement | None":
        """What to try when a session for this placement cannot be created: the CUDA provider
        for the TensorRT one, uncaptured passes for captured ones; None: nothing left."""
        if self.trt_ep:
            return replace(self, trt_ep=False, trt_cache=None)
        if self.capture and self.device.kind == "cuda":
            return replace(self, capture=False, capture_max_t=0)
        return None

    def __str__(self) -> str:
        extra = ", CUDA graphs" if self.capture and self.device.kind == "cuda" else ""
        return f"{self.provider} on {self.device}{extra}"


def trt_options(placement: Placement, spec: ModelSpec, max_seq: int) -> dict:
    """The TensorRT provider's options: engine and timing caches, fp16 kernels for fp16 graphs
    only (an fp32 graph stays fp32), and one optimization profile over every pass a session
    runs (T and the window L from 1 to max_seq; a shape outside it would rebuild the engine)."""
    cache = str(placement.trt_cache)

    def shapes(t: int, window: int) -> str:
        return f"input_ids:1x{t},position_ids:1x{t},attention_mask:1x1x{t}x{window}"

    return {
        "device_id": placement.device.index,
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": cache,
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": cache,
        "trt_fp16_enable": spec.dtype == "fp16",
        "trt_profile_min_shapes": shapes(1, 1),
        "trt_profile_opt_shapes": shapes(1, min(max_seq, 512)),
        "trt_profile_max_shapes": shapes(max_seq, max_seq),
    }


def check_placement(placement: Placement, spec: ModelSpec, graph_path: Path) -> Placement:
    """Before anything is loaded: the bundle dtype against the provider, the provider in this
    onnxruntime (the TensorRT one missing falls back to CUDA, logged), the GPU itself. One-line
    errors name what is missing."""
    if placement.device.kind == "cpu":
        return placement
    takes = PROVIDER_DTYPES[placement.provider]
    standard = "dequantize_linear" in (spec.quantization or {})  # exported --for tensorrt: no contrib op
    if spec.dtype not in takes and not standard:
        raise InputError(
            f"{graph_path.name} ({spec.role}) is a {spec.dtype} graph; {placement.provider} takes {', '.join(takes)} "
            f"bundles (int graphs use ONNX Runtime contrib ops TensorRT does not parse): drop --trt-ep, "
            f"or export with --for tensorrt"
        )
    available = ort.get_available_providers()
    missing = [devices.cuda_problem(placement.device)]  # every missing piece in the one line
    if CUDA not in available:
        missing.append(f"it needs onnxruntime-gpu: the installed onnxruntime {ort.__version__} has no {CUDA} "
                       f"(it has {', '.join(available)}): {GPU_PACKAGE}")
    if any(missing):
        raise DeviceError(f"device {placement.device}: " + "; and ".join(m for m in missing if m))
    if placement.trt_ep and TENSORRT not in available:
        log.warning(f"{graph_path.name}: this onnxruntime-gpu has no {TENSORRT}; running on {CUDA} instead")
        placement = placement.fallback()
    return placement


def _create(graph_path: Path, so: ort.SessionOptions, placement: Placement, spec: ModelSpec,
            max_seq: int) -> ort.InferenceSession:
    if placement.trt_cache is not None:
        placement.trt_cache.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not in available providers": checked against get_providers() instead
        session = ort.InferenceSession(str(graph_path), so, providers=placement.providers(spec, max_seq),
                                       enable_fallback=0)  # a provider that fails raises, never a silent CPU
    session.disable_fallback()  # nor a failed run retried on the CPU
    return session


def _reason(e: Exception) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def _load(graph_path: Path, spec: ModelSpec, max_seq: int, threads: int | None, spinning: bool,
          placement: Placement) -> tuple[ort.InferenceSession, Placement]:
    """An InferenceSession for one graph of the bundle, and the placement it got (after any
    fallback: TensorRT -> CUDA, captured -> uncaptured, each logged), or a one-line error naming
    the file: a graph ONNX Runtime cannot load, a provider that did not load, inputs and
    outputs that are not the graph contract's."""
    global _pool_threads
    shared = _pool_threads is not None
    if shared and threads and _pool_threads and threads != _pool_threads:
        log.warning(f"{graph_path.name}: threads={threads} not taken: this process's sessions share a pool of {_pool_threads}")
    so = session_options(threads, spinning, shared)
    while True:
        try:
            session = _create(graph_path, so, placement, spec, max_seq)
        except Exception as e:  # InvalidProtobuf, Fail, InvalidGraph, NoSuchFile, EP errors: onnxruntime's own types
            if not shared and FOREIGN_POOL in str(e):  # other code of this process made a shared pool
                with _pool_lock:
                    _pool_threads = _pool_threads or 0
                shared = True
                so = session_options(threads, spinning, shared)
                continue
            fallback = placement.fallback()
            if fallback is None and placement.device.kind == "cpu":
                raise BundleError(f"{graph_path}: ONNX Runtime cannot load this graph ({_reason(e)}); re-export the bundle") from None
            if fallback is None:
                raise DeviceError(f"{graph_path}: ONNX Runtime could not create a session on {placement} ({_reason(e)})") from None
            log.warning(f"{graph_path.name}: {placement} failed ({_reason(e)}); running on {fallback} instead")
            placement = fallback
            continue
        got = session.get_providers()
        if got[0] == CUDA and placement.trt_ep:  # ONNX Runtime's own fallback for a TensorRT that did not load
            log.warning(f"{graph_path.name}: {TENSORRT} did not load; running on {CUDA} instead")
            placement = placement.fallback()
        elif got[0] != placement.provider:
            raise DeviceError(f"{graph_path.name}: {placement.provider} did not load (ONNX Runtime would run this graph "
                              f"on {', '.join(got)}); {CUDA_LIBRARIES}")
        break
    inputs, outputs = io_names(spec.num_kv_layers, spec.logits_rows, tuple(spec.feature_inputs), tuple(spec.feature_outputs),
                               len(spec.state_names) // 2)
    have = ({i.name for i in session.get_inputs()}, {o.name for o in session.get_outputs()})
    if have != (set(inputs), set(outputs)):
        missing = sorted((set(inputs) - have[0]) | (set(outputs) - have[1]))
        extra = sorted((have[0] - set(inputs)) | (have[1] - set(outputs)))
        raise BundleError(
            f"{graph_path}: its inputs and outputs are not the graph contract's for {spec.num_layers} layers "
            f"(missing {missing[:4]}, unexpected {extra[:4]}); re-export the bundle"
        )
    stated = session.get_modelmeta().custom_metadata_map.get(GRAPH_FACTS)  # absent in bundles exported before it
    if stated is not None:
        try:
            graph_said = json.loads(stated)
        except ValueError:
            graph_said = {}
        for key, value in graph_facts(spec).items():
            if key in graph_said and graph_said[key] != value:
                raise BundleError(f"{graph_path}: the graph's {key} is {graph_said[key]!r}, the manifest says {value!r}; "
                                  "re-export the bundle")
    kv = {name: [None, *spec.kv_shape(i, 1, max_seq)[1:]] for i, pair in enumerate(spec.kv_names) for name in pair}
    kv_fields = "num_kv_heads, max_seq, head_dim"
    if reads_bound_kv(session, spec):  # [B, Hkv, L, D]: the window, not max_seq
        kv = {name: [None, shape[1], "L", shape[3]] for name, shape in kv.items()}
        kv_fields = "num_kv_heads, head_dim"
    for value in session.get_inputs() + session.get_outputs():
        want, fields = ((kv[value.name], kv_fields) if value.name in kv
                        else ([None, None, spec.logits_width], "vocab_size") if value.name == "logits" else (None, ""))
        got = [d if isinstance(d, int) else None for d in value.shape]
        if want is not None and [g if w is None or w == "L" else w for w, g in zip(want, got)] + got[len(want):] != got:
            raise BundleError(f"{graph_path}: {value.name} is {value.shape} in the graph but the manifest's "
                              f"{fields} make it {[w if w is not None else '?' for w in want]}; re-export the bundle")
    return session, placement


def reads_bound_kv(session: ort.InferenceSession, spec: ModelSpec) -> bool:
    """Whether the graph reads its K/V as bound, [B, Hkv, L, D] with L the pass's window
    (export/onnx_export.py read_bound_kv), not [B, Hkv, max_seq, D]: the graph contract's KV
    shape, read from the graph."""
    if not spec.kv_names:
        return False
    name = spec.kv_names[0][0]
    shape = next(v.shape for v in session.get_inputs() if v.name == name)
    return isinstance(shape[2], str)


# KV capacity (a graph that reads its K/V as bound): each sequence's slots are laid out at a stride
# of C slots, C a little above the pass's window, so the buffer bound at [B, Hkv, C, D] is the live
# prefix and no operator copies it out. C moves in steps of about a sixteenth of itself (at least
# CAPACITY_STEP): the slots read past the window are a few percent, and a growing context is laid
# out again once every step (a copy of the live K/V: at 3k tokens of SmolLM2 fp16 K/V, 69 MB once
# every 256 tokens).
CAPACITY_STEP = 64


def capacity_step(slots: int) -> int:
    return max(CAPACITY_STEP, 1 << max(0, slots.bit_length() - 4))


def kv_capacity(need: int, max_seq: int) -> int:
    """The capacity C for `need` slots: need rounded up to its step, at most max_seq.

    >>> [kv_capacity(n, 8192) for n in (1, 64, 65, 300, 3072, 3073, 6000)]
    [64, 64, 128, 320, 3072, 3328, 6144]
    >>> kv_capacity(120, 100)
    100
    """
    step = capacity_step(need)
    return min(max_seq, -(-need // step) * step)


def _allocate(shape, dtype, device: Device) -> ort.OrtValue:
    return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.dtype(dtype), device.kind, device.index)


class _Stage:
    """The inputs and the logits of every pass of T tokens, allocated once on the device.

    input_ids [T], position_ids [T], write_indices [1], the mask (room for [T, max_seq]) and
    logits_rows [T] (0..T-1, written once) lie in one byte buffer, each at an aligned offset:
    a pass fills the host copy and sends it up in one `update_inplace`. Inputs are bound by
    address with the pass's shape, so the mask [1, 1, T, L] is the first T*L floats of its
    room, whatever L is.

    On the CPU a decoding step's host work is mostly Python touching memory the pass before it
    pushed out of the caches (a step streams the whole model through them), so every call
    counts: a single step over the exact window writes its three integers through a
    memoryview and leaves its mask as it is (it sees every slot up to its own: a row of zeros,
    as the room was allocated; the stage tracks how far its leading zeros reach, since a
    padded window writes -inf past the step), and on the CPU a mask is bound as an OrtValue
    made once per window length over the same memory.
    """

    INPUTS = (("input_ids", np.int64), ("position_ids", np.int64), ("write_indices", np.int64),
              ("attention_mask", np.float32), (LOGITS_ROWS, np.int64))

    def __init__(self, t: int, max_seq: int, vocab_size: int, device: Device, logits_rows: bool = True,
                 features_in: dict[str, int] | None = None, features_out: dict[str, int] | None = None):
        """`logits_rows`: the graph takes the rows whose logits it returns (0..T-1, written
        once: a pass that wants only its last binds the last of them). `features_in`,
        `features_out` (CPU only): an EAGLE-3 head's hidden-state inputs and outputs, name ->
        width, each [1, T, width] here (a target's AUX_HIDDEN is bound by the engine instead)."""
        self.t, self.device, self.takes_rows = t, device, logits_rows
        self.features_in = {name: np.zeros((1, t, w), np.float32) for name, w in (features_in or {}).items()}
        self.zeroed = {name: True for name in self.features_in}  # holds zeros: a pass without it leaves it
        self.features_out = {name: np.zeros((1, t, w), np.float32) for name, w in (features_out or {}).items()
                             if name != AUX_HIDDEN}
        self.feature_values = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in self.features_in.items()}
        self.offsets, self.host_views, at = {}, {}, 0
        sizes = {"input_ids": t, "position_ids": t, "write_indices": 1, "attention_mask": t * max_seq, LOGITS_ROWS: t}
        for name, dtype in self.INPUTS:
            self.offsets[name] = at
            at += -(-sizes[name] * np.dtype(dtype).itemsize // ALIGN) * ALIGN
        self.host = np.zeros(at, dtype=np.uint8)
        for name, dtype in self.INPUTS:
            start = self.offsets[name]
            self.host_views[name] = self.host[start : start + sizes[name] * np.dtype(dtype).itemsize].view(dtype)
        self.steps = np.arange(t, dtype=np.int64)
        self.host_views[LOGITS_ROWS][:] = self.steps
        self._ints = memoryview(self.host).cast("q")  # int64 items: a single step's inputs, written without numpy
        self._slots = tuple(self.offsets[name] // 8 for name in ("input_ids", "position_ids", "write_indices"))
        self.on_host = device.kind == "cpu"
        self._masks: dict[int, ort.OrtValue] = {}  # on the CPU: the mask [1, 1, T, L] by L, over the room
        self._zeros = max_seq  # T = 1: the mask room's leading floats known to be zero (all, as allocated)
        # On the CPU the inputs are the host buffer itself (nothing to send) and the logits a view.
        self.value = ort.OrtValue.ortvalue_from_numpy(self.host) if self.on_host else _allocate(self.host.shape, np.uint8, device)
        self.logits = _allocate((1, t, vocab_size), np.float32, device)  # [1, T, V]
        self.logits_view = self.logits.numpy()[0] if self.on_host else None

    def stage(self, token_ids: np.ndarray, start: int, window: int, sliding_window: int | None,
              tree: "TreeLayout | None" = None) -> None:
        """Write a pass's inputs and send them up: on a GPU, the pass's one host-to-device copy.
        A tree pass (`tree`) sets each token's position to start + its depth and its mask row
        to the context and its ancestors."""
        v, t = self.host_views, self.t
        if t == 1 and window == start + 1 and tree is None and sliding_window is None:
            # a decoding step over the exact window: every slot visible, its mask all zeros
            ints, (i, p, w) = self._ints, self._slots
            ints[i] = int(token_ids[0])
            ints[p] = ints[w] = start
            if window > self._zeros:  # a padded window's -inf were written there
                v["attention_mask"][self._zeros : window] = 0
                self._zeros = window
        else:
            if t == 1:  # the fills below leave -inf past the step (and, in a sliding window, before it)
                self._zeros = 0 if sliding_window is not None else min(self._zeros, start)
            v["input_ids"][:] = token_ids
            v["write_indices"][0] = start
            mask = v["attention_mask"][: t * window].reshape(t, window)
            if tree is None:
                np.add(self.steps, start, out=v["position_ids"])
                fill_mask(mask, start, sliding_window)
            else:
                v["position_ids"][:] = start + tree.offsets
                fill_tree_mask(mask, start, tree.visible)
        if not self.on_host:
            self.value.update_inplace(self.host)

    def read_logits(self, last: bool = False) -> np.ndarray:
        """The pass's logits [T, V] (`last`: [1, V], the last row's) on the host: on a GPU its
        one device-to-host copy; on the CPU the buffer itself."""
        rows = self.logits_view if self.on_host else self.logits.numpy()[0]
        return rows[:1] if last else rows

    def bind(self, binding: ort.IOBinding, last: bool = False) -> None:
        """Bind this T's token inputs and its logits buffer: every row's, or (`last`) only the
        last row's, written at the buffer's start (the mask: `bind_mask`)."""
        t = self.t
        for name, shape in (("input_ids", [1, t]), ("position_ids", [1, t]), ("write_indices", [1])):
            self._bind_input(binding, name, np.int64, shape)
        for name, value in self.feature_values.items():
            binding.bind_ortvalue_input(name, value)
        for name, array in self.features_out.items():
            shape = [1, 1 if last else t, array.shape[2]]
            binding.bind_output(name, "cpu", 0, np.float32, shape, array.ctypes.data)
        if not self.takes_rows:
            binding.bind_ortvalue_output("logits", self.logits)
            return
        rows = 1 if last else t
        self._bind_input(binding, LOGITS_ROWS, np.int64, [rows], skip=t - rows)
        if last:
            binding.bind_output("logits", self.device.kind, self.device.index, np.float32,
                                [1, 1, self.logits.shape()[2]], self.logits.data_ptr())
        else:
            binding.bind_ortvalue_output("logits", self.logits)

    def bind_mask(self, binding: ort.IOBinding, window: int) -> None:
        """Bind the mask [1, 1, T, window]: the first T*window floats of its room (on the CPU
        through an OrtValue over them, made on the first pass of that window)."""
        if not self.on_host:
            self._bind_input(binding, "attention_mask", np.float32, [1, 1, self.t, window])
            return
        value = self._masks.get(window)
        if value is None:
            room = self.host_views["attention_mask"][: self.t * window]
            value = self._masks[window] = ort.OrtValue.ortvalue_from_numpy(room.reshape(1, 1, self.t, window))
        binding.bind_ortvalue_input("attention_mask", value)

    def _bind_input(self, binding: ort.IOBinding, name: str, dtype, shape: list[int], skip: int = 0) -> None:
        address = self.value.data_ptr() + self.offsets[name] + skip * np.dtype(dtype).itemsize
        binding.bind_input(name, self.device.kind, self.device.index, dtype, shape, address)


class OrtEngine(EngineBase):
    """One graph of a bundle on ONNX Runtime: the CPU, or a GPU through the CUDA (or TensorRT)
    execution provider; over `max_batch` KV slots (`forward_batch`: the CPU)."""

    chains = False  # every pass returns its logits to the host

    def __init__(
        self, graph_path: Path, spec: ModelSpec, max_seq: int, threads: int | None = None,
        session: ort.InferenceSession | None = None, spinning: bool | None = None,
        placement: Placement | None = None, keep_states: int = 16, max_batch: int = 1,
    ):
        """`spinning` (see session_options): default on for the target, off for a draft.
        `session`: one already loaded for `placement` (a fork shares its weights). `keep_states`:
        how many recent positions' recurrent states a model with linear-attention layers keeps
        (runtime/backends/recurrent.py): a round rolls back at most its draft length.
        `max_batch`: KV slots (sequences a `forward_batch` pass may carry); `forward` runs slot 0."""
        self.spec = spec
        self.graph_path = graph_path
        self.name = f"{spec.role} ({graph_path.name})"
        self.max_seq = max_seq
        self.vocab_size = spec.vocab_size
        self.runs = 0  # passes begun: a prompt prefix cache trusts the KV only if nobody else ran one
        self._threads = threads
        self._spinning = spec.role != "draft" if spinning is None else spinning
        placement = placement or Placement()
        if spec.dtype not in NUMPY_DTYPES:
            raise InputError(no_bfloat16(spec, graph_path.name, "ONNX Runtime"))
        if session is None:
            placement = check_placement(placement, spec, graph_path)
            session, placement = _load(graph_path, spec, max_seq, threads, self._spinning, placement)
        if max_batch > 1 and not isinstance(session.get_inputs()[0].shape[0], str):
            raise BundleError(f"{graph_path}: its graph carries one sequence per pass (exported before batched "
                              "passes); re-export the bundle to batch")
        self.session, self.placement = session, placement
        self.device = str(placement.device)
        self.providers = session.get_providers()
        self.max_batch = max_batch
        # Allocated once on the device and zero-filled: slots past the length hold finite values,
        # so a padded window's masked slots add exact zeros. Slot b is the [Hkv, C, D] block at
        # b * its size: a run of neighbouring slots is itself a buffer of the graph's shape.
        shapes = [spec.kv_shape(i, max_batch, max_seq) for i in range(len(spec.kv_names))]
        self._kv_values = [_allocate(shape, spec.kv_dtype, placement.device) for shape in shapes]
        for shape, value in zip(shapes, self._kv_values):
            value.update_inplace(np.zeros(shape, dtype=spec.kv_dtype))
        self._kv_dtype = np.dtype(spec.kv_dtype)
        self._slot_bytes = [int(np.prod(shape[1:])) * self._kv_dtype.itemsize for shape in shapes]
        on_cpu = placement.device.kind == "cpu"
        # KV capacity (see kv_capacity): a graph reading its K/V as bound has them laid out at `capacity`
        # slots a sequence, moved as the passes' windows need (on the CPU; elsewhere, and in captured
        # passes, which replay the shapes they were captured with, always max_seq)
        self.windowed = reads_bound_kv(session, spec)
        self._movable = self.windowed and on_cpu and not placement.capture
        self.capacity = max_seq
        self._ends = np.zeros(max_batch, dtype=np.int64)  # per slot: the positions a later pass may read
        self._pinned = np.ones(max_batch, dtype=bool)  # per slot: its K/V keep the capacity up (see release)
        self._flat = [v.numpy().reshape(-1) for v in self._kv_values] if on_cpu else None
        # on the CPU, host views of the whole buffers [max_batch, Hkv, capacity, D] (writing them writes
        # the buffers; laid out again, they are new views)
        self.kv = self._views() if on_cpu else None
        self._stages: dict[int, _Stage] = {}  # by T
        self._takes_rows = spec.logits_rows
        # uncaptured passes by (T, last row only): their binding, and the window its mask has
        self._bindings: dict[tuple[int, bool], ort.IOBinding] = {}
        self._windows: dict[tuple[int, bool], int] = {}
        self._uncaptured = _run_options(-1) if placement.capture else None
        self._graphs: dict[tuple[int, int], tuple[ort.IOBinding, ort.RunOptions]] = {}  # (T, L) -> captured graph
        self.captured_runs = 0
        self.uncaptured_runs = 0
        self.trees = tree_capable(spec, placement)
        # An EAGLE-3 bundle's hidden states (core/graph_io.py): a target writes each pass's
        # AUX_HIDDEN rows into `features` at their positions; a head's inputs are staged per pass
        # and its outputs read from `outputs` (the last pass's rows).
        self.feature_inputs, self.feature_outputs = spec.feature_inputs, spec.feature_outputs
        if (self.feature_inputs or self.feature_outputs) and placement.device.kind != "cpu":
            raise InputError(f"{self.name}: an EAGLE-3 bundle runs on ONNX Runtime's CPU provider (or --backend torch); "
                             f"not on {placement.device} yet")
        width = self.feature_outputs.get(AUX_HIDDEN)
        self.slot_features = np.zeros((max_batch, max_seq, width), np.float32) if width else None  # per slot
        self.features = self.slot_features[0] if width else None  # [max_seq, width]: slot 0's, what `forward` writes
        self.outputs: dict[str, np.ndarray] = {}
        # one ring of recurrent states per slot (backends/recurrent.py); `states`: slot 0's
        self.slot_states = [RecurrentStates(spec, keep_states, self.name if max_batch == 1 else f"{self.name} slot {i}")
                            for i in range(max_batch)]
        # batched passes (forward_batch): a binding per (first slot, B); their logits, hidden-state
        # rows and recurrent states in buffers grown on demand (`_staging`)
        self._batch_bindings: dict[tuple[int, int], ort.IOBinding] = {}
        self._staged: dict[str, np.ndarray] = {}
        self.padding_floor = None  # its passes carry no padding lanes (the torch backend's batched passes do)
        if self.states and placement.device.kind != "cpu":
            raise InputError(f"{self.name}: a model with linear-attention layers runs on ONNX Runtime's CPU provider; "
                             f"not on {placement.device} yet")

    @classmethod
    def from_bundle(cls, bundle, spec: ModelSpec, threads: int | None = None, device: "str | Device | None" = None,
                    trt_ep: bool = False, capture: bool | None = None, batch: int | None = None) -> "OrtEngine":
        """`batch`: an engine for batched passes over that many KV slots (`forward_batch`)."""
        return cls(bundle.file(spec.graph), spec, bundle.max_seq, threads,
                   placement=Placement.for_bundle(bundle, device, trt_ep, capture),
                   keep_states=kept_positions(bundle.max_draft), max_batch=batch or 1)

    def fork(self) -> "OrtEngine":
        """Another engine over the same weights with KV buffers and bindings of its own. ONNX
        Runtime runs one InferenceSession from several threads safely, but not one that captures
        CUDA graphs (and a captured graph keeps its buffers' addresses): a capturing engine's
        fork loads a session of its own."""
        return OrtEngine(self.graph_path, self.spec, self.max_seq, self._threads,
                         session=None if self.placement.capture else self.session, spinning=self._spinning,
                         placement=self.placement, keep_states=self.states.keep, max_batch=self.max_batch)

    @property
    def states(self) -> RecurrentStates:
        """Slot 0's recurrent states: what `forward` reads and keeps."""
        return self.slot_states[0]

    def resumable(self, length: int, slot: int = 0) -> int:
        """The longest prefix of `slot`, at most `length` tokens, a pass may start after (a model
        with recurrent states keeps them at recent positions only; K/V alone allow any)."""
        if self._movable:  # a released slot laid out at a smaller capacity keeps that many
            length = min(length, int(self._ends[slot]))
        states = self.slot_states[slot]
        return states.resumable(length) if states else length

    def release(self, slot: int) -> None:
        """The slot's K/V are kept only while they cost nothing: no longer do they hold the KV
        capacity up for the passes over other slots (a finished request's, kept for a later prompt
        that shares it); laid out at a smaller capacity, `resumable` says how much is left."""
        self._pinned[slot] = False

    @property
    def kv_bytes_per_sequence(self) -> int:
        """What one more sequence (one slot) adds: its K/V over every layer."""
        return sum(self._slot_bytes)

    def kv_addresses(self) -> list[int]:
        return [v.data_ptr() for v in self._kv_values]

    @property
    def kv_arrays(self) -> list[np.ndarray]:
        """Host views of slot 0's KV buffers, [1, Hkv, C, D] each (C: the capacity; CPU only): writing them
        writes the buffers."""
        if self.placement.device.kind != "cpu":
            raise AttributeError(f"kv_arrays: the KV buffers live on {self.device}; read them with kv_values")
        return [buffer[:1] for buffer in self.kv]

    @property
    def kv_values(self) -> list[ort.OrtValue]:
        return list(self._kv_values)

    @property
    def graph_shapes(self) -> list[tuple[int, int]]:
        """The (T, L) pass shapes captured so far, in the order of their graph ids (1, 2, ...)."""
        return list(self._graphs)

    def _forward(self, token_ids: np.ndarray, start: int, tree: "TreeLayout | None", last: bool,
                 features: "dict[str, np.ndarray | None] | None") -> np.ndarray:
        """token_ids [T] at positions start..start+T-1 -> logits [T, V]; with `tree` (engines
        whose `trees` is True), a tree pass: the tokens written at slots start..start+T-1, each
        at position start + its depth, seeing the context and its ancestors. `last`: the caller
        reads only the last row (a prefill chunk, a draft catching up): the head computes that
        row alone where the graph takes `logits_rows` (format 2) and the pass is not captured,
        and the result may then be [1, V]; read it as `[-1]`.

        The returned array is this engine's buffer for T (on a GPU, its host copy): valid until
        the next pass of the same T. `features` (an EAGLE-3 head): its hidden-state inputs,
        name -> [T, width] (left out or None: zeros).
        """
        t = token_ids.shape[0]
        captured = self.placement.capture and t <= self.placement.capture_max_t
        last = last and t > 1 and not captured and self._takes_rows
        window = window_length(start, t, MIN_WINDOW if captured else None, self.max_seq)
        if self.windowed:
            window = self._fit(window, 0, 1)
        stage = self._stages.get(t)
        if stage is None:  # allocated once per T, on the first pass of that length
            stage = self._stages[t] = _Stage(t, self.max_seq, self.spec.logits_width, self.placement.device,
                                             self._takes_rows, self.feature_inputs, self.feature_outputs)
        stage.stage(token_ids, start, window, self.spec.sliding_window, tree)
        for name, array in stage.features_in.items():
            given = features.get(name) if features else None
            if given is not None:
                array[0] = given
            elif not stage.zeroed[name]:
                array.fill(0.0)
            stage.zeroed[name] = given is None
        binding, run_options = self._graph(stage, window) if captured else self._rebind(stage, window, last)
        if self.features is not None:  # this pass's rows of the target's states, at their positions
            binding.bind_output(AUX_HIDDEN, "cpu", 0, np.float32, [1, t, self.features.shape[1]],
                                self.features[start].ctypes.data)
        if self.states:  # the state kept at `start` in, those after the returned rows out
            self.states.bind(binding, start, t, 1 if last else t)
        if not stage.on_host:
            binding.synchronize_inputs()  # update_inplace copied from pageable memory: the device has it before the run
        try:
            if run_options is None:  # a session that captures nothing
                self.session.run_with_iobinding(binding)
            else:
                self.session.run_with_iobinding(binding, run_options)
        except RuntimeError as e:  # onnxruntime's run errors: the graph and the manifest disagree, or the device failed
            if self.states:
                self.states.fail()
            raise BundleError(f"{self.name}: ONNX Runtime failed a pass of {t} tokens at {start} "
                              f"({_reason(e)})") from None
        finally:
            self._ends[0], self._pinned[0] = start + t, True
        if self.states:
            self.states.commit()
        for name, array in stage.features_out.items():
            self.outputs[name] = array[0, : 1 if last else t]
        return stage.read_logits(last)

    def move_kv(self, source: np.ndarray, start: int, slot: int = 0) -> None:
        """In `slot`, copy the K/V at positions `source` [m] to start..start+m-1 in every buffer
        (a tree round's accepted path into the positions a chain would have used). Sources are
        read before anything is written, so the two ranges may overlap."""
        for buffer in self.kv:
            kv = buffer[slot]  # [Hkv, S, D] (buffer[slot, :, source] would put the indexed axis first)
            kv[:, start : start + source.shape[0]] = kv[:, source]

    # -- batched passes ----------------------------------------------------------------------
    def _forward_batch(self, tokens: np.ndarray, starts: np.ndarray, first: int, last: bool, pad: bool,
                       layouts: "list[TreeLayout | None] | None") -> np.ndarray:
        """EngineBase.forward_batch on ONNX Runtime's CPU provider: slots bound by address (no
        pass is padded: `pad` is unused), each sequence's mask and positions its own."""
        b, t = tokens.shape
        if self.kv is None or self.feature_inputs:
            raise InputError(f"{self.name}: batched passes run on the CPU, over a target or a draft model "
                             "(an EAGLE-3 head runs one sequence a pass)")
        window = int(starts.max()) + t
        if self.windowed:
            window = self._fit(window, first, b)
        mask = np.empty((b, 1, t, window), np.float32)
        positions = starts[:, None] + np.arange(t, dtype=np.int64)
        for i in range(b):
            layout = layouts[i] if layouts is not None else None
            if layout is None:
                fill_mask(mask[i, 0], int(starts[i]), self.spec.sliding_window)
            else:
                fill_tree_mask(mask[i, 0], int(starts[i]), layout.visible)
                positions[i] = starts[i] + layout.offsets
        rows = 1 if last else t
        width = self.spec.logits_width
        logits = self._staging("logits", (b, rows, width))
        binding = self._batch_binding(first, b)
        binding.bind_cpu_input("input_ids", tokens)
        binding.bind_cpu_input("position_ids", positions)
        binding.bind_cpu_input("write_indices", starts)
        binding.bind_cpu_input("attention_mask", mask)
        if self._takes_rows:
            binding.bind_cpu_input(LOGITS_ROWS, np.arange(t - rows, t, dtype=np.int64))
        binding.bind_output("logits", "cpu", 0, np.float32, [b, rows, width], logits.ctypes.data)
        hidden = None
        if self.slot_features is not None:
            size = self.slot_features.shape[2]
            hidden = self._staging(AUX_HIDDEN, (b, t, size))
            binding.bind_output(AUX_HIDDEN, "cpu", 0, np.float32, [b, t, size], hidden.ctypes.data)
        outputs = self._stage_states(binding, starts, first, t, rows) if self.states else None
        try:
            self.session.run_with_iobinding(binding)
        except RuntimeError as e:
            raise BundleError(f"{self.name}: ONNX Runtime failed a pass of {b}x{t} tokens ({_reason(e)})") from None
        finally:
            self._ends[first : first + b], self._pinned[first : first + b] = starts + t, True
        if outputs is not None:  # each sequence's states after the returned rows, kept by position in its slot
            for i in range(b):
                self.slot_states[first + i].store(int(starts[i]) + t - rows + 1, [out[i] for out in outputs], rows)
        if hidden is not None:  # each sequence's rows of the target's states, at their positions in its slot
            for i in range(b):
                at = int(starts[i])
                self.slot_features[first + i, at : at + t] = hidden[i]
        return logits

    def _stage_states(self, binding: ort.IOBinding, starts: np.ndarray, first: int, t: int, rows: int
                      ) -> list[np.ndarray]:
        """Each sequence's recurrent state at its start, staged side by side as the pass's inputs;
        its outputs bound to staging arrays [B, rows, ...] -> those arrays (read once the pass ran)."""
        b = starts.shape[0]
        sources = [self.slot_states[first + i].read(int(starts[i])) for i in range(b)]
        outputs = []
        for j, ((inp, out), shape) in enumerate(zip(self.spec.state_names, self.states.shapes)):
            staged = self._staging(inp, (b, *shape))
            np.concatenate([source[j] for source in sources], out=staged)
            after = self._staging(out, (b, rows, *shape))
            binding.bind_input(inp, "cpu", 0, np.float32, list(staged.shape), staged.ctypes.data)
            binding.bind_output(out, "cpu", 0, np.float32, list(after.shape), after.ctypes.data)
            outputs.append(after)
        return outputs

    def _staging(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A view of `shape` over the staging buffer of a batched pass's output `name` (logits,
        hidden states) or state input or output, grown on demand and kept (a verify pass's states
        are megabytes: not allocated afresh each pass)."""
        need = int(np.prod(shape))
        flat = self._staged.get(name)
        if flat is None or flat.size < need:
            flat = self._staged[name] = np.empty(need, np.float32)
        return flat[:need].reshape(shape)

    def copy(self, source: int, dest: int, start: int, end: int) -> None:
        """Slot `dest`'s K/V (and hidden states) at positions start..end-1 made those of slot
        `source` (a prompt another sequence has prefilled already)."""
        for buffer in self.kv:
            buffer[dest, :, start:end] = buffer[source, :, start:end]
        self._ends[dest], self._pinned[dest] = end, True
        if self.slot_features is not None:
            self.slot_features[dest, start:end] = self.slot_features[source, start:end]
        if self.states:  # the state at `end` (the caller asks resumable(end, source) first)
            self.slot_states[dest].drop_after(start)
            self.slot_states[dest].store(end, self.slot_states[source].state(end), 1)

    def swap(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Exchange the K/V of slots a and b: the first length_a positions of a's, length_b of b's."""
        if a == b:
            return
        states = self.slot_states
        states[a], states[b] = states[b], states[a]
        for buffer in self.kv:
            keep = buffer[a, :, :length_a].copy()
            buffer[a, :, :length_b] = buffer[b, :, :length_b]
            buffer[b, :, :length_a] = keep
        self._ends[a], self._ends[b] = min(length_b, self._ends[b]), min(length_a, self._ends[a])
        self._pinned[[a, b]] = self._pinned[[b, a]]
        if self.slot_features is not None:  # the hidden states at the same positions move with them
            keep = self.slot_features[a, :length_a].copy()
            self.slot_features[a, :length_b] = self.slot_features[b, :length_b]
            self.slot_features[b, :length_a] = keep

    # -- KV capacity ------------------------------------------------------------------------
    def _fit(self, need: int, first: int, b: int) -> int:
        """The window of a pass over slots first..first+B-1 that reads `need` slots, for a graph that
        reads its K/V as bound: the capacity, laid out again first where it is too small, or (by
        two steps or more) too large for the pass and every other slot's K/V (but released ones)."""
        if not self._movable:
            return self.max_seq
        others = np.concatenate((self._ends[:first], self._ends[first + b :]))[
            np.concatenate((self._pinned[:first], self._pinned[first + b :]))]
        need = max(need, int(others.max()) if others.size else 0)
        if need > self.capacity or need <= self.capacity - 2 * capacity_step(self.capacity):
            self._lay_out(kv_capacity(need, self.max_seq))
        return self.capacity

    def _lay_out(self, capacity: int) -> None:
        """Lay every buffer's slots out at `capacity` a sequence: each (slot, KV head) row's first
        positions (those any slot may still read) moved to its place at the new stride, the rows
        taken in the order that reads each before anything overwrites it."""
        old, keep = self.capacity, int(min(self.capacity, capacity, self._ends.max()))
        for i, flat in enumerate(self._flat):
            heads, dim = self.spec.kv_shapes[i]
            rows = range(1, self.max_batch * heads)
            for r in reversed(rows) if capacity > old else rows:
                flat[r * capacity * dim : (r * capacity + keep) * dim] = flat[r * old * dim : (r * old + keep) * dim]
        self.capacity = capacity
        np.minimum(self._ends, capacity, out=self._ends)  # a released slot's K/V past it are gone
        self.kv = self._views()
        self._bindings.clear()  # each bound the buffers at the old stride
        self._windows.clear()
        self._batch_bindings.clear()

    def _views(self) -> list[np.ndarray]:
        """Each buffer's slots as laid out now: [max_batch, Hkv, capacity, D] over its memory."""
        c = self.capacity
        return [flat[: self.max_batch * heads * c * dim].reshape(self.max_batch, heads, c, dim)
                for flat, (heads, dim) in zip(self._flat, self.spec.kv_shapes)]

    # -- bindings --------------------------------------------------------------------------
    def _bind_kv(self, binding: ort.IOBinding, first: int, b: int) -> ort.IOBinding:
        """Bind slots first..first+B-1 of every KV buffer, by address, as [B, Hkv, C, D] in and out
        (C: the capacity they are laid out at; max_seq but for a graph reading them as bound)."""
        device = self.placement.device
        for i, ((inp, out), value) in enumerate(zip(self.spec.kv_names, self._kv_values)):
            shape = [b, *self.spec.kv_shape(i, 1, self.capacity)[1:]]
            address = value.data_ptr() + first * (self._slot_bytes[i] // self.max_seq) * self.capacity
            binding.bind_input(inp, device.kind, device.index, self._kv_dtype, shape, address)
            binding.bind_output(out, device.kind, device.index, self._kv_dtype, shape, address)
        return binding

    def _kv_binding(self) -> ort.IOBinding:
        return self._bind_kv(self.session.io_binding(), 0, 1)

    def _batch_binding(self, first: int, b: int) -> ort.IOBinding:
        binding = self._batch_bindings.get((first, b))
        if binding is None:
            binding = self._batch_bindings[(first, b)] = self._bind_kv(self.session.io_binding(), first, b)
        return binding

    def _rebind(self, stage: _Stage, window: int, last: bool) -> tuple[ort.IOBinding, ort.RunOptions | None]:
        """An uncaptured pass: its shape's binding (the K/V, token inputs and logits bound
        once), the mask rebound where its window changed (the exact window moves every pass)."""
        self.uncaptured_runs += 1
        key = (stage.t, last)
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bindings[key] = self._kv_binding()
            stage.bind(binding, last)
        if self._windows.get(key) != window:
            stage.bind_mask(binding, window)
            self._windows[key] = window
        return binding, self._uncaptured

    def _graph(self, stage: _Stage, window: int) -> tuple[ort.IOBinding, ort.RunOptions]:
        """A captured pass shape: its binding (bound once, never rebound: the graph replays its
        addresses) and its RunOptions with its own gpu_graph_id (0 is ONNX Runtime's, -1 none)."""
        self.captured_runs += 1
        key = (stage.t, window)
        if key not in self._graphs:
            binding = self._kv_binding()
            stage.bind(binding)
            stage.bind_mask(binding, window)
            self._graphs[key] = (binding, _run_options(len(self._graphs) + 1))
        return self._graphs[key]


def tree_capable(spec: ModelSpec, placement: Placement) -> bool:
    """Whether this graph verifies token trees (`forward(..., tree=)`, `move_kv`).

    Not a fused graph: GroupQueryAttention takes neither positions nor a mask (it derives both
    from the write index). Not a sliding window. Not an int graph: MatMulNBits quantizes its
    activations to int8 blocks, and a tree row attends over the same values as a single step
    but at other slots, so its sums round differently (fp32: within 3e-5 of the step's logits);
    through int8 activations that becomes up to 1.5 (SmolLM2 int4, measured), enough to change
    greedy tokens. Not a GPU yet: `move_kv` copies on the host (the torch backend runs trees
    on CUDA). Not a model with recurrent states: a tree's rows are not one sequence, and a
    recurrence runs its rows in order."""
    return (spec.attention != "fused" and spec.sliding_window is None and spec.dtype in FLOAT_DTYPES
            and placement.device.kind == "cpu" and not spec.state_names)


def _run_options(graph_id: int) -> ort.RunOptions:
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(graph_id))
    return options


__all__ = ["OrtEngine", "PROVIDER_DTYPES", "Placement", "THREAD_POOLS", "THREAD_POOL_ENV", "check_placement", "session_options",
           "settle_thread_pool", "share_cpu_threads", "thread_pool_choice", "trt_options"]
