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

A greedy round with a model draft (`draft_chain` on the draft's engine, `verify_chain` on the
target's) synchronises the host once, when both engines were built with the argmax output
(core.trt_profiles.ARGMAX, added by `specdeploy build`):

    draft: stage -> pass -> argmax row copied device-to-device into the next step's input_ids
           (k steps back to back on the draft's stream) -> record an event
    target: wait on that event -> stage -> copy the k tokens device-to-device into input_ids
           -> verify pass -> the k+1 argmaxes and the k draft tokens down -> one synchronisation

Each engine keeps its own stream (forks and pools stay independent); the target's stream waits
on the draft's event instead of sharing it, so the one synchronisation, of the target's stream,
also covers every step of the draft. An engine built without the output has neither method, so
`ModelDrafter.fused_with` is False and the loop runs its per-pass round. Sampled rounds are not
fused: `draft_chain` with sampling parameters runs its k passes with a synchronisation each and
samples on the host, and `verify_chain` with draft probabilities is one plain pass.

This module owns the engine (`TrtEngine`, its `DraftChain`) and `_Driver`, the stream
operations `trt_layout.StepGraphs` captures and replays through. Around it: `cuda` (the
checked cudart calls, importing TensorRT and cuda-python), `trt_plan` (the plan's version, GPU
and I/O checks, and its loading), `trt_layout` (pool offsets, CUDA-graph bookkeeping) and
`specdeploy.core.trt_profiles` (the optimization profiles, shared with the build).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdeploy.core.choices import NUMPY_DTYPES
from specdeploy.core.errors import BundleError, InputError
from specdeploy.core.graph_io import check_pass, fill_mask, window_length
from specdeploy.core.manifest import ModelSpec
from specdeploy.core.trt_profiles import ARGMAX, Profile, batch_inputs, select_profile

from specdeploy.runtime.decoding.engine import Checked, EngineBase
from specdeploy.runtime.decoding.sampling import sample, warp
from .cuda import Cuda, CudaError, import_modules
from .trt_layout import STAGED_INPUTS, CaptureError, EnqueueError, ShapeKey, StepGraphs, engine_layout, step_slot
from .trt_plan import LoadedEngine, check_engine_compat, load_engine

DEFAULT_LENGTH_BUCKET = 64  # the smallest attention window a pass runs with (see window_length)


@dataclass
class DraftChain:
    """The k tokens of one `draft_chain`. `tokens` [k] is host memory: filled by the round's one
    synchronisation for a greedy chain, at once for a sampled one. A greedy chain's tokens are
    also in device memory at `address`, complete once the event `done` has completed: what the
    verify pass waits on and reads. Valid until the engine's next chain."""

    tokens: np.ndarray
    address: int | None = None
    done: object = None
    probs: np.ndarray | None = None  # a sampled chain's draft probs [k, V] (drawn on the host)


class TrtEngine(EngineBase):
    """One graph of a bundle as a TensorRT engine, on one CUDA stream of its own."""

    features = None  # no hidden-state output: an EAGLE-3 bundle runs on ort or torch

    def __init__(
        self, plan_path: Path, spec: ModelSpec, max_seq: int, entry: dict, *,
        length_bucket: int = DEFAULT_LENGTH_BUCKET, cuda_graphs: bool = True, max_graphs: int = 64, modules=None,
        _loaded: LoadedEngine | None = None,
    ):
        self.spec = spec
        self.plan_path = Path(plan_path)
        self.entry = entry
        self.name = f"{spec.role} ({self.plan_path.name})"
        self.max_seq = max_seq
        self.runs = 0  # passes begun (see OrtEngine.runs)
        self.vocab_size = spec.vocab_size
        self.length_bucket = length_bucket
        if spec.dtype not in NUMPY_DTYPES:  # its host staging is numpy, which has no bfloat16
            from .ort import no_bfloat16

            raise InputError(no_bfloat16(spec, self.plan_path.name, "the trt backend"))
        if spec.state_names:
            raise InputError(f"{self.name}: a model with linear-attention layers runs on ONNX Runtime's CPU provider; "
                             "the trt backend keeps no recurrent states yet")
        self._modules = modules or import_modules()
        trt, cudart = self._modules
        self._cuda = cuda = Cuda(cudart)
        if _loaded is None:
            check_engine_compat(str(self.plan_path), entry, trt.__version__, cuda.device())
            _loaded = load_engine(trt, self.plan_path, spec, entry, max_seq)
        self._loaded = _loaded
        self.device = f"cuda:{cuda.call('cudaGetDevice')}"  # fused rounds need draft and target on one GPU
        self.profiles = [Profile.from_dict(p) for p in entry["profiles"]]
        self.t_max = max(p.t_max for p in self.profiles)
        capture_max_t = max((p.t_max for p in self.profiles if p.name != "prefill"), default=1)
        self.argmax = entry.get("argmax_output")
        # The longest draft chain: its verify pass, k+1 tokens, must fit the verify profile.
        self.max_chain = capture_max_t - 1 if self.argmax else 0
        dtypes = _loaded.dtypes
        kv_in = [i for i, _ in spec.kv_names]
        kv_nbytes = [int(np.prod(spec.kv_shape(i, 1, max_seq))) * np.dtype(spec.kv_dtype).itemsize
                     for i in range(len(kv_in))]
        itemsize = {n: dtypes[n].itemsize for n in (*STAGED_INPUTS, "logits")}
        self.layout = layout = engine_layout(
            self.t_max, max_seq, spec.vocab_size, kv_in, kv_nbytes, itemsize, self.max_chain
        )

        # A non-blocking stream of our own: CUDA graphs cannot be captured on the default stream, and
        # TensorRT adds cudaDeviceSynchronize() calls on it ("please use non-default stream instead",
        # IExecutionContext.execute_async_v3, TensorRT 10.15 Python docs).
        self._stream = cuda.call("cudaStreamCreateWithFlags", cudart.cudaStreamNonBlocking)
        self._stream_handle = int(self._stream)
        self._pool = int(cuda.call("cudaMalloc", layout.total))
        # Zero-filled once: slots past the length hold finite values, so the padded window
        # (masked -inf) adds exact zeros.
        cuda.call("cudaMemsetAsync", self._pool, 0, layout.total, self._stream)
        staged = layout.end("logits")  # the host mirror of [staged inputs | argmax rows, chain | logits]
        self._host = int(cuda.call("cudaMallocHost", staged))
        raw = cuda.host_view(self._host, staged)
        views = {n: dtypes[n] for n in (*STAGED_INPUTS, "logits")}
        if self.max_chain:
            views.update({ARGMAX: dtypes["input_ids"], "chain": dtypes["input_ids"]})
        self._h = {n: raw[layout.offset(n) : layout.end(n)].view(dtype) for n, dtype in views.items()}
        self._addresses = {n: self._pool + layout.offset(n) for n in (*STAGED_INPUTS, "logits", *kv_in)}
        for past, present in spec.kv_names:
            self._addresses[present] = self._addresses[past]  # one buffer: aliased input and output
        self._slots_host = None
        if self.max_chain:
            self._addresses[self.argmax] = self._pool + layout.offset(ARGMAX)
            self._slot_at, slot_bytes = step_slot(layout, max_seq, dtypes["attention_mask"].itemsize)
            self._slots = self._step_slots(max(1, self.max_chain - 1), slot_bytes)  # one at least: no empty allocation
            # Timing events (the default flags): the chain's duration, and what the verify waits on.
            self._events = (cuda.call("cudaEventCreate"), cuda.call("cudaEventCreate"))
        self._driver = _Driver(self)
        self._contexts = [self._new_context(i) for i in range(len(self.profiles))]  # eager runs, per profile
        self.graphs = StepGraphs(enabled=cuda_graphs, max_t=capture_max_t, max_graphs=max_graphs)
        self._chunked: dict[int, np.ndarray] = {}
        self.last_mode = ""
        self.host_syncs = 0  # synchronisations made by passes and rounds
        self.fused = 0  # greedy draft chains run on the device, or verify passes fed by one
        self._chain_host_seconds = 0.0  # the last chain's wall time outside its events (its plain passes)
        self._chain_evented = False
        cuda.call("cudaStreamSynchronize", self._stream)  # the memset, once, before any pass

    def _step_slots(self, count: int, nbytes: int) -> list[tuple[int, dict[str, np.ndarray]]]:
        """Pinned host staging for steps 1..count of a draft chain, one slot of `nbytes` each:
        (address, views of position_ids, write_indices and a one-row mask at their offsets in the pool)."""
        self._slots_host = int(self._cuda.call("cudaMallocHost", count * nbytes))
        raw = self._cuda.host_view(self._slots_host, count * nbytes)
        slots = []
        for j in range(count):
            views = {}
            for n, size in (("position_ids", 1), ("write_indices", 1), ("attention_mask", self.max_seq)):
                dtype = self._h[n].dtype
                at = j * nbytes + self.layout.offset(n) - self._slot_at
                views[n] = raw[at : at + size * dtype.itemsize].view(dtype)
            slots.append((self._slots_host + j * nbytes, views))
        return slots

    @classmethod
    def from_bundle(cls, bundle, spec: ModelSpec, threads: int | None = None, **kwargs) -> "TrtEngine":
        entry = spec.trt
        if entry is None:
            raise BundleError(
                f"{bundle.path}: no TensorRT engine for the {spec.role} model; build it with `specdeploy build {bundle.path}`"
            )
        onnx_sha = bundle.manifest.files.get(spec.graph)
        if entry.get("onnx_sha256") not in (None, onnx_sha):
            raise BundleError(
                f"{bundle.file(entry['plan'])}: built from another {spec.graph}; rebuild it with `specdeploy build {bundle.path}`"
            )
        return cls(bundle.file(entry["plan"]), spec, bundle.max_seq, entry, **kwargs)

    def resumable(self, length: int) -> int:
        return length  # K/V only: any prefix (see Engine.resumable)

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
        return {
            **self.graphs.stats(), "length_bucket": self.length_bucket, "last_mode": self.last_mode,
            "host_syncs": self.host_syncs, "fused": self.fused,
        }

    def _forward(self, token_ids: np.ndarray, start: int, tree, last: bool, features) -> np.ndarray:
        """token_ids [T] at positions start..start+T-1 -> logits [T, V]. `last` (the caller
        reads only the last row) changes nothing: a plan takes no logits_rows (see build). No
        trees, no hidden states (`trees` False, `features` None: the caller passes neither).

        The returned array views this engine's pinned host buffer: valid until the next pass.
        """
        t = token_ids.shape[0]
        if t > self.t_max:
            return self._forward_chunked(token_ids, start)
        # The staging buffer is rewritten only after the previous pass's synchronisation: memory bound
        # to a pass must not change before the stream is synchronised (execute_async_v3 docs).
        self._run(self._stage(token_ids, start, t))
        nbytes = t * self.vocab_size * self._h["logits"].itemsize
        logits_at = self.layout.offset("logits")
        self._copy(self._host + logits_at, self._pool + logits_at, nbytes, "DeviceToHost")
        self._sync()  # the one host synchronisation of the pass: the caller needs the logits on the host
        logits = self._h["logits"][: t * self.vocab_size].reshape(t, self.vocab_size)
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

    # -- a greedy round with one host synchronisation ------------------------------------------
    trees = False  # the plan's profiles and the argmax output are built for chains

    @property
    def chains(self) -> bool:
        """Only an engine built with the argmax output chains a greedy round on the device; an
        older one (or a pair with one) keeps the loop's per-pass round."""
        return bool(self.max_chain)

    def _require_argmax(self, what: str) -> None:
        if not self.max_chain:
            raise InputError(
                f"{self.name}: no {what}: the engine has no argmax output (built before it existed); "
                "rebuild it with `specdeploy build BUNDLE` for rounds with one host synchronisation"
            )

    def draft_chain(self, pending: np.ndarray, start: int, k: int, params=None, seed: int | None = None) -> "DraftChain":
        """Draft k tokens: one pass over `pending` (the tokens this cache has not seen, at positions
        start..), then k-1 single steps, each fed the previous step's token.

        Greedy (no `params`, or greedy ones): on the device, no host synchronisation. Each step's
        argmax row is copied device-to-device into the next step's input_ids and into `chain`;
        returns a DraftChain, which `verify_chain` of the target reads and brings back. A `pending`
        longer than every profile (the first round after a long prompt) runs its leading chunks as
        plain passes, one synchronisation each; the last chunk opens the chain.
        Sampled: not fused. Each pass comes back to the host, where the token is drawn from the
        warped distribution with a generator seeded by `seed`; the chain carries draft_probs [k, V].

        Inputs staging: step 0 stages in the engine's own area, step i >= 1 in slot i-1 (its
        position, write index and mask; its token is already on the device). The host never
        waits inside a chain, so a slot's host-to-device copy may run long after the host has
        moved on: one slot per step, rewritten only by the next chain, after the round's
        synchronisation has drained every copy of this one. The device-side rewrites of a pass's
        bound inputs (the next step's staging, its token) are enqueued on the pass's own stream
        after it, so they run once it has finished: what `forward`'s rule (no change to bound
        memory before the synchronisation) guards against is a write the stream does not order.
        """
        self._require_argmax("draft_chain")
        pending = np.asarray(pending, dtype=np.int64)
        check_pass(self.name, pending, start, self.max_seq, self.vocab_size)
        t = pending.shape[0]
        if not 1 <= k <= self.max_chain or start + t + k - 1 > self.max_seq:
            raise InputError(
                f"{self.name}: a draft chain of {k} from position {start + t} needs 1 <= k <= {self.max_chain} "
                f"and its positions inside the KV buffer [0, {self.max_seq})"
            )
        t0 = time.perf_counter()
        if params is not None and not params.greedy:
            return self._sampled_chain(pending, start, k, params, seed, t0)
        lead = t - 1 - (t - 1) % self.t_max  # whole chunks before a last one of 1..t_max tokens
        for s in range(0, lead, self.t_max):
            self.forward(pending[s : s + self.t_max], start + s)
        self._chain_host_seconds, self._chain_evented = time.perf_counter() - t0, True
        pending, pos = pending[lead:], start + lead
        cuda, stream = self._cuda, self._stream
        cuda.call("cudaEventRecord", self._events[0], stream)
        itemsize = self._h["chain"].itemsize
        argmax_at, chain_at = self._pool + self.layout.offset(ARGMAX), self._pool + self.layout.offset("chain")
        key, row = self._stage(pending, pos, pending.shape[0]), pending.shape[0] - 1
        pos += pending.shape[0]
        for i in range(k):
            if i:
                key, row = self._stage_step(self._slots[i - 1], pos), 0
                pos += 1
            self._run(key)
            token_at = argmax_at + row * itemsize  # this step's token: the argmax of its last row
            self._copy(chain_at + i * itemsize, token_at, itemsize, "DeviceToDevice")
            if i + 1 < k:  # after the pass that read input_ids, before the one that reads it next
                self._copy(self._addresses["input_ids"], token_at, itemsize, "DeviceToDevice")
        self._copy(self._host + self.layout.offset("chain"), chain_at, k * itemsize, "DeviceToHost")
        cuda.call("cudaEventRecord", self._events[1], stream)
        self.fused += 1
        return DraftChain(self._h["chain"][:k], chain_at, self._events[1])

    def _sampled_chain(self, pending, start, k, params, seed, t0):
        rng = np.random.default_rng(seed)
        tokens = np.empty(k, dtype=np.int64)
        draft_probs = np.empty((k, self.vocab_size), dtype=np.float64)
        for i in range(k):
            draft_probs[i] = warp(self.forward(pending, start)[-1], params)
            tokens[i] = sample(draft_probs[i], rng)
            start += pending.shape[0]
            pending = tokens[i : i + 1]
        self._chain_host_seconds, self._chain_evented = time.perf_counter() - t0, False
        return DraftChain(tokens, probs=draft_probs)

    def chain_seconds(self) -> float:
        """The last draft chain's duration: for a greedy chain CUDA-event time (readable once the
        round's synchronisation has passed its end) plus any leading plain passes, for a sampled
        one wall clock."""
        if not self._chain_evented:
            return self._chain_host_seconds
        return self._chain_host_seconds + self._cuda.call("cudaEventElapsedTime", *self._events) / 1000

    def verify_chain(self, last: int, chain: DraftChain, start: int) -> Checked:
        """The verify pass over [last, *chain's tokens] at positions start..start+k.

        Greedy: the target's stream waits on the chain's event, the tokens go device-to-device into
        input_ids, and only the k+1 argmax rows (and the chain's tokens) come back, after the
        round's one synchronisation: the verdict carries the target's argmax per row [k+1].
        A sampled chain (it carries its draft probs): one plain pass; the verdict carries the
        target's logits [k+1, V] float32.
        """
        self._require_argmax("verify_chain")
        k = chain.tokens.shape[0]
        if chain.probs is not None:
            logits = self.forward(np.concatenate([[last], chain.tokens]).astype(np.int64), start)
            return Checked(chain.tokens.copy(), chain.probs, target_logits=logits.copy())
        self.runs += 1
        t = k + 1
        check_pass(self.name, np.array([last], dtype=np.int64), start, self.max_seq - k, self.vocab_size)
        if t > self.max_chain + 1:
            raise InputError(f"{self.name}: a verify pass of {t} tokens; the engine's verify profile takes up to {self.max_chain + 1}")
        # Every step of the draft, on its own stream, before anything of this pass.
        self._cuda.call("cudaStreamWaitEvent", self._stream, chain.done, 0)
        key = self._stage(np.array([last], dtype=np.int64), start, t)
        # The staging copy carried stale ids in rows 1..k; the chain's tokens replace them after it.
        itemsize = self._h[ARGMAX].itemsize
        self._copy(self._addresses["input_ids"] + itemsize, chain.address, k * itemsize, "DeviceToDevice")
        self._run(key)
        argmax_at = self.layout.offset(ARGMAX)
        self._copy(self._host + argmax_at, self._pool + argmax_at, t * itemsize, "DeviceToHost")
        self._sync()  # the one host synchronisation of the round; the chain's copy down is done too
        self.fused += 1
        return Checked(chain.tokens.astype(np.int64), target_tokens=self._h[ARGMAX][:t].astype(np.int64))

    # -- staging, copies, the pass -----------------------------------------------------------------

    def _key(self, start: int, t: int) -> ShapeKey:
        return ShapeKey(select_profile(self.profiles, t), t, window_length(start, t, self.length_bucket, self.max_seq))

    def _stage(self, first_ids: np.ndarray, start: int, t: int) -> ShapeKey:
        """Stage a pass of t tokens at `start` (its first len(first_ids) token ids included) in
        the engine's host area and enqueue one host-to-device copy of [input_ids .. mask]."""
        h = self._h
        h["input_ids"][: first_ids.shape[0]] = first_ids
        h["position_ids"][:t] = np.arange(start, start + t)
        h["write_indices"][0] = start
        key = self._key(start, t)
        fill_mask(h["attention_mask"][: t * key.length].reshape(t, key.length), start, self.spec.sliding_window)
        staged = self.layout.offset("attention_mask") + t * key.length * h["attention_mask"].itemsize
        self._copy(self._pool, self._host, staged, "HostToDevice")
        return key

    def _stage_step(self, slot: tuple[int, dict[str, np.ndarray]], pos: int) -> ShapeKey:
        """Stage a single chain step at `pos` in its own slot: its position, write index and mask
        go up; input_ids, copied on the device, stay out of the copy."""
        address, views = slot
        key = self._key(pos, 1)
        views["position_ids"][0] = pos
        views["write_indices"][0] = pos
        fill_mask(views["attention_mask"][: key.length].reshape(1, key.length), pos, self.spec.sliding_window)
        mask = views["attention_mask"]
        nbytes = self.layout.offset("attention_mask") - self._slot_at + key.length * mask.itemsize
        self._copy(self._pool + self._slot_at, address, nbytes, "HostToDevice")
        return key

    def _copy(self, dst: int, src: int, nbytes: int, direction: str) -> None:
        kind = getattr(self._cuda.rt.cudaMemcpyKind, f"cudaMemcpy{direction}")
        self._cuda.call("cudaMemcpyAsync", dst, src, nbytes, kind, self._stream)

    def _run(self, key: ShapeKey) -> None:
        self.last_mode = self.graphs.run(key, self._driver)  # a captured graph reads the same addresses

    def _sync(self) -> None:
        self._cuda.call("cudaStreamSynchronize", self._stream)
        self.host_syncs += 1

    def _new_context(self, profile: int):
        # Several contexts may select one profile: since 10.x setOptimizationProfileAsync no longer
        # asks for a profile unused by other contexts (NvInferRuntime.h, TensorRT 10.15 and 11.1);
        # the profile switch is enqueued on our stream, the one every pass of the context uses.
        ctx = self._loaded.engine.create_execution_context()
        if ctx is None:
            raise CudaError(f"{self.name}: TensorRT could not create an execution context (out of device memory?)")
        if not ctx.set_optimization_profile_async(profile, self._stream_handle):
            raise CudaError(f"{self.name}: could not select optimization profile {profile}")
        # a graph with a batch dimension: this engine runs one sequence per pass, so its other
        # batched inputs (write_indices, the KV buffers) are set once, at B = 1
        for name, dims in batch_inputs(self.spec).items():
            if not ctx.set_input_shape(name, (1, *dims)):
                raise InputError(f"{self.name}: {name} shape {[1, *dims]} is outside the engine's profile {profile}; "
                                 "rebuild the engine")
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
        for free, attr in (("cudaFree", "_pool"), ("cudaFreeHost", "_host"), ("cudaFreeHost", "_slots_host")):
            if getattr(self, attr, None) is not None:
                cuda.call(free, getattr(self, attr))
                setattr(self, attr, None)
        for event in getattr(self, "_events", ()):
            cuda.call("cudaEventDestroy", event)
        self._events = ()
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


__all__ = ["DraftChain", "TrtEngine"]
