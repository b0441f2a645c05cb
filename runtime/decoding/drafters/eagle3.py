"""An EAGLE-3 head drafting from the target's own hidden states (docs/drafters.md, "EAGLE-3 heads").

Row p of the head's cache pairs the target's states at position p (the inputs of three of its
layers, which the target's graph writes into `target.features` on every pass) with the token
at p + 1, and predicts the token at p + 2. With n committed tokens the target has computed
positions 0..n-2, so the head's cache can hold rows 0..n-2 from the target; a round's first
pass catches up on the rows the last round committed (the verify pass's rows of the accepted
tokens), its last row proposes the first draft token, and each further step feeds the head
its own last state and the token it just proposed. Those steps' rows are the head's, not the
target's: the next round's catch-up writes over them (rollback is the length, as for every
draft).
"""
from __future__ import annotations

import time

import numpy as np

from specdeploy.core.errors import BundleError
from specdeploy.core.graph_io import AUX_HIDDEN, DRAFT_HIDDEN, DRAFT_HIDDEN_OUT
from specdeploy.core.manifest import Bundle, DraftEntry

from specdeploy.runtime.backends import BackendChoice, make_engine
from specdeploy.runtime.decoding.drafters.model import _softmax_max, static_cost_ratio
from specdeploy.runtime.decoding.drafters.proposal import Proposal
from specdeploy.runtime.decoding.engine import Engine
from specdeploy.runtime.decoding.sampling import SamplingParams, sample, warp


def read_vocab_map(bundle: Bundle) -> np.ndarray:
    """The bundle's draft-id -> target-id map, checked: int64 [draft vocab], distinct ids in the vocabulary."""
    path = bundle.file(bundle.draft.vocab_map)
    head, target = bundle.model("draft"), bundle.model("target")
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise BundleError(f"{path}: not a vocabulary map ({str(e)[:80]}); re-export the bundle") from None
    if ids.dtype != np.int64 or ids.shape != (head.draft_vocab,) or int(ids.min()) < 0 \
            or int(ids.max()) >= target.vocab_size or np.unique(ids).shape[0] != ids.shape[0]:
        raise BundleError(f"{path}: expected {head.draft_vocab} distinct int64 token ids below {target.vocab_size}, "
                          f"got {ids.dtype} {list(ids.shape)}; re-export the bundle")
    return ids


class Eagle3Drafter:
    kind = "eagle3"
    proposes_trees = keeps_history = model_free = False
    reads_target = True
    backends = ("ort", "torch")  # where its engines feed it the target's states (the ort one: on the CPU)

    def __init__(self, engine: Engine, to_target: np.ndarray, vocab_size: int, chunk: int, cost_ratio: float = 0.0):
        self.engine = engine
        self.to_target = to_target  # draft id -> target id
        self.vocab_size = vocab_size  # the target's: the verifier's probabilities are over it
        self.chunk = chunk  # rows per catch-up pass (the bundle's prefill chunk)
        self.cost_ratio = cost_ratio
        self.target: Engine | None = None
        self.seen = np.empty(engine.max_seq + 1, dtype=np.int64)  # the ids the cache's rows were computed from
        self.length = 0  # rows 0..length-1 hold the target's states (row p: ids[0..p+1])
        self._runs = None  # the head engine's pass count when `length` was last true

    @classmethod
    def from_bundle(cls, bundle: Bundle, backend: BackendChoice | str, threads: int | None) -> "Eagle3Drafter":
        head, target = bundle.model("draft"), bundle.model("target")
        engine = make_engine(BackendChoice.of(backend), bundle, head, threads)
        return cls(engine, read_vocab_map(bundle), target.vocab_size, bundle.prefill_chunk,
                   static_cost_ratio(bundle, head, target))

    @staticmethod
    def describe(entry: DraftEntry) -> str:
        return f"an EAGLE-3 head over the target's layers {entry.aux_layers} ({entry.source})"

    def attach(self, target: Engine) -> None:
        """The target whose states the head reads (its engine's `features`)."""
        if target.features is None:
            raise BundleError(f"{target.name}: returns no hidden states for the draft's head ({self.kind}); re-export "
                              "the bundle")
        self.target = target
        self.length = 0

    def fork(self) -> "Eagle3Drafter":
        return type(self)(self.engine.fork(), self.to_target, self.vocab_size, self.chunk, self.cost_ratio)

    def reset(self) -> None:
        self.length = 0

    def fused_with(self, target: Engine) -> bool:
        return False

    def _rollback(self, ids: np.ndarray) -> int:
        """Rows still true for `ids`: each row p was computed from ids[0..p+1]; nothing is
        trusted if anyone else ran the head since (or a pass of ours failed)."""
        if self.engine.runs != self._runs:
            self.length = 0
        m = min(self.length, ids.shape[0] - 1)
        differ = np.flatnonzero(self.seen[: m + 1] != ids[: m + 1])
        return m if not differ.size else max(0, int(differ[0]) - 1)

    def propose(self, ids: np.ndarray, k: int, params: SamplingParams, rng: np.random.Generator,
                min_confidence: float = 0.0) -> Proposal:
        """ids [n] committed tokens -> up to k draft tokens (target ids) and their draft probs."""
        t0 = time.perf_counter()
        n = ids.shape[0]
        start = self._rollback(ids)
        if n < 2 or k < 1:
            return Proposal.nothing()
        features = self.target.features
        # catch up on rows start..n-2: the target's states with the token after each
        caught_up = n - 1 - start
        logits = None
        for at in range(start, n - 1, self.chunk):
            end = min(at + self.chunk, n - 1)
            logits = self.engine.forward(ids[at + 1 : end + 1], at, last=True,
                                         features={AUX_HIDDEN: features[at:end], DRAFT_HIDDEN: None})
        if logits is None:  # every row was there already: the last one's logits again
            logits = self.engine.forward(ids[n - 1 : n], n - 2, features={AUX_HIDDEN: features[n - 2 : n - 1],
                                                                          DRAFT_HIDDEN: None})
            caught_up = 1
        first_seconds = time.perf_counter() - t0
        self.seen[:n] = ids
        self.length = n - 1
        tokens = np.empty(k, dtype=np.int64)
        probs = None if params.greedy else np.zeros((k, self.vocab_size), dtype=np.float64)
        count, passes = 0, 1
        for i in range(k):
            row = logits[-1]
            if params.greedy:
                draft = int(row.argmax())
                confidence = _softmax_max(row) if min_confidence else 1.0
            else:
                q = warp(row, params)
                draft = sample(q, rng)
                confidence = q[draft]
                probs[i, self.to_target] = q
            if i > 0 and confidence < min_confidence:
                break  # unsure: stop drafting here (the first token is always proposed)
            tokens[i] = self.to_target[draft]
            count += 1
            if i == k - 1 or n - 1 + i >= self.engine.max_seq:
                break
            state = self.engine.outputs[DRAFT_HIDDEN_OUT][-1:]
            logits = self.engine.forward(tokens[i : i + 1], n - 1 + i, features={AUX_HIDDEN: None, DRAFT_HIDDEN: state})
            passes += 1
        self._runs = self.engine.runs
        return Proposal(tokens[:count], None if probs is None else probs[:count], time.perf_counter() - t0, passes,
                        caught_up, first_seconds)


class MtpDrafter(Eagle3Drafter):
    """The multi-token-prediction layer of the target's checkpoint (export/mtp.py): a head of the
    same contract over the target's final state, proposing from the whole vocabulary."""

    kind = "mtp"
    backends = ("ort", "torch")  # as an EAGLE-3 head (the torch one rebuilds the layer from the checkpoint)

    @classmethod
    def from_bundle(cls, bundle: Bundle, backend: BackendChoice | str, threads: int | None) -> "MtpDrafter":
        layer, target = bundle.model("draft"), bundle.model("target")
        engine = make_engine(BackendChoice.of(backend), bundle, layer, threads)
        return cls(engine, np.arange(target.vocab_size, dtype=np.int64), target.vocab_size, bundle.prefill_chunk,
                   static_cost_ratio(bundle, layer, target))

    @staticmethod
    def describe(entry: DraftEntry) -> str:
        return f"the multi-token-prediction layer of the target's checkpoint ({entry.source})"


__all__ = ["Eagle3Drafter", "MtpDrafter", "read_vocab_map"]
