"""Drafters propose the next tokens; the target decides.

A drafter is a class registered under the draft kind a bundle's manifest names (`DRAFTERS`,
one class for each of core.manifest's DRAFT_KINDS, the one list of kinds); adding a kind is
adding it there, a class and a line here (and a recipe on the export side). The protocol
(`Drafter`):

- `propose(ids, k, params, rng, min_confidence) -> Proposal`: tokens [k'] with 1 <= k' <= k,
  or k' = 0 when it has nothing to propose, and probs [k', V] or None. None means a point mass
  on each proposed token (a model-free drafter), so one verifier serves every drafter. Under
  sampling a model drafter samples its tokens from its own warped distribution, which the
  verifier needs as the probs. The proposal also says what it cost (seconds, passes).
- `fused_with(target)`: whether `propose_and_verify` can run the whole round on the device
  with one host synchronisation; it then returns the round's `Proposal` and `Checked`.
- `reads_target`, with `attach(target)`: a drafter that reads the target engine's state (an
  EAGLE-3 head reads its hidden states, a Gemma 4 assistant those and its K/V) is given it once
  the session has made it, and again in a fork;
- `model_free`: no graph of its own (a lookup on the host); `backends`: the backends it runs on
  (None: every one);
- optional, a drafter that proposes token trees (runtime/tree.py): `propose_tree(ids, budget,
  max_depth) -> DraftTree`; `remember(ids)` when a generation ends (what it said, for later
  requests); `private`, set per request (draw only on the request's own text, keep none of it).
"""
from __future__ import annotations

from typing import ClassVar, Protocol

import numpy as np

from specdeploy.core.errors import BundleError, InputError
from specdeploy.core.manifest import Bundle, DraftEntry, one_class_per_draft_kind

from specdeploy.runtime.backends import BackendChoice
from specdeploy.runtime.decoding.engine import Checked, Engine
from specdeploy.runtime.decoding.sampling import SamplingParams
from specdeploy.runtime.decoding.drafters.assistant import AssistantDrafter
from specdeploy.runtime.decoding.drafters.eagle3 import Eagle3Drafter, MtpDrafter
from specdeploy.runtime.decoding.drafters.model import ModelDrafter, SelfDrafter
from specdeploy.runtime.decoding.drafters.ngram import NgramDrafter, lookup
from specdeploy.runtime.decoding.drafters.proposal import Proposal
from specdeploy.runtime.decoding.drafters.suffix import SuffixDrafter, SuffixIndex


class Drafter(Protocol):
    kind: ClassVar[str]  # the manifest's draft kind
    proposes_trees: ClassVar[bool]  # offers propose_tree(ids, budget, max_depth) -> DraftTree
    keeps_history: ClassVar[bool]  # offers remember(ids) when a generation ends, and `private` per request
    model_free: ClassVar[bool]  # no graph: `engine` is None, a lookup on the host
    reads_target: ClassVar[bool]  # offers attach(target): it reads the target engine's state
    backends: ClassVar[tuple[str, ...] | None]  # the backends it runs on (None: every one)
    engine: Engine | None  # its graph's engine (None: model-free)
    cost_ratio: float  # a draft step over a target pass before anything is measured

    @classmethod
    def from_bundle(cls, bundle: Bundle, backend: BackendChoice | str, threads: int | None) -> "Drafter": ...

    @staticmethod
    def describe(entry: DraftEntry) -> str:
        """One line for `specdeploy inspect`."""
        ...

    def reset(self) -> None:
        """Forget any state kept from an earlier generation."""
        ...

    def fork(self) -> "Drafter":
        """Another drafter of the same weights with state (KV buffers) of its own."""
        ...

    def propose(
        self, ids: np.ndarray, k: int, params: SamplingParams, rng: np.random.Generator, min_confidence: float = 0.0
    ) -> Proposal: ...

    def fused_with(self, target: Engine) -> bool: ...

    def propose_and_verify(
        self, target: Engine, ids: np.ndarray, k: int, params: SamplingParams, rng: np.random.Generator
    ) -> tuple[Proposal, Checked]: ...


class NoDraft:
    """Kind `none`: the bundle has no draft; every round is a plain step."""

    kind = "none"
    proposes_trees = keeps_history = reads_target = False
    model_free = True
    backends = None
    engine = None

    @classmethod
    def from_bundle(cls, bundle: Bundle, backend: BackendChoice | str, threads: int | None) -> None:
        return None

    @staticmethod
    def describe(entry: DraftEntry) -> str:
        return "none (plain decoding only)"


DRAFTERS: dict[str, type] = one_class_per_draft_kind(
    (ModelDrafter, SelfDrafter, Eagle3Drafter, MtpDrafter, AssistantDrafter, NgramDrafter, SuffixDrafter, NoDraft), "the runtime's drafters")


def drafter_class(kind: str) -> type:
    cls = DRAFTERS.get(kind)
    if cls is None:
        raise BundleError(f"draft kind {kind!r} is not one this specdeploy runs ({', '.join(DRAFTERS)})")
    return cls


def make_drafter(bundle: Bundle, backend: BackendChoice | str, threads: int | None = None) -> Drafter | None:
    """The drafter the bundle's manifest names, on `backend`; None for kind `none`."""
    return drafter_class(bundle.draft_kind).from_bundle(bundle, backend, threads)


def check_backend(bundle: Bundle, backend: str) -> None:
    """A drafter that runs on some backends only refuses the others in one line."""
    allowed = drafter_class(bundle.draft_kind).backends
    if allowed is not None and backend not in allowed:
        raise InputError(f"{bundle.path}: its {bundle.draft_kind} draft runs on --backend {' or '.join(allowed)} for now, "
                         f"not {backend}")


__all__ = ["AssistantDrafter", "DRAFTERS", "Drafter", "check_backend", "Eagle3Drafter", "ModelDrafter", "MtpDrafter", "NgramDrafter", "NoDraft", "Proposal", "SelfDrafter",
           "SuffixDrafter", "SuffixIndex", "drafter_class", "lookup", "make_drafter"]
