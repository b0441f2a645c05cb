"""Batched passes on ONNX Runtime's CPU provider: one pass carries B sequences, each in a KV
slot of its own (docs/design.md, "Batched passes").

The KV buffers are allocated once, [max_batch, Hkv, S, D] per layer, zero-filled. A slot is
one sequence's [Hkv, S, D] block, contiguous, so any run of neighbouring slots is itself a
buffer of the graph contract's shape: a batched pass binds slots 0..B-1 as [B, Hkv, S, D]
at the buffer's start, and one sequence's prefill binds its slot alone as [1, Hkv, S, D] at
its offset. The scheduler keeps the running sequences in slots 0..B-1 (`swap` moves a
sequence's K/V between slots when one leaves).

Each sequence has its own write index and mask rows: row i of sequence b is at position
start_b + i and sees slots 0..start_b + i of its own slot. The window L is the longest
sequence's start + T; for a shorter one the extra slots are masked (-inf) and add exact
zeros. So a sequence's logits in a batch equal its logits alone, bit for bit: every row is
computed from its own slot, and the graph's matmuls compute rows independently (the exact
graphs' verify rows equal single steps, docs/backends.md).

A model with linear-attention layers keeps each slot's recurrent states by position
(backends/recurrent.py, one ring per slot): a pass stages each sequence's state at its start
as the graph's [B, ...] inputs and keeps its [B, R, ...] outputs in the sequence's ring; the
states move with a slot's K/V (`swap`, `copy`). `resumable(slot, length)` says where a slot can
resume (docs/design.md, "Recurrent states").
"""
from __future__ import annotations

import numpy as np
import onnxruntime as ort

from specdeploy.core.errors import BundleError, InputError
from specdeploy.core.graph_io import AUX_HIDDEN, LOGITS_ROWS, check_pass, fill_mask, fill_tree_mask
from specdeploy.core.manifest import ModelSpec

from .ort import Placement, _load, _reason, no_bfloat16, tree_capable
from .recurrent import RecurrentStates
from specdeploy.core.choices import NUMPY_DTYPES
from specdeploy.runtime.decoding.tree import TreeLayout


def batch_dim(session: ort.InferenceSession) -> int | str:
    """The graph's batch dimension: "B" where it is dynamic, else its fixed size."""
    dim = session.get_inputs()[0].shape[0]
    return dim if isinstance(dim, int) else "B"


class OrtBatchEngine:
    """One graph of a bundle run over `max_batch` KV slots, on the CPU."""

    def __init__(self, graph_path, spec: ModelSpec, max_seq: int, max_batch: int, threads: int | None = None,
                 session: ort.InferenceSession | None = None, keep_states: int = 2):
        if spec.dtype not in NUMPY_DTYPES:
            raise InputError(no_bfloat16(spec, graph_path.name, "ONNX Runtime"))
        if session is None:
            session, _ = _load(graph_path, spec, max_seq, threads, spec.role != "draft", Placement())
        if batch_dim(session) != "B":
            raise BundleError(f"{graph_path}: its graph carries one sequence per pass (exported before batched "
                              "passes); re-export the bundle to batch")
        if spec.feature_inputs:
            raise InputError(f"{graph_path.name}: an EAGLE-3 head runs one sequence a pass (each lane's head "
                             "engine is its own); its target batches")
        self.spec, self.session, self.graph_path = spec, session, graph_path
        self.name = f"{spec.role} ({graph_path.name})"
        self.max_seq, self.max_batch, self.vocab_size = max_seq, max_batch, spec.vocab_size
        self.device = "cpu"
        # host buffers, written in place
        self.kv = [np.zeros(spec.kv_shape(i, max_batch, max_seq), dtype=spec.kv_dtype) for i in range(len(spec.kv_names))]
        self._bindings: dict[tuple[int, int], ort.IOBinding] = {}  # (first slot, B) -> KV bound once
        self._logits = np.zeros((max_batch, 1, spec.logits_width), np.float32)  # grown on demand (T rows)
        # An EAGLE-3 target's hidden states: each pass's AUX_HIDDEN rows, per slot at their positions
        # (what a lane's head reads, as OrtEngine.features for one sequence); None for other graphs
        width = spec.feature_outputs.get(AUX_HIDDEN)
        self.features = np.zeros((max_batch, max_seq, width), np.float32) if width else None
        self._states = np.zeros((max_batch, 1, width or 1), np.float32)  # a pass's rows, grown on demand
        # A model with linear-attention layers: each slot's recurrent states kept by position
        # (backends/recurrent.py), staged into the pass's [B, ...] inputs and copied back from its
        # [B, R, ...] outputs; empty for other graphs
        self.states = [RecurrentStates(spec, keep_states, f"{self.name} slot {i}") for i in range(max_batch)] \
            if spec.state_names else []
        self._staged: dict[str, np.ndarray] = {}  # state input / output name -> its staging buffer (see _staging)
        self.padding_floor = None  # its passes carry no padding lanes (TorchBatchEngine's do)
        self.trees = tree_capable(spec, Placement())  # verifies token trees: forward(layouts=), move_kv
        self.runs = 0  # passes begun (the Engine contract's counter)
        self.rows = 0  # rows computed, padding included

    @property
    def kv_bytes_per_sequence(self) -> int:
        """What one more sequence (one slot) adds: its K/V over every layer."""
        return sum(buffer[0].nbytes for buffer in self.kv)

    def _binding(self, first: int, b: int) -> ort.IOBinding:
        key = (first, b)
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bindings[key] = self.session.io_binding()
            for (inp, out), buffer in zip(self.spec.kv_names, self.kv):
                shape = [b, *buffer.shape[1:]]
                address = buffer.ctypes.data + first * buffer[0].nbytes
                binding.bind_input(inp, "cpu", 0, buffer.dtype, shape, address)
                binding.bind_output(out, "cpu", 0, buffer.dtype, shape, address)
        return binding

    def forward(self, tokens: np.ndarray, starts: np.ndarray, first: int = 0, last: bool = False,
                pad: bool = True, layouts: "list[TreeLayout | None] | None" = None) -> np.ndarray:
        """tokens [B, T] written at slots first..first+B-1, sequence b at positions starts[b]..
        starts[b]+T-1 -> logits [B, T, V] (`last`: [B, 1, V], each sequence's last row only).
        The array is this engine's buffer: valid until the next pass. (`pad`: unused here: no
        pass is padded.) `layouts` (engines whose `trees` is True): sequence b's rows as a tree
        where layouts[b] is not None: row i at position starts[b] + offsets[i], seeing the slots
        before starts[b] and the pass's rows `visible[i]` marks (runtime/decoding/tree.py)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        starts = np.ascontiguousarray(starts, dtype=np.int64)
        b, t = tokens.shape
        if not (1 <= b and first + b <= self.max_batch) or starts.shape != (b,):
            raise InputError(f"{self.name}: a pass of {b} sequences at slot {first} does not fit {self.max_batch} "
                             f"slots (starts {starts.shape})")
        for i in range(b):
            check_pass(self.name, tokens[i], int(starts[i]), self.max_seq, self.vocab_size)
        window = int(starts.max()) + t
        mask = np.empty((b, 1, t, window), np.float32)
        positions = starts[:, None] + np.arange(t, dtype=np.int64)
        for i in range(b):
            layout = layouts[i] if layouts is not None else None
            if layout is None:
                fill_mask(mask[i, 0], int(starts[i]), self.spec.sliding_window)
            elif not self.trees:
                raise InputError(f"{self.name}: this graph does not verify token trees")
            else:
                fill_tree_mask(mask[i, 0], int(starts[i]), layout.visible)
                positions[i] = starts[i] + layout.offsets
        rows = 1 if last else t
        width = self.spec.logits_width
        if self._logits.size < b * rows * width:
            self._logits = np.zeros((self.max_batch, rows, width), np.float32)
        logits = self._logits.reshape(-1)[: b * rows * width].reshape(b, rows, width)
        binding = self._binding(first, b)
        binding.bind_cpu_input("input_ids", tokens)
        binding.bind_cpu_input("position_ids", positions)
        binding.bind_cpu_input("write_indices", starts)
        binding.bind_cpu_input("attention_mask", mask)
        if self.spec.logits_rows:
            binding.bind_cpu_input(LOGITS_ROWS, np.arange(t - rows, t, dtype=np.int64))
        binding.bind_output("logits", "cpu", 0, np.float32, [b, rows, width], logits.ctypes.data)
        states = None
        if self.features is not None:
            size = self.features.shape[2]
            if self._states.size < b * t * size:
                self._states = np.zeros((self.max_batch, t, size), np.float32)
            states = self._states.reshape(-1)[: b * t * size].reshape(b, t, size)
            binding.bind_output(AUX_HIDDEN, "cpu", 0, np.float32, [b, t, size], states.ctypes.data)
        outputs = self._bind_states(binding, starts, first, t, rows) if self.states else None
        self.runs += 1
        try:
            self.session.run_with_iobinding(binding)
        except RuntimeError as e:
            raise BundleError(f"{self.name}: ONNX Runtime failed a pass of {b}x{t} tokens ({_reason(e)})") from None
        self.rows += b * t
        if outputs is not None:  # each sequence's states after the returned rows, kept by position in its slot
            for i in range(b):
                self.states[first + i].store(int(starts[i]) + t - rows + 1, [out[i] for out in outputs], rows)
        if states is not None:  # each sequence's rows of the target's states, at their positions in its slot
            for i in range(b):
                at = int(starts[i])
                self.features[first + i, at : at + t] = states[i]
        return logits

    def _bind_states(self, binding: ort.IOBinding, starts: np.ndarray, first: int, t: int, rows: int
                     ) -> list[np.ndarray]:
        """Each sequence's state at its start, staged side by side as the pass's inputs; its
        outputs bound to staging arrays [B, rows, ...] -> those arrays (read once the pass ran)."""
        b = starts.shape[0]
        sources = [self.states[first + i].read(int(starts[i])) for i in range(b)]
        outputs = []
        for j, ((inp, out), shape) in enumerate(zip(self.spec.state_names, self.states[0].shapes)):
            staged = self._staging(inp, (b, *shape))
            np.concatenate([source[j] for source in sources], out=staged)
            after = self._staging(out, (b, rows, *shape))
            binding.bind_input(inp, "cpu", 0, np.float32, list(staged.shape), staged.ctypes.data)
            binding.bind_output(out, "cpu", 0, np.float32, list(after.shape), after.ctypes.data)
            outputs.append(after)
        return outputs

    def _staging(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A view of `shape` over the staging buffer of state input or output `name`, grown on
        demand and kept (a verify pass's states are megabytes: not allocated afresh each pass)."""
        need = int(np.prod(shape))
        flat = self._staged.get(name)
        if flat is None or flat.size < need:
            flat = self._staged[name] = np.empty(need, np.float32)
        return flat[:need].reshape(shape)

    def resumable(self, slot: int, length: int) -> int:
        """The longest prefix of slot `slot`, at most `length` tokens, a pass can start after (a
        model with recurrent states: a position whose state the slot keeps; else `length`)."""
        return self.states[slot].resumable(length) if self.states else length

    def move_kv(self, slot: int, source: np.ndarray, start: int) -> None:
        """In `slot`, copy the K/V at positions `source` [m] to start..start+m-1 (a tree round's
        accepted path into the slots a chain would have used); sources are read first."""
        for buffer in self.kv:
            kv = buffer[slot]  # [Hkv, S, D] (buffer[slot, :, source] would put the indexed axis first)
            kv[:, start : start + source.shape[0]] = kv[:, source]

    def copy(self, source: int, dest: int, start: int, end: int) -> None:
        """Slot `dest`'s K/V (and hidden states) at positions start..end-1 made those of slot
        `source` (a prompt another lane has prefilled already)."""
        for buffer in self.kv:
            buffer[dest, :, start:end] = buffer[source, :, start:end]
        if self.features is not None:
            self.features[dest, start:end] = self.features[source, start:end]
        if self.states:  # the state at `end` (the caller asks resumable(source, end) first)
            self.states[dest].drop_after(start)
            self.states[dest].store(end, self.states[source].state(end), 1)

    def swap(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Exchange the K/V of slots a and b: the first length_a slots of a's, length_b of b's."""
        if a == b:
            return
        if self.states:
            self.states[a], self.states[b] = self.states[b], self.states[a]
        for buffer in self.kv:
            keep = buffer[a, :, :length_a].copy()
            buffer[a, :, :length_b] = buffer[b, :, :length_b]
            buffer[b, :, :length_a] = keep
        if self.features is not None:  # the hidden states at the same positions move with them
            keep = self.features[a, :length_a].copy()
            self.features[a, :length_b] = self.features[b, :length_b]
            self.features[b, :length_a] = keep

