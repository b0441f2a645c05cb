"""The engine contract: what the loop, the drafters and the pool ask of a backend.

An engine runs one graph of a bundle over KV buffers it owns (allocated once, written in
place). `forward(token_ids, start)` writes the K/V of `token_ids` at positions
`start..start+T-1` and returns logits for every position. Rollback needs no method: slots
at and past the caller's length are never read.

Engines that can chain a draft on their device (`chains = True`: the torch backend; TensorRT
engines built with the argmax output) also offer `draft_chain` / `verify_chain`: a round of
k draft steps and one verify pass with a single host synchronisation. What such a round
brings back is a `Checked`, the same record the loop builds from a per-pass round.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


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

    def resumable(self, length: int) -> int:
        """The longest prefix, at most `length` tokens, that a pass may start after: `length`
        itself where the engine keeps only K/V; a model with recurrent states keeps them at
        recent positions only (runtime/backends/recurrent.py), and the caller feeds the tokens
        from the prefix this returns on."""
        ...

    # -- only where `trees` is True --------------------------------------------------------
    # forward(token_ids, start, tree=TreeLayout): a tree pass (runtime/tree.py)
    def move_kv(self, source: np.ndarray, start: int) -> None:
        """Copy the K/V at slots `source` [m] to slots start..start+m-1, in place."""
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
