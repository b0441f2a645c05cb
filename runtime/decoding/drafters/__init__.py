"""Drafters propose the next tokens; the target decides.

A drafter is a class registered under the draft kind a bundle's manifest names (`DRAFTERS`);
adding a kind is adding a class and a line. The protocol (`Drafter`):

- `propose(ids, k, params, rng, min_confidence) -> (draft_tokens [k'], draft_probs [k', V] or None)`
  with 1 <= k' <= k, or k' = 0 when it has nothing to propose. None means a point mass on each
  proposed token (a model-free drafter), so one verifier serves every drafter. Under
  sampling a model drafter samples its tokens from its own warped distribution, which the
  verifier needs as `draft_probs`.
- `fused_with(target)`: whether `propose_and_verify` can run the whole round on the device
  with one host synchronisation; it then returns the round's `Checked`.
- optional, a drafter that proposes token trees (runtime/tree.py): `propose_tree(ids, budget,
  max_depth) -> DraftTree`; `remember(ids)` when a generation ends (what it said, for later
  requests); `private`, set per request (draw only on the request's own text, keep none of it).
"""
from __future__ import annotations

from typing import ClassVar, Protocol

import numpy as np

from specdeploy.core.errors import BundleError
from specdeploy.core.manifest import Bundle, DraftEntry

from specdeploy.runtime.backends import BackendChoice
from specdeploy.runtime.decoding.engine import Checked, Engine
from specdeploy.runtime.decoding.sampling import SamplingParams
from specdeploy.runtime.decoding.drafters.model import ModelDrafter, SelfDrafter
from specdeploy.runtime.decoding.drafters.ngram import NgramDrafter, lookup
from specdeploy.runtime.decoding.drafters.suffix import SuffixDrafter, SuffixIndex


class Drafter(Protocol):
    kind: ClassVar[str]  # the manifest's draft kind
    engine: Engine | None  # its graph's engine (None: model-free)
    cost_ratio: float  # a draft step over a target pass before anything is measured
    passes: int  # draft passes run, and their seconds, since construction
    seconds: float
    caught_up: int  # tokens the last proposal's first pass fed (a model draft catching up; else 0)
    first_seconds: float  # the last proposal's first pass (0.0: not timed on its own)

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
    ) -> tuple[np.ndarray, np.ndarray | None]: ...

    def fused_with(self, target: Engine) -> bool: ...

    def propose_and_verify(
        self, target: Engine, ids: np.ndarray, k: int, params: SamplingParams, rng: np.random.Generator
    ) -> Checked: ...


class NoDraft:
    """Kind `none`: the bundle has no draft; every round is a plain step."""

    kind = "none"

    @classmethod
    def from_bundle(cls, bundle: Bundle, backend: BackendChoice | str, threads: int | None) -> None:
        return None

    @staticmethod
    def describe(entry: DraftEntry) -> str:
        return "none (plain decoding only)"


DRAFTERS: dict[str, type] = {cls.kind: cls for cls in (ModelDrafter, SelfDrafter, NgramDrafter, SuffixDrafter, NoDraft)}


def drafter_class(kind: str) -> type:
    cls = DRAFTERS.get(kind)
    if cls is None:
        raise BundleError(f"draft kind {kind!r} is not one this specdeploy runs ({', '.join(DRAFTERS)})")
    return cls


def make_drafter(bundle: Bundle, backend: BackendChoice | str, threads: int | None = None) -> Drafter | None:
    """The drafter the bundle's manifest names, on `backend`; None for kind `none`."""
    return drafter_class(bundle.draft_kind).from_bundle(bundle, backend, threads)


__all__ = ["DRAFTERS", "Drafter", "ModelDrafter", "NgramDrafter", "NoDraft", "SelfDrafter", "SuffixDrafter",
           "SuffixIndex", "drafter_class", "lookup", "make_drafter"]
