"""The recurrent states of a graph's linear-attention layers, kept for one sequence (docs/design.md,
"Recurrent states").

A KV buffer rolls back by moving a length: slots past it are never read. A recurrent state has
no length: it has absorbed every token a pass gave it. So the graph takes the state before a
pass and returns the state after each row it returns logits for (export/recurrent.py), and
this keeps those states by position in a ring of `keep` slots (position p in slot p % keep).
A pass at `start` reads the state kept at `start`, whatever came after it: accepting j of k
drafts and starting the next pass at the accepted length picks the state after row j, with
no second pass and no copy. The caller keeps its rollback as it was, a length.

A pass at `start` rewrites history from there, so states kept past `start` are dropped before
it runs. Where a state was not kept (a position inside a prefill chunk, which returns its last
row's state only, or one pushed out of the ring), `resumable` says how far back the caller
must go: the prompt cache and a model drafter then feed the tokens from there again.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnxruntime as ort

from specdeploy.core.errors import InputError
from specdeploy.core.manifest import ModelSpec


class RecurrentStates:
    """The states of one sequence at its most recent positions, in host memory (CPU engines; a
    batched engine keeps one per slot)."""

    def __init__(self, spec: ModelSpec, keep: int, name: str, zeros: Callable = lambda shape: np.zeros(shape, np.float32)):
        """`zeros(shape)`: a float32 buffer of zeros (a numpy array; the torch backend's: a tensor
        on its device, kept by `read`/`store` as arrays are; `bind` is ONNX Runtime's)."""
        self.name = name
        self.names = spec.state_names
        self.shapes = [spec.state_shape(i)[1:] for i, _ in self.names]
        self.keep = max(2, keep)
        self.ring = [zeros((self.keep, *shape)) for shape in self.shapes]
        self.zeros = [zeros((1, *shape)) for shape in self.shapes]  # the state before any token
        self.slot_of: dict[int, int] = {}  # position -> the ring slot holding the state after its first p tokens
        self._scratch: dict[int, list[np.ndarray]] = {}  # R -> a pass's outputs where the ring cannot take them
        self._pending: tuple[int, int, list[np.ndarray] | None] | None = None

    def __bool__(self) -> bool:
        return bool(self.names)

    def resumable(self, length: int) -> int:
        """The longest prefix, at most `length` tokens, whose state is kept (0: from the start)."""
        if length == 0 or length in self.slot_of:
            return length
        return max((p for p in self.slot_of if p <= length), default=0)

    def state(self, position: int) -> list[np.ndarray]:
        """The states after the first `position` tokens, [1, ...] each (views into the ring)."""
        if position == 0:
            return self.zeros
        if position not in self.slot_of:
            raise InputError(f"{self.name}: no recurrent state is kept at position {position} (kept: "
                             f"{sorted(self.slot_of) or 'none'}); resume from `resumable({position})`")
        at = self.slot_of[position]
        return [ring[at : at + 1] for ring in self.ring]

    def read(self, start: int) -> list[np.ndarray]:
        """The state a pass at `start` reads; the states kept past `start` are dropped (the pass
        rewrites history from there)."""
        self.drop_after(start)
        return self.state(start)

    def drop_after(self, position: int) -> None:
        for p in [p for p in self.slot_of if p > position]:
            del self.slot_of[p]

    def store(self, first: int, states: list[np.ndarray] | None, rows: int) -> None:
        """Keep the states of positions first..first+rows-1 (`states`: each [rows, ...], copied
        in; None: already written into their ring slots). A pass of more rows than the ring
        keeps its last."""
        for i in range(max(0, rows - self.keep), rows):
            p = first + i
            slot = p % self.keep
            for q in [q for q, s in self.slot_of.items() if s == slot]:
                del self.slot_of[q]
            if states is not None:
                for ring, out in zip(self.ring, states):
                    ring[slot] = out[i]
            self.slot_of[p] = slot

    def bind(self, binding: ort.IOBinding, start: int, t: int, rows: int) -> None:
        """Bind a pass of `t` tokens at `start` returning its last `rows` rows: the state kept at
        `start` in, the ring slots of positions start+t-rows+1 .. start+t out (or a scratch
        buffer where they wrap around the ring or cover the slot read)."""
        sources = self.read(start)
        first = (start + t - rows + 1) % self.keep
        read = self.slot_of.get(start, -1)
        direct = rows < self.keep and first + rows <= self.keep and not first <= read < first + rows
        if direct:
            targets = [ring[first : first + rows][None] for ring in self.ring]
        else:
            scratch = self._scratch.get(rows)
            if scratch is None:
                scratch = self._scratch[rows] = [np.zeros((1, rows, *shape), np.float32) for shape in self.shapes]
            targets = scratch
        for (inp, out), source, target in zip(self.names, sources, targets):
            binding.bind_input(inp, "cpu", 0, np.float32, list(source.shape), source.ctypes.data)
            binding.bind_output(out, "cpu", 0, np.float32, list(target.shape), target.ctypes.data)
        self._pending = (start + t - rows + 1, rows, None if direct else targets)

    def commit(self) -> None:
        """After the pass ran: keep its states by position (copied in where they went to scratch)."""
        first, rows, scratch = self._pending
        self._pending = None
        self.store(first, None if scratch is None else [out[0] for out in scratch], rows)

    def fail(self) -> None:
        """The pass failed: what it may have written is not a state of any position."""
        if self._pending is not None and self._pending[2] is None:
            first, rows, _ = self._pending
            slots = {(first + i) % self.keep for i in range(rows)}
            self.slot_of = {p: s for p, s in self.slot_of.items() if s not in slots}
        self._pending = None


__all__ = ["RecurrentStates"]
