"""PyTorch backend: the export stage's own module over KV buffers allocated once.

Eager on a CPU (so CI runs every line of its bookkeeping); on a CUDA device each distinct
pass shape is captured once with `torch.cuda.graph` and replayed. Importing this module
imports torch: the factory in `backends/__init__.py` imports it only when `torch` is chosen.

The fixed-shape formulation. The graph contract's mask is `[1, 1, T, L]` with L = start+T,
so its shape changes on every step, and a captured graph has fixed shapes. A pass whose T
may be captured therefore attends over a window of Lb slots, Lb the smallest power of two
>= start+T (at least `min_window`, at most max_seq), with the mask built on the device
from the write position: column j of row i is 0 where j <= start+i (and, with a sliding
window W, j > start+i-W), else -inf. Columns start+T..Lb-1 are -inf. That is exact:
  - their scores are q.k + (-inf) = -inf for any finite k (slots hold zeros from the
    allocation or K/V the model wrote, never anything else), so the row's max is
    unchanged and each contributes exp(-inf) = 0 to the softmax sum;
  - their probability is exactly 0, and 0 * v = 0 for finite v in probs @ V.
So every row sums the same non-zero terms as the exact-L pass; only the order in which a
kernel adds them may differ, i.e. the same rounding class as any change of kernel.
Buckets keep the attention's cost following the context (at most 2x the exact window),
and the number of graphs small: one per (T, Lb), T <= max draft + 1; prefill chunks run
eager with the exact window. `tests/test_torch_backend.py` checks bucketed against exact
on the CPU, `proofs/gpu_check.py` checks replay against eager on a GPU.

Host synchronisation: inputs go up as one small copy from pinned memory (the token ids and
the write position; positions and mask are computed on the device), the logits come back
into pinned memory and the stream is synchronised once: the only sync of a pass.

A greedy round with a model draft needs less: `draft_chain` runs the draft's k steps on
the device, each step's argmax written into the next step's input and the write position
advanced on the device, and `verify_chain` feeds those tokens to the target's verify pass
from device memory and brings back only the k draft tokens and the k+1 target argmaxes:
one host synchronisation per round (the loop uses it when both engines offer it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specdeploy.core.errors import InputError
from specdeploy.core.choices import FLOAT_DTYPES
from specdeploy.core.manifest import ModelSpec, kept_positions
from specdeploy.core.graph_io import AUX_HIDDEN, DRAFT_HIDDEN_OUT, check_pass, fill_mask, fill_tree_mask, window_length

from specdeploy.runtime.decoding.engine import Checked, EngineBase

from .recurrent import RecurrentStates


@dataclass
class TorchEngineStats:
    device: str = "cpu"
    capture: bool = False  # whether passes of T <= capture_max_t are captured
    passes: int = 0
    replays: int = 0  # passes served by a captured graph
    eager: int = 0
    host_syncs: int = 0  # one per pass (the logits copy); none for a draft chain, one per verify_chain
    graphs: list[tuple[int, int]] = field(default_factory=list)  # (T, Lb) of each captured graph
    capture_seconds: float = 0.0
    capture_error: str | None = None  # set when a capture failed; the engine then stays eager
    device_seconds: float = 0.0  # CUDA-event time of the passes, when `time_device` is on

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["graphs"] = [list(k) for k in self.graphs]
        return d


def warp_torch(logits: torch.Tensor, params) -> torch.Tensor:
    """sampling.warp on the device: logits [V] -> probs [V] float64 after temperature, top-k,
    then top-p (same rules). The verifier receives these probabilities with the tokens drawn
    from them, so the loop stays lossless whatever rounding separates them from the host's."""
    z = logits.double() / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k).values[-1]
        z = torch.where(z < kth, float("-inf"), z)
    probs = torch.softmax(z, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        keep_sorted = (torch.cumsum(sorted_probs, -1) - sorted_probs) < params.top_p
        keep = torch.zeros_like(keep_sorted).scatter_(0, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum()
    return probs


def sample_torch(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One draw from probs [V] by inverse CDF on the device -> int64 [1]; no host sync."""
    cdf = torch.cumsum(probs, 0)
    u = torch.rand(1, generator=gen, dtype=torch.float64, device=probs.device) * cdf[-1]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[0] - 1)


def capture_pass(run, device: torch.device, pool, warmup: int) -> tuple["torch.cuda.CUDAGraph", torch.Tensor]:
    """Capture `run` (a pass: no host synchronisation) as a CUDA graph -> (graph, its output).
    It warms up `warmup` times on a side stream first, on the pass's own inputs, so the K/V
    the warm-up writes are the ones a replay writes again. The graphs of one engine share one
    memory `pool`: passes never overlap and each output is copied out before the next replay.
    Raises RuntimeError where the pass cannot be captured."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


@dataclass
class TorchChain:
    """A draft chain's tokens [k] (and, sampled, its draft probs [k, V]) in device memory."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None


class TorchEngine(EngineBase):
    """One graph of a bundle as the export stage's `SpecGraph`, on a CPU or a CUDA device.

    graph: a SpecGraph (its weights on `device`); spec: the bundle's numbers for it.
    capture: capture passes with CUDA graphs (default: on a CUDA device).
    buckets: use the fixed-window formulation for T <= capture_max_t (default: as
    `capture`; on the CPU it can be turned on to check it against the exact window).
    """

    def __init__(
        self,
        graph,
        spec: ModelSpec,
        max_seq: int,
        device: str | torch.device | None = None,
        capture: bool | None = None,
        buckets: bool | None = None,
        capture_max_t: int = 9,
        min_window: int = 64,
        warmup: int = 2,
        keep_states: int = 16,
        max_batch: int = 1,
    ):
        self._options = dict(capture=capture, buckets=buckets, capture_max_t=capture_max_t, min_window=min_window,
                             warmup=warmup, keep_states=keep_states, max_batch=max_batch)
        recurrent = bool(spec.state_names)
        # draft_chain / verify_chain: a round with one host synchronisation (not over recurrent
        # states: a pass reads the state kept at its start, which the host picks)
        self.chains = not recurrent
        # tree passes (forward(..., tree=)): float graphs without a sliding window (see the ort
        # backend's tree_capable); run eager, with the exact window
        self.trees = spec.dtype in FLOAT_DTYPES and spec.sliding_window is None and not recurrent
        self.spec = spec
        self.name = f"{spec.role} (torch)"
        self.max_seq = max_seq
        self.runs = 0  # passes begun (see OrtEngine.runs)
        self.vocab_size = spec.vocab_size
        self.device = torch.device(device) if device is not None else next(graph.parameters()).device
        cuda = self.device.type == "cuda"
        # An EAGLE-3 bundle's hidden states (core/graph_io.py): a target writes each pass's
        # AUX_HIDDEN rows at their positions into `features`; a head takes its inputs per pass
        # and leaves its state in `outputs`. Eager only for now: no pass of theirs is captured.
        self.feature_inputs, self.feature_outputs = spec.feature_inputs, spec.feature_outputs
        eager = bool(self.feature_inputs or self.feature_outputs) or recurrent
        self.capture = cuda if capture is None else (capture and cuda)
        self.capture = self.capture and not eager
        self.buckets = self.capture if buckets is None else (buckets and not eager)
        width = self.feature_outputs.get(AUX_HIDDEN)
        # per KV slot, [max_batch, max_seq, width] on the device; `slot_features` on the host (a view
        # on a CPU), what a head reads; `features` slot 0's (what `forward` writes)
        self._features = torch.zeros((max_batch, max_seq, width), dtype=torch.float32, device=self.device) \
            if width else None
        self.slot_features = None if width is None else (
            self._features.numpy() if not cuda else np.zeros((max_batch, max_seq, width), np.float32))
        self.features = None if width is None else self.slot_features[0]
        self._feature_in = {name: torch.zeros((1, max_seq, w), dtype=torch.float32, device=self.device)
                            for name, w in self.feature_inputs.items()}
        self.outputs: dict[str, np.ndarray] = {}
        self._last = False  # the pass under way: its caller reads its last row only (see forward)
        self._state = None  # a head's last pass's states [1, T, H] on the device
        self.capture_max_t = capture_max_t
        self.min_window = min_window
        self.warmup = warmup
        self.time_device = False  # bench turns this on: CUDA events around each pass
        self.graph = graph.to(self.device).eval()
        self.graph.inplace = True  # write the buffers below where they lie
        self.stats = TorchEngineStats(device=str(self.device), capture=self.capture)
        # A model with linear-attention layers: its recurrent states kept by position, as the ort
        # backend keeps them (backends/recurrent.py), on the device; passes run eager
        self.states = RecurrentStates(spec, keep_states, self.name,
                                      lambda shape: torch.zeros(shape, dtype=torch.float32, device=self.device))
        kv_dtype = getattr(torch, spec.kv_dtype)
        # Allocated once, never moved: rollback is the caller moving its length back. Slot b is
        # [b] of each [max_batch, Hkv, S, D] buffer: a run of neighbouring slots is a view the
        # module writes in place; `forward` runs slot 0.
        self.max_batch = max_batch
        self.kv = [torch.zeros(spec.kv_shape(i, max_batch, max_seq), dtype=kv_dtype, device=self.device)
                   for i in range(len(spec.kv_names))]
        self._kv0 = [buffer[:1] for buffer in self.kv]
        self._arange = torch.arange(max_seq, device=self.device)
        # [write position, token ids...]: the only data a pass sends up.
        self._io = torch.zeros(max_seq + 1, dtype=torch.int64, device=self.device)
        self._stage = torch.zeros(max_seq + 1, dtype=torch.int64, pin_memory=cuda) if cuda else self._io
        self._stage_np = self._stage.numpy()
        # batched passes: per slot [write index, token ids...], staged the same way
        self._io_b = torch.zeros((max_batch, max_seq + 1), dtype=torch.int64, device=self.device)
        self._stage_b = torch.zeros_like(self._io_b, device="cpu", pin_memory=cuda) if cuda else self._io_b
        self._stage_b_np = self._stage_b.numpy()
        self._host_b: dict[tuple[int, int], torch.Tensor] = {}
        self._host_logits: dict[int, torch.Tensor] = {}  # pinned [T, V] per distinct T
        # captured passes: (T, window) for one sequence, (first slot, lanes, T, window) for a batch
        self._graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        # The fused greedy round: draft tokens produced on the device, and what comes back.
        self._chain_out = torch.zeros(max_seq, dtype=torch.int64, device=self.device)
        self._chain_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        self._chain_host_seconds = 0.0
        self._host_buffers: dict = {}
        self._result = torch.zeros(2 * max_seq + 1, dtype=torch.int64, device=self.device)
        self._result_host = torch.zeros(2 * max_seq + 1, dtype=torch.int64, pin_memory=cuda) if cuda else self._result

    @classmethod
    def from_bundle(cls, bundle, spec: ModelSpec, device=None, threads: int | None = None, batch: int | None = None,
                    **options) -> "TorchEngine":
        """Rebuild the module the export stage exported, from the source model the manifest
        names (the bundle's ONNX file is not read). Needs the `export` extra. `batch`: an engine
        for batched passes over that many KV slots (`forward_batch`; runtime/decoding/batch.py)."""
        from specdeploy.export import rebuild_graph

        if threads:
            torch.set_num_threads(threads)  # process-wide: torch has no per-module setting
        if batch is not None:
            if spec.dtype in ("int8", "int4"):
                raise InputError(
                    f"{bundle.path}: an {spec.dtype} {spec.role} graph on --backend torch: its rows are not bit-identical "
                    "from one pass shape to another (docs/backends.md), so a request's output would depend on the batch; "
                    "use --backend ort, or a float bundle")
            if spec.feature_inputs:
                raise InputError(f"{spec.role}: an EAGLE-3 head runs one sequence a pass (each lane's head is its own)")
            if spec.state_names:
                raise InputError(f"{spec.role}: a model with linear-attention layers batches on --backend ort (the "
                                 "torch backend's batched passes keep no recurrent states yet)")
            options["max_batch"] = batch
        if spec.role == "target" and spec.dtype in ("int8", "int4") and bundle.draft.kind != "none":
            raise InputError(
                f"{bundle.path}: an {spec.dtype} target on --backend torch: its verify rows are not bit-identical to single "
                "steps (PyTorch sums a pass of several tokens in another order than one token, and the int8 activation "
                "rounding amplifies that), so speculation could change the output; use --backend ort, a float bundle, "
                "or --draft none")
        if spec.architecture == "eagle3":  # an EAGLE-3 head, rebuilt from its folder and the target's embedding
            from specdeploy.export.eagle3_export import rebuild_head

            graph = rebuild_head(spec, bundle.model("target"))
        elif bundle.draft.kind == "mtp" and spec.role == "draft":  # the MTP layer, from the target's checkpoint
            from specdeploy.export.mtp import rebuild_mtp

            graph = rebuild_mtp(spec)
        else:
            eagle = bundle.draft.kind in ("eagle3", "mtp") and spec.role == "target"
            graph = rebuild_graph(spec, tuple(bundle.draft.aux_layers) if eagle else None)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        options.setdefault("capture_max_t", bundle.max_draft + 1)  # a verify pass's largest T
        options.setdefault("keep_states", kept_positions(bundle.max_draft))
        return cls(graph, spec, bundle.max_seq, device=device, **options)

    # -- the protocol ---------------------------------------------------------------------
    def fork(self) -> "TorchEngine":
        """Another engine over the same module (its weights shared, read only) with buffers,
        captured graphs and statistics of its own."""
        return TorchEngine(self.graph, self.spec, self.max_seq, device=self.device, **self._options)

    def kv_addresses(self) -> list[int]:
        return [t.data_ptr() for t in self.kv]

    def resumable(self, length: int, slot: int = 0) -> int:
        """K/V only: any prefix; with recurrent states (one sequence), a prefix whose state is
        kept (see Engine.resumable)."""
        return self.states.resumable(length) if self.states else length

    @property
    def kv_arrays(self) -> list[np.ndarray]:
        """Host views of slot 0's KV buffers, [1, Hkv, S, D] each (CPU only): writing them
        writes the buffers."""
        if self.device.type != "cpu":
            raise AttributeError("kv_arrays: the KV buffers live on the device; use .kv")
        return [t.numpy() for t in self._kv0]

    @property
    def kv_bytes_per_sequence(self) -> int:
        return sum(buffer[0].numel() * buffer.element_size() for buffer in self.kv)

    def _forward(self, token_ids: np.ndarray, start: int, tree, last: bool,
                 features: "dict[str, np.ndarray | None] | None") -> np.ndarray:
        """token_ids [T] at positions start..start+T-1 -> logits [T, V] float32; with `tree` (a
        TreeLayout, where `trees` is True) a tree pass, run eager. `last` (the caller reads
        only the last row) changes nothing here but for a model with recurrent states, whose
        pass then computes and keeps the last row's logits and state only ([1, V]).

        The returned array is this engine's buffer for T: valid until the next pass of
        the same T (on a CPU, a fresh array).
        """
        t = token_ids.shape[0]
        self._stage_np[0] = start
        self._stage_np[1 : 1 + t] = token_ids
        self._last = last
        window = self._window(t, start) if tree is None else start + t
        self.stats.passes += 1
        for name, buffer in self._feature_in.items():  # an EAGLE-3 head's states for this pass (None: zeros)
            given = features.get(name) if features else None
            if given is None:
                buffer[0, :t].zero_()
            else:
                buffer[0, :t].copy_(torch.from_numpy(np.ascontiguousarray(given, dtype=np.float32)))
        with torch.no_grad():
            run = (lambda: self._run(t, window)) if tree is None else (lambda: self._tree_pass(t, window, tree))
            if self.device.type == "cpu":
                self.stats.host_syncs += 1
                logits = run()[0].numpy()
                if self._state is not None:
                    self.outputs[DRAFT_HIDDEN_OUT] = self._state[0].numpy()
                return logits
            self._upload(t + 1)
            timing = self.time_device and self._events is not None
            if timing:
                self._events[0].record()
            logits = run()  # [1, T, V] on the device
            if timing:
                self._events[1].record()
            rows = logits.shape[1]
            host = self._host_logits.get(rows)
            if host is None:
                host = self._host_logits[rows] = torch.empty((rows, self.spec.logits_width), dtype=torch.float32,
                                                             pin_memory=True)
            host.copy_(logits[0], non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()  # the one host sync of the pass
            self.stats.host_syncs += 1
            if self._features is not None:  # the states a head reads, on the host
                self.features[start : start + t] = self._features[0, start : start + t].cpu().numpy()
            if self._state is not None:
                self.outputs[DRAFT_HIDDEN_OUT] = self._state[0].cpu().numpy()
            if timing:
                self.stats.device_seconds += self._events[0].elapsed_time(self._events[1]) / 1000
            return host.numpy()

    # -- a round with one host synchronisation ----------------------------------------------
    def _upload(self, n: int) -> None:
        """The first n staged values (write position, ids) to the device, asynchronously."""
        if self.device.type != "cpu":
            self._io[:n].copy_(self._stage[:n], non_blocking=True)

    def _window(self, t: int, start: int) -> int:
        fixed = self.buckets and t <= self.capture_max_t
        return window_length(start, t, self.min_window if fixed else None, self.max_seq)

    def draft_chain(self, pending: np.ndarray, start: int, k: int, params=None, seed: int | None = None):
        """Draft k tokens without a host synchronisation: one pass over `pending` (the tokens
        this cache has not seen, at positions start..), then k-1 single steps, each fed the
        previous step's token on the device: its argmax (greedy), or under sampling a draw
        from its warped distribution (`warp_torch`, a device generator seeded with `seed`).
        Returns the k tokens on the device (valid until the next chain), and under sampling
        also their distributions [k, V] float64; the caller's verify pass brings them back."""
        pending = np.asarray(pending, dtype=np.int64)
        check_pass(self.name, pending, start, self.max_seq, self.vocab_size)
        t = pending.shape[0]
        if k < 1 or start + t + k - 1 > self.max_seq:
            raise InputError(f"{self.name}: a draft chain of {k} from position {start + t} leaves the KV buffer [0, {self.max_seq})")
        t0 = time.perf_counter()
        self._stage_np[0] = start
        self._stage_np[1 : 1 + t] = pending
        out = self._chain_out
        sampled = params is not None and not params.greedy
        if sampled:
            probs = torch.empty((k, self.vocab_size), dtype=torch.float64, device=self.device)
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed if seed is not None else 0)
        timing = self._chain_events is not None
        with torch.no_grad():
            if timing:
                self._chain_events[0].record()
            self._upload(t + 1)
            pos = start
            for i in range(k):
                self.stats.passes += 1
                logits = self._run(t, self._window(t, pos))
                if sampled:
                    probs[i] = warp_torch(logits[0, -1], params)
                    out[i : i + 1].copy_(sample_torch(probs[i], gen))
                else:
                    out[i : i + 1].copy_(logits[0, -1].argmax(-1, keepdim=True))
                if i + 1 < k:
                    self._io[:1].add_(t)  # the next write position, advanced on the device
                    self._io[1:2].copy_(out[i : i + 1])
                    pos += t
                    t = 1
            if timing:
                self._chain_events[1].record()
        self._chain_host_seconds = time.perf_counter() - t0
        return TorchChain(out[:k], probs if sampled else None)

    def _pinned(self, key, shape, dtype) -> torch.Tensor:
        """A host buffer per (kind, size), pinned on a GPU, allocated once."""
        buf = self._host_buffers.get(key)
        if buf is None:
            buf = self._host_buffers[key] = torch.empty(shape, dtype=dtype, pin_memory=self.device.type == "cuda")
        return buf

    def chain_seconds(self) -> float:
        """The last draft chain's duration: CUDA-event time on a GPU (read after the round's
        synchronisation), wall clock on a CPU (where every op completes before returning)."""
        if self._chain_events is None:
            return self._chain_host_seconds
        return self._chain_events[0].elapsed_time(self._chain_events[1]) / 1000

    def verify_chain(self, last: int, chain: TorchChain, start: int) -> Checked:
        """The verify pass over [last, *chain] at positions start.., the drafts read from
        device memory. Brought back after the round's one synchronisation: the drafts and the
        target's argmax for each of the k+1 rows; for a sampled chain also its draft probs
        [k, V] and the target's logits [k+1, V]."""
        self.runs += 1
        drafts, draft_probs = chain.tokens, chain.probs
        k = drafts.shape[0]
        t = k + 1
        check_pass(self.name, np.array([last], dtype=np.int64), start, self.max_seq - k, self.vocab_size)
        self._stage_np[0] = start
        self._stage_np[1] = last
        with torch.no_grad():
            self._upload(2)
            self._io[2 : 2 + k].copy_(drafts)
            self.stats.passes += 1
            logits = self._run(t, self._window(t, start))
            self._result[:k].copy_(drafts)
            self._result[k : k + t].copy_(logits[0].argmax(-1))
            cuda = self.device.type != "cpu"
            if cuda:
                self._result_host[: k + t].copy_(self._result[: k + t], non_blocking=True)
            if draft_probs is not None:  # distributions too: copied out before the one sync
                host_probs = self._pinned(("probs", k), draft_probs.shape, draft_probs.dtype)
                host_logits = self._pinned(("logits", t), logits[0].shape, torch.float32)
                host_probs.copy_(draft_probs, non_blocking=cuda)
                host_logits.copy_(logits[0], non_blocking=cuda)
            if cuda:
                torch.cuda.current_stream(self.device).synchronize()  # the one host sync of the round
            self.stats.host_syncs += 1
        host = self._result_host[: k + t].numpy()
        if draft_probs is not None:
            return Checked(host[:k].copy(), host_probs.numpy(), target_logits=host_logits.numpy())
        return Checked(host[:k].copy(), target_tokens=host[k : k + t].copy())

    # -- the pass ---------------------------------------------------------------------------
    def _pass(self, t: int, window: int) -> torch.Tensor:
        """The module over the buffers: reads `_io` (write position, ids), returns logits
        [1, T, V]. No host synchronisation: capturable as it stands."""
        start = self._io[:1]
        positions = start + self._arange[:t]  # [T]
        cols = self._arange[:window][None]  # [1, Lb]
        rows = positions[:, None]  # [T, 1]
        visible = cols <= rows
        if self.spec.sliding_window is not None:
            visible &= cols > rows - self.spec.sliding_window
        mask = torch.where(visible, 0.0, float("-inf"))  # [T, Lb] float32
        ids = self._io[1 : 1 + t][None]
        if self._feature_in:  # an EAGLE-3 head: every row's logits and state, from its inputs
            out = self.graph(ids, positions[None], start, mask[None, None], self._kv0, self._arange[:t],
                             *(buffer[:, :t] for buffer in self._feature_in.values()))
            self._state = out[-1]
            return out[0]
        if self.states:  # eager only: the host knows the write position
            return self._recurrent_pass(ids, positions, start, mask)
        out = self.graph(ids, positions[None], start, mask[None, None], self._kv0)
        if self._features is not None:  # a target for an EAGLE-3 head: its states, at their positions
            self._features[0].index_copy_(0, positions, out[-1][0])
        return out[0]

    def _recurrent_pass(self, ids, positions, start, mask) -> torch.Tensor:
        """The module over the buffers and the recurrent states kept at the pass's start; the
        states after each returned row kept by position (every row, or the last one alone for a
        caller that reads only it: a prefill chunk's states are not computed row by row for
        nothing; the ring keeps the last `keep`)."""
        at, t = int(self._stage_np[0]), ids.shape[1]
        rows = self._arange[t - 1 : t] if self._last else self._arange[:t]
        before = self.states.read(at)
        out = self.graph(ids, positions[None], start, mask[None, None], self._kv0, rows, list(before))
        n = len(self.kv)
        self.states.store(at + t - rows.shape[0] + 1, [state[0] for state in out[1 + n : 1 + n + len(before)]],
                          rows.shape[0])
        if self._features is not None:  # a target for a head: its final states, at their positions
            self._features[0].index_copy_(0, positions, out[-1][0])
        return out[0]

    def _tree_pass(self, t: int, window: int, tree) -> torch.Tensor:
        """A tree pass, eager: each token at start + its depth, seeing the context and its
        ancestors (runtime/tree.py)."""
        self.stats.eager += 1
        start = self._io[:1]
        positions = start + torch.as_tensor(tree.offsets, device=self.device)
        mask = torch.full((t, window), float("-inf"), device=self.device)
        mask[:, : window - t] = 0.0
        own = mask[:, window - t :]
        own[torch.as_tensor(tree.visible, device=self.device)] = 0.0
        return self.graph(self._io[1 : 1 + t][None], positions[None], start, mask[None, None], self._kv0)[0]

    def move_kv(self, source: np.ndarray, start: int, slot: int = 0) -> None:
        """In `slot`, copy the K/V at positions `source` [m] to start..start+m-1, on the device
        (the sources are gathered before anything is written)."""
        index = torch.as_tensor(source, device=self.device)
        with torch.no_grad():
            for buffer in self.kv:
                buffer[slot, :, start : start + index.shape[0]] = buffer[slot].index_select(1, index)

    def _run(self, t: int, window: int) -> torch.Tensor:
        return self._replay((t, window), self._pass, t <= self.capture_max_t)

    def _replay(self, key: tuple[int, ...], run, capturable: bool) -> torch.Tensor:
        """`run(*key)`: replayed where this shape was captured, captured on its first pass where
        it may be (a CUDA device, `capturable`), else eager."""
        captured = self._graphs.get(key)
        if captured is None and self.capture and capturable:
            captured = self._capture(key, run)
        if captured is None:
            self.stats.eager += 1
            return run(*key)
        graph, logits = captured
        graph.replay()
        self.stats.replays += 1
        return logits

    def _capture(self, key: tuple[int, ...], run):
        """capture_pass over this shape; a capture that fails leaves the engine eager for good."""
        t0 = time.perf_counter()
        shape = key if len(key) == 2 else key[1:]  # (T, window), or a batch's (lanes, T, window)
        try:
            graph, logits = capture_pass(lambda: run(*key), self.device, self._pool, self.warmup)
        except RuntimeError as e:  # fall back to eager for good, and say why
            self.capture = False
            self.stats.capture = False
            what = ", ".join(f"{n}={v}" for n, v in zip(("B", "T", "window")[3 - len(shape):], shape))
            self.stats.capture_error = f"{what}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            return None
        self._graphs[key] = (graph, logits)
        self.stats.graphs.append(shape)
        self.stats.capture_seconds += time.perf_counter() - t0
        return self._graphs[key]

    # -- batched passes ----------------------------------------------------------------------
    # Captured batched passes (a GPU; or `buckets=True` on a CPU, which runs the same bookkeeping
    # eager, how the suite checks it): B is padded to a power of two (1, 2, 4, 8, ...) and the
    # window to a power of two of at least `min_window` (core/graph_io.py window_length), so a
    # handful of graphs serve every batch. A padding lane runs in the next free slot with its rows
    # written at the end of the buffer (slots S - T..S - 1): every sequence writes a position
    # before it reads it, and masks every slot past its own length, so nothing reads them; a free
    # slot's prompt cache is trimmed to keep clear of them (`padding_floor`). Its logits are never
    # read. The masks are built on the device from the write indices, as for one sequence.
    @property
    def padding_floor(self) -> int:
        """The first slot position a padding lane may write (S - the widest captured pass)."""
        return self.max_seq - self.capture_max_t

    def _forward_batch(self, tokens: np.ndarray, starts: np.ndarray, first: int, last: bool, pad: bool,
                       layouts: "list | None") -> np.ndarray:
        """EngineBase.forward_batch on the module, the logits brought back to the host. `pad`:
        the slots after the pass's may take padding lanes (no K/V of theirs at or past
        `padding_floor`). A pass with tree lanes runs eager over the exact window, its mask
        made on the host."""
        b, t = tokens.shape
        tree = layouts is not None and any(x is not None for x in layouts)
        fixed = self.buckets and t <= self.capture_max_t and first == 0 and not tree
        lanes = batch_bucket(b, self.max_batch) if fixed and pad else b
        if first + lanes > self.max_batch:
            lanes, fixed = b, False
        window = window_length(int(starts.max()), t, self.min_window if fixed else None, self.max_seq)
        stage = self._stage_b_np
        stage[first : first + b, 0] = starts
        stage[first : first + b, 1 : 1 + t] = tokens
        if lanes > b:  # padding lanes: token 0, written at the end of the buffer
            stage[first + b : first + lanes, 0] = self.max_seq - t
            stage[first + b : first + lanes, 1 : 1 + t] = 0
        self.stats.passes += 1
        with torch.no_grad():
            if self.device.type != "cpu":
                self._io_b[first : first + lanes, : 1 + t].copy_(self._stage_b[first : first + lanes, : 1 + t],
                                                                 non_blocking=True)
            if tree:
                self.stats.eager += 1
                logits = self._batch_tree_pass(first, starts, t, window, layouts)
            else:
                logits = self._replay((first, lanes, t, window), self._batch_pass, first == 0 and t <= self.capture_max_t)
            rows = logits[:b, -1:] if last else logits[:b]
            if self.device.type == "cpu":
                self.stats.host_syncs += 1
                return rows.numpy()
            if self._features is not None:  # each lane's rows of the target's states, on the host (one copy each)
                for i in range(b):
                    at = int(starts[i])
                    self.slot_features[first + i, at : at + t] = self._features[first + i, at : at + t].cpu().numpy()
            host = self._host_b.get(tuple(rows.shape[:2]))
            if host is None:
                host = self._host_b[tuple(rows.shape[:2])] = torch.empty(tuple(rows.shape), dtype=torch.float32,
                                                                        pin_memory=True)
            host.copy_(rows, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()  # the pass's one host sync
            self.stats.host_syncs += 1
            return host.numpy()

    def _batch_pass(self, first: int, lanes: int, t: int, window: int) -> torch.Tensor:
        """The module over slots first..first+lanes-1: reads `_io_b`, returns logits [lanes, T, V];
        no host synchronisation (capturable)."""
        io = self._io_b[first : first + lanes]
        starts = io[:, 0]  # [B]
        positions = starts[:, None] + self._arange[:t]  # [B, T]
        cols = self._arange[:window][None, None]  # [1, 1, L]
        rows = positions[:, :, None]  # [B, T, 1]
        visible = cols <= rows
        if self.spec.sliding_window is not None:
            visible &= cols > rows - self.spec.sliding_window
        mask = torch.where(visible, 0.0, float("-inf"))[:, None]  # [B, 1, T, L]
        kv = [buffer[first : first + lanes] for buffer in self.kv]
        out = self.graph(io[:, 1 : 1 + t], positions, starts, mask, kv)
        self._keep_features(first, positions, out)
        return out[0]

    def _keep_features(self, first: int, positions: torch.Tensor, out) -> None:
        """A target for a head: each lane's hidden states (the graph's last output, [B, T, W]) at
        their positions in its slot (padding lanes' land past every length, where nothing reads)."""
        if self._features is not None:
            for i in range(positions.shape[0]):
                self._features[first + i].index_copy_(0, positions[i], out[-1][i])

    def _batch_tree_pass(self, first: int, starts: np.ndarray, t: int, window: int, layouts) -> torch.Tensor:
        """A batched pass with tree lanes, eager: the mask and positions made on the host (as
        OrtEngine.forward_batch makes them), each tree lane's rows at start + their depth."""
        b = starts.shape[0]
        mask = np.empty((b, 1, t, window), np.float32)
        positions = starts[:, None] + np.arange(t, dtype=np.int64)
        for i, layout in enumerate(layouts):
            if layout is None:
                fill_mask(mask[i, 0], int(starts[i]), self.spec.sliding_window)
            else:
                fill_tree_mask(mask[i, 0], int(starts[i]), layout.visible)
                positions[i] = starts[i] + layout.offsets
        io = self._io_b[first : first + b]
        kv = [buffer[first : first + b] for buffer in self.kv]
        where = torch.from_numpy(positions).to(self.device)
        out = self.graph(io[:, 1 : 1 + t], where, io[:, 0], torch.from_numpy(mask).to(self.device), kv)
        self._keep_features(first, where, out)
        return out[0]

    def copy(self, source: int, dest: int, start: int, end: int) -> None:
        """Slot `dest`'s K/V at positions start..end-1 made those of slot `source`, on the device."""
        with torch.no_grad():
            for buffer in self.kv:
                buffer[dest, :, start:end] = buffer[source, :, start:end]
            if self._features is not None:  # the hidden states at the same positions
                self._features[dest, start:end] = self._features[source, start:end]
                if self.device.type != "cpu":
                    self.slot_features[dest, start:end] = self.slot_features[source, start:end]

    def swap(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Exchange the K/V of slots a and b (their first length_a / length_b positions), on the device."""
        if a == b:
            return
        with torch.no_grad():
            for buffer in self.kv + ([self._features.transpose(1, 2)] if self._features is not None else []):
                keep = buffer[a, :, :length_a].clone()  # (the hidden states, [B, W, S] viewed, move with the K/V)
                buffer[a, :, :length_b] = buffer[b, :, :length_b]
                buffer[b, :, :length_a] = keep
        if self._features is not None and self.device.type != "cpu":
            keep = self.slot_features[a, :length_a].copy()
            self.slot_features[a, :length_b] = self.slot_features[b, :length_b]
            self.slot_features[b, :length_a] = keep


def batch_bucket(b: int, max_batch: int) -> int:
    """The captured batch size a pass of b sequences runs at.

    >>> [batch_bucket(b, 8) for b in (1, 2, 3, 5, 8)]
    [1, 2, 4, 8, 8]
    """
    return min(max_batch, 1 << (b - 1).bit_length())
