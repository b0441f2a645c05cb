"""The engine contract: what the loop, the batch's scheduler, the drafters and the pool ask of
a backend.

An engine runs one graph of a bundle over KV buffers it owns (allocated once, written in
place), `max_batch` sequences' worth of them (KV slots). `forward(token_ids, start)` writes
the K/V of `token_ids` at positions `start..start+T-1` of slot 0 and returns logits for every
position; `forward_batch(tokens, starts, first)` does the same for B sequences in slots
first..first+B-1 in one pass (ort and torch). Rollback needs no method: slots at and past the
caller's length are never read. Every backend's engine is an `EngineBase`: its public passes
check and count, its `_forward` / `_forward_batch` run.

Engines that can chain a draft on their device (`chains = True`: the torch backend; TensorRT
engines built with the argmax output) also offer `draft_chain` / `verify_chain`: a round of
k draft steps and one verify pass with a single host synchronisation. What such a round
brings back is a `Checked`, the same record the loop builds from a per-pass round.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from specdeploy.core.errors import InputError
from specdeploy.core.graph_io import check_pass


class Engine(Protocol):
    name: str  # for messages: the role and the graph or backend
    max_seq: int
    vocab_size: int
    device: Any  # where the KV buffers live; two engines chain a round only on the same one
    runs: int  # passes begun, counted before each one runs: the prompt cache and a model
    # drafter trust what the KV buffers hold only while this is unchanged since they wrote it
    chains: bool  # offers draft_chain / verify_chain / chain_seconds (below)
    # [max_seq, width] the target's hidden states at their positions, written by each pass (the
    # target of an EAGLE-3 bundle: what its head reads); None for every other graph
    features: np.ndarray | None
    trees: bool  # verifies token trees: forward(..., tree=) and move_kv (below)

    def forward(self, token_ids: np.ndarray, start: int, last: bool = False) -> np.ndarray:
        """token_ids [T] int64 at positions start..start+T-1 -> logits [T, V] float32. With
        `last` the caller reads only the last row (as `[-1]`): an engine may then compute and
        return that row alone ([1, V])."""
        ...

    def resumable(self, length: int, slot: int = 0) -> int:
        """The longest prefix of `slot`, at most `length` tokens, that a pass may start after: `length`
        itself where the engine keeps only K/V; a model with recurrent states keeps them at
        recent positions only (runtime/backends/recurrent.py), and the caller feeds the tokens
        from the prefix this returns on."""
        ...

    # -- only where `trees` is True --------------------------------------------------------
    # forward(token_ids, start, tree=TreeLayout): a tree pass (runtime/tree.py)
    def move_kv(self, source: np.ndarray, start: int, slot: int = 0) -> None:
        """In KV slot `slot`, copy the K/V at positions `source` [m] to start..start+m-1, in place."""
        ...

    def fork(self) -> "Engine":
        """Another engine over the same weights with KV buffers of its own (a pool's workers)."""
        ...

    # -- only where `chains` is True -------------------------------------------------------
    def draft_chain(self, pending: np.ndarray, start: int, k: int, params=None, seed: int | None = None) -> Any:
        """k draft tokens from one pass over `pending` (at start..) and k-1 single steps, each
        fed the previous token on the device; no host synchronisation when greedy. Returns an
        engine-specific chain that `verify_chain` of a target on the same device reads."""
        ...

    def verify_chain(self, last: int, chain: Any, start: int) -> "Checked":
        """The verify pass over [last, *chain] at positions start..start+k, the round's one
        host synchronisation; `verify_seconds` is left for the caller."""
        ...

    def chain_seconds(self) -> float:
        """The last draft chain's duration (device time where the engine can measure it)."""
        ...


class EngineBase:
    """The half every backend's engine shares (the Polygraphy runner pattern): `forward` and
    `forward_batch` check a pass against the engine's buffers and count it in `runs` (before it
    runs: a pass that fails may have written the buffers), and the backend's `_forward` /
    `_forward_batch` run it. What an engine can do (`trees`, `chains`, hidden states in
    `features`, KV slots in `max_batch`) it declares as attributes."""

    name: str
    max_seq: int
    vocab_size: int
    runs: int
    trees: bool = False
    max_batch: int = 1  # KV slots: sequences a forward_batch pass may carry

    def forward(self, token_ids: np.ndarray, start: int, tree=None, last: bool = False,
                features: "dict[str, np.ndarray | None] | None" = None) -> np.ndarray:
        """token_ids [T] at positions start..start+T-1 (slot 0) -> logits [T, V] float32 (see
        Engine.forward; `tree`: a TreeLayout, where `trees` is True; `features`: an EAGLE-3
        head's hidden-state inputs)."""
        self.runs += 1
        token_ids = np.asarray(token_ids, dtype=np.int64)
        check_pass(self.name, token_ids, start, self.max_seq, self.vocab_size)
        if tree is not None and not self.trees:
            raise InputError(f"{self.name}: this graph does not verify token trees")
        return self._forward(token_ids, start, tree, last, features)

    def forward_batch(self, tokens: np.ndarray, starts: np.ndarray, first: int = 0, last: bool = False,
                      pad: bool = True, layouts: "list | None" = None) -> np.ndarray:
        """tokens [B, T] written at slots first..first+B-1, sequence b at positions starts[b]..
        starts[b]+T-1 -> logits [B, T, V] (`last`: [B, 1, V], each sequence's last row only).
        Sequence b's rows see its own slot only, so its logits equal its logits alone, bit for
        bit (docs/design.md, "Batched passes"). `pad`: the slots after the pass's may take an
        engine's padding lanes (runtime/decoding/batch.py `_may_pad`). `layouts` (where `trees`
        is True): sequence b's rows as a tree where layouts[b] is not None."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        starts = np.ascontiguousarray(starts, dtype=np.int64)
        b, t = tokens.shape
        if not (1 <= b and first + b <= self.max_batch) or starts.shape != (b,):
            raise InputError(f"{self.name}: a pass of {b} sequences at slot {first} does not fit {self.max_batch} "
                             f"slots (starts {starts.shape})")
        for i in range(b):
            check_pass(self.name, tokens[i], int(starts[i]), self.max_seq, self.vocab_size)
        if layouts is not None and not self.trees and any(x is not None for x in layouts):
            raise InputError(f"{self.name}: this graph does not verify token trees")
        self.runs += 1
        return self._forward_batch(tokens, starts, first, last, pad, layouts)

    def release(self, slot: int) -> None:
        """Slot `slot`'s K/V need be kept only while they cost the other slots' passes nothing (a
        finished request's, kept for a later prompt that shares it): `resumable` then says how
        much of them is left. Engines that lay their slots out once keep them whole."""

    def _forward(self, token_ids: np.ndarray, start: int, tree, last: bool, features) -> np.ndarray:
        raise NotImplementedError

    def _forward_batch(self, tokens: np.ndarray, starts: np.ndarray, first: int, last: bool, pad: bool,
                       layouts) -> np.ndarray:
        raise InputError(f"{self.name}: this backend runs one sequence per pass; batched serving takes "
                         "--backend ort or torch")


@dataclass
class Checked:
    """A round's draft and the target's verdict on it, before acceptance.

    draft_tokens [k'], draft_probs [k', V] (sampled model drafts; None: a point mass or greedy),
    and the target's k'+1 rows as logits [k'+1, V] or, where a device round brought back only
    its argmaxes (greedy), as `target_tokens` [k'+1].
    """

    draft_tokens: np.ndarray
    draft_probs: np.ndarray | None = None
    target_logits: np.ndarray | None = None
    target_tokens: np.ndarray | None = None
    verify_seconds: float = 0.0
