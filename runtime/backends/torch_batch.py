"""Batched passes on the torch backend: the export stage's module over `max_batch` KV slots,
eager on a CPU, CUDA graphs per (batch bucket, T, window bucket) on a GPU (docs/design.md,
"Batched passes"). Importing it imports torch.

The contract is OrtBatchEngine's (runtime/backends/ort_batch.py): a pass carries sequences in
slots first..first+B-1, each with its own write index and mask rows; slots are [Hkv, S, D]
blocks of [max_batch, Hkv, S, D] buffers, so a run of neighbouring slots is a view the module
writes in place.

Captured passes (a GPU; or `buckets=True` on a CPU, which runs the same bookkeeping eager, how
the suite checks it): B is padded to a power of two (1, 2, 4, 8, ...) and the window to a
power of two of at least `min_window` (core/graph_io.py window_length), so a handful of graphs
serve every batch. A padding lane runs in the next free slot with its rows written at the end
of the buffer (slots S - T..S - 1): every sequence writes a position before it reads it, and
masks every slot past its own length, so nothing reads them; a free slot's prompt cache is
trimmed to keep clear of them (`padding_floor`). Its logits are never read. The masks are
built on the device from the write indices, as TorchEngine builds its own.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from specdeploy.core.errors import InputError
from specdeploy.core.graph_io import check_pass, window_length
from specdeploy.core.manifest import ModelSpec

from .torch_engine import TorchEngineStats, capture_pass


def batch_bucket(b: int, max_batch: int) -> int:
    """The captured batch size a pass of b sequences runs at.

    >>> [batch_bucket(b, 8) for b in (1, 2, 3, 5, 8)]
    [1, 2, 4, 8, 8]
    """
    return min(max_batch, 1 << (b - 1).bit_length())


class TorchBatchEngine:
    trees = False  # a batch on the torch backend verifies chains only (its single-sequence engine runs trees)

    def __init__(self, graph, spec: ModelSpec, max_seq: int, max_batch: int, device: str | None = None,
                 capture: bool | None = None, buckets: bool | None = None, capture_max_t: int = 9,
                 min_window: int = 64, warmup: int = 2):
        if spec.feature_inputs or spec.feature_outputs:
            raise InputError(f"{spec.role}: an EAGLE-3 bundle batches on --backend ort (the torch backend's batched "
                             "passes return no hidden states yet)")
        if spec.state_names:
            raise InputError(f"{spec.role}: a model with linear-attention layers runs on ONNX Runtime's CPU provider, "
                             "one sequence a session (no backend's batched passes keep recurrent states yet)")
        self.spec, self.max_seq, self.max_batch = spec, max_seq, max_batch
        self.name = f"{spec.role} (torch, batched)"
        self.vocab_size = spec.vocab_size
        self.device = torch.device(device) if device is not None else next(graph.parameters()).device
        cuda = self.device.type == "cuda"
        self.capture = cuda if capture is None else (capture and cuda)
        self.buckets = self.capture if buckets is None else buckets
        self.capture_max_t, self.min_window, self.warmup = capture_max_t, min_window, warmup
        self.graph = graph.to(self.device).eval()
        self.graph.inplace = True
        kv_dtype = getattr(torch, spec.kv_dtype)
        self.kv = [torch.zeros(spec.kv_shape(i, max_batch, max_seq), dtype=kv_dtype, device=self.device)
                   for i in range(len(spec.kv_names))]
        self._arange = torch.arange(max_seq, device=self.device)
        # per slot: [write index, token ids...]; staged on the host (pinned on a GPU), sent up in one copy
        self._io = torch.zeros((max_batch, max_seq + 1), dtype=torch.int64, device=self.device)
        self._stage = torch.zeros_like(self._io, device="cpu", pin_memory=cuda) if cuda else self._io
        self._stage_np = self._stage.numpy()
        self._graphs: dict[tuple[int, int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._host: dict[tuple[int, int], torch.Tensor] = {}
        self.stats = TorchEngineStats(device=str(self.device), capture=self.capture)
        self.runs = 0  # passes begun (the Engine contract's counter)

    @classmethod
    def from_bundle(cls, bundle, spec: ModelSpec, batch: int, device=None, threads: int | None = None,
                    **options) -> "TorchBatchEngine":
        from specdeploy.export import rebuild_graph

        if threads:
            torch.set_num_threads(threads)
        if spec.dtype in ("int8", "int4"):
            raise InputError(
                f"{bundle.path}: an {spec.dtype} {spec.role} graph on --backend torch: its rows are not bit-identical "
                "from one pass shape to another (docs/backends.md), so a request's output would depend on the batch; use "
                "--backend ort, or a float bundle")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        options.setdefault("capture_max_t", bundle.max_draft + 1)
        return cls(rebuild_graph(spec), spec, bundle.max_seq, batch, device=device, **options)

    @property
    def kv_bytes_per_sequence(self) -> int:
        return sum(buffer[0].numel() * buffer.element_size() for buffer in self.kv)

    @property
    def padding_floor(self) -> int:
        """The first slot position a padding lane may write (S - the widest captured pass)."""
        return self.max_seq - self.capture_max_t

    def forward(self, tokens: np.ndarray, starts: np.ndarray, first: int = 0, last: bool = False,
                pad: bool = True) -> np.ndarray:
        """As OrtBatchEngine.forward: tokens [B, T] at slots first.., sequence b written at
        starts[b] -> logits [B, T, V] (`last`: [B, 1, V]) on the host. `pad`: the slots after
        the pass's may take padding lanes (no K/V of theirs at or past `padding_floor`)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        starts = np.asarray(starts, dtype=np.int64)
        b, t = tokens.shape
        if not (1 <= b and first + b <= self.max_batch) or starts.shape != (b,):
            raise InputError(f"{self.name}: a pass of {b} sequences at slot {first} does not fit {self.max_batch} slots")
        for i in range(b):
            check_pass(self.name, tokens[i], int(starts[i]), self.max_seq, self.vocab_size)
        fixed = self.buckets and t <= self.capture_max_t and first == 0
        lanes = batch_bucket(b, self.max_batch) if fixed and pad else b
        if first + lanes > self.max_batch:
            lanes, fixed = b, False
        window = window_length(int(starts.max()), t, self.min_window if fixed else None, self.max_seq)
        stage = self._stage_np
        stage[first : first + b, 0] = starts
        stage[first : first + b, 1 : 1 + t] = tokens
        if lanes > b:  # padding lanes: token 0, written at the end of the buffer
            stage[first + b : first + lanes, 0] = self.max_seq - t
            stage[first + b : first + lanes, 1 : 1 + t] = 0
        self.runs += 1
        self.stats.passes += 1
        with torch.no_grad():
            if self.device.type != "cpu":
                self._io[first : first + lanes, : 1 + t].copy_(self._stage[first : first + lanes, : 1 + t],
                                                               non_blocking=True)
            logits = self._run(first, lanes, t, window)
            rows = logits[:b, -1:] if last else logits[:b]
            if self.device.type == "cpu":
                self.stats.host_syncs += 1
                return rows.numpy()
            host = self._host.get(tuple(rows.shape[:2]))
            if host is None:
                host = self._host[tuple(rows.shape[:2])] = torch.empty(tuple(rows.shape), dtype=torch.float32,
                                                                      pin_memory=True)
            host.copy_(rows, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()  # the pass's one host sync
            self.stats.host_syncs += 1
            return host.numpy()

    def _pass(self, first: int, lanes: int, t: int, window: int) -> torch.Tensor:
        """The module over slots first..first+lanes-1: reads `_io`, returns logits [lanes, T, V];
        no host synchronisation (capturable)."""
        io = self._io[first : first + lanes]
        starts = io[:, 0]  # [B]
        positions = starts[:, None] + self._arange[:t]  # [B, T]
        cols = self._arange[:window][None, None]  # [1, 1, L]
        rows = positions[:, :, None]  # [B, T, 1]
        visible = cols <= rows
        if self.spec.sliding_window is not None:
            visible &= cols > rows - self.spec.sliding_window
        mask = torch.where(visible, 0.0, float("-inf"))[:, None]  # [B, 1, T, L]
        kv = [buffer[first : first + lanes] for buffer in self.kv]
        return self.graph(io[:, 1 : 1 + t], positions, starts, mask, kv)[0]

    def _run(self, first: int, lanes: int, t: int, window: int) -> torch.Tensor:
        key = (first, lanes, t, window)
        captured = self._graphs.get(key)
        if captured is None and self.capture and first == 0 and t <= self.capture_max_t:
            captured = self._capture(key)
        if captured is None:
            self.stats.eager += 1
            return self._pass(*key)
        graph, logits = captured
        graph.replay()
        self.stats.replays += 1
        return logits

    def _capture(self, key):
        """capture_pass over this (first slot, lanes, T, window); a failure leaves the engine eager."""
        t0 = time.perf_counter()
        try:
            graph, logits = capture_pass(lambda: self._pass(*key), self.device, self._pool, self.warmup)
        except RuntimeError as e:  # eager from then on, and say why
            self.capture = False
            self.stats.capture = False
            self.stats.capture_error = f"B={key[1]}, T={key[2]}, window {key[3]}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            return None
        self._graphs[key] = (graph, logits)
        self.stats.graphs.append(key[1:])
        self.stats.capture_seconds += time.perf_counter() - t0
        return self._graphs[key]

    def resumable(self, slot: int, length: int) -> int:
        """K/V only (recurrent states are refused above): any prefix a slot holds resumes."""
        return length

    def copy(self, source: int, dest: int, start: int, end: int) -> None:
        """Slot `dest`'s K/V at positions start..end-1 made those of slot `source`, on the device."""
        with torch.no_grad():
            for buffer in self.kv:
                buffer[dest, :, start:end] = buffer[source, :, start:end]

    def swap(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Exchange the K/V of slots a and b (their first length_a / length_b positions), on the device."""
        if a == b:
            return
        with torch.no_grad():
            for buffer in self.kv:
                keep = buffer[a, :, :length_a].clone()
                buffer[a, :, :length_b] = buffer[b, :, :length_b]
                buffer[b, :, :length_a] = keep
