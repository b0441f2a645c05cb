"""A draft graph with its own KV buffers: a separate model (`model`) or the target's first
layers (`self`), run one token at a time, or chained on the device where the engines allow."""
from __future__ import annotations

import time

import numpy as np

from specdeploy.core.manifest import Bundle, DraftEntry, ModelSpec, graph_bytes

from specdeploy.runtime.backends import BackendChoice, make_engine
from specdeploy.runtime.decoding.drafters.proposal import Proposal
from specdeploy.runtime.decoding.engine import Checked, Engine
from specdeploy.runtime.decoding.sampling import SamplingParams, sample, warp


class ModelDrafter:
    """`min_confidence` (given per round by the draft-length policy) stops a round early when
    the draft's own probability for the token it is about to propose falls below it."""

    kind = "model"
    proposes_trees = keeps_history = reads_target = model_free = False
    backends = None

    def __init__(self, engine: Engine, cost_ratio: float = 0.0):
        self.engine = engine
        self.cost_ratio = cost_ratio
        self.fed = np.empty(engine.max_seq, dtype=np.int64)  # tokens whose K/V the cache holds
        self.length = 0
        self._runs = None  # the engine's pass count when `fed` was last true (see Engine.runs)

    @classmethod
    def from_bundle(cls, bundle: Bundle, backend: BackendChoice | str, threads: int | None) -> "ModelDrafter":
        draft, target = bundle.model("draft"), bundle.model("target")
        return cls(make_engine(backend, bundle, draft, threads), static_cost_ratio(bundle, draft, target))

    @staticmethod
    def describe(entry: DraftEntry) -> str:
        return f"a separate model ({entry.source})"

    def fork(self) -> "ModelDrafter":
        return type(self)(self.engine.fork(), self.cost_ratio)

    def reset(self) -> None:
        self.length = 0

    def _rollback(self, ids: np.ndarray) -> np.ndarray:
        """Rollback is moving the length back to what the cache and the text agree on; the
        first pass then catches up on every token the cache has not seen (returned). If
        anyone else ran the engine since (or a pass of ours failed), nothing is trusted."""
        if self.engine.runs != self._runs:
            self.length = 0
        m = min(self.length, ids.shape[0] - 1)
        same = self.fed[:m] == ids[:m]
        self.length = self.engine.resumable(m if same.all() else int(same.argmin()))
        return ids[self.length :]

    def fused_with(self, target: Engine) -> bool:
        """Whether a round can run draft and verify on the device with one host
        synchronisation: both engines chain, on one device."""
        return self.engine.chains and target.chains and self.engine.device == target.device

    def propose_and_verify(self, target: Engine, ids: np.ndarray, k: int, params: SamplingParams,
                           rng: np.random.Generator) -> tuple[Proposal, Checked]:
        """The fused round: k draft tokens chained on the device, verified by the target from
        device memory, one host synchronisation. Under sampling the device generator is seeded
        from `rng`, so a seeded run replays."""
        t0 = time.perf_counter()
        pending = self._rollback(ids)
        seed = None if params.greedy else int(rng.integers(1 << 62))
        chain = self.engine.draft_chain(pending, self.length, k, None if params.greedy else params, seed)
        checked = target.verify_chain(int(ids[-1]), chain, ids.shape[0] - 1)
        fed = np.concatenate([pending, checked.draft_tokens[:-1]])  # the chain fed every draft token but the last
        self.fed[self.length : self.length + fed.shape[0]] = fed
        self.length += fed.shape[0]
        self._runs = self.engine.runs
        draft_seconds = self.engine.chain_seconds()
        checked.verify_seconds = time.perf_counter() - t0 - draft_seconds
        # the chain is timed as a whole: no first pass of its own
        proposal = Proposal(checked.draft_tokens, checked.draft_probs, draft_seconds, k, pending.shape[0])
        return proposal, checked

    def propose(self, ids: np.ndarray, k: int, params: SamplingParams, rng: np.random.Generator,
                min_confidence: float = 0.0) -> Proposal:
        """ids [n] committed tokens -> up to k draft tokens and their draft probs."""
        t0 = time.perf_counter()
        pending = self._rollback(ids)
        caught_up, first_seconds, passes = pending.shape[0], 0.0, 0
        tokens = np.empty(k, dtype=np.int64)
        probs = None if params.greedy else np.empty((k, self.engine.vocab_size), dtype=np.float64)
        count = 0
        for i in range(k):
            logits = self.engine.forward(pending, self.length, last=True)[-1]  # a catch-up: its last row only
            if i == 0:
                first_seconds = time.perf_counter() - t0
            self.fed[self.length : self.length + pending.shape[0]] = pending
            self.length += pending.shape[0]
            passes += 1
            if params.greedy:
                token = int(logits.argmax())
                confidence = _softmax_max(logits) if min_confidence else 1.0
            else:
                probs[i] = warp(logits, params)
                token = sample(probs[i], rng)
                confidence = probs[i, token]
            if i > 0 and confidence < min_confidence:
                break  # unsure: stop drafting here (the first token is always proposed)
            tokens[i] = token
            count += 1
            pending = tokens[i : i + 1]
        self._runs = self.engine.runs
        return Proposal(tokens[:count], None if probs is None else probs[:count], time.perf_counter() - t0, passes,
                        caught_up, first_seconds)


class SelfDrafter(ModelDrafter):
    """The target itself, or its first N layers with its own norm and head, at its own dtype
    or a lower one, exported as a graph of its own."""

    kind = "self"

    @staticmethod
    def describe(entry: DraftEntry) -> str:
        what = "the target itself" if entry.layers is None else f"the target's first {entry.layers} layers + its norm and head"
        return what + (f", at {entry.dtype}" if entry.dtype else "")


def static_cost_ratio(bundle: Bundle, draft: ModelSpec, target: ModelSpec) -> float:
    """A draft step over a target pass before anything is measured: at batch 1 a pass costs
    about the bytes of weights it reads, so the ratio of the graph files' sizes (a quantized
    self-draft has the target's parameter count but a quarter or less of its bytes). The
    policy measures the real ratio from the first rounds on; a low start lets it draft, and
    so measure, at all."""
    sizes = [graph_bytes(bundle.path, m.graph) for m in (draft, target)]
    return sizes[0] / max(sizes[1], 1)


def _softmax_max(logits: np.ndarray) -> float:
    z = logits - logits.max()
    return float(1.0 / np.exp(z).sum())
