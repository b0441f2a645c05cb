"""A Gemma 4 assistant drafting over the target's own K/V (docs/drafters.md, "Gemma 4 assistants").

With n committed tokens the target has computed positions 0..n-2: its K/V there, and its final
hidden state at each (the target's graph writes them into `target.features` on every pass,
as for an EAGLE-3 head). A round's drafts all come from position n-1: the first step feeds the
target's embedding of the last committed token beside the target's state at n-2 (the row that
predicted that token), each further step the token it just drafted beside its own state. Every
step reads the target's KV buffers where they lie (bound by address, never copied), up to slot
n-1, so the assistant keeps nothing between rounds: rollback is the target's length. Its drafts
are its argmax (as Hugging Face's candidate generator drafts them, sampled requests too): a
point mass on each, which the acceptance rule keeps lossless.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdeploy.core.errors import BundleError
from specdeploy.core.graph_io import ASSISTANT_HIDDEN, ASSISTANT_STATE
from specdeploy.core.manifest import Bundle, DraftEntry, ModelSpec

from specdeploy.runtime.backends import BackendChoice
from specdeploy.runtime.decoding.drafters.model import _softmax_max, static_cost_ratio
from specdeploy.runtime.decoding.drafters.proposal import Proposal
from specdeploy.runtime.decoding.sampling import SamplingParams


def kv_input_names(spec: ModelSpec) -> list[str]:
    return [f"target_{part}_{j}" for j in spec.reads_kv for part in ("key", "value")]


def load_session(graph_path: Path, spec: ModelSpec, threads: int | None) -> ort.InferenceSession:
    """The assistant's session (on the process's shared pool where there is one), its inputs and
    outputs checked against the manifest."""
    from specdeploy.runtime.backends import ort as backend

    so = backend.session_options(threads, spinning=False, shared=backend._pool_threads is not None)
    try:
        session = ort.InferenceSession(str(graph_path), so, providers=[backend.CPU])
    except Exception as e:  # onnxruntime's own error types
        raise BundleError(f"{graph_path}: ONNX Runtime cannot load this graph ({backend._reason(e)}); "
                          "re-export the bundle") from None
    have = ({i.name for i in session.get_inputs()}, {o.name for o in session.get_outputs()})
    if have != (set(spec.inputs), set(spec.outputs)):
        raise BundleError(f"{graph_path}: its inputs and outputs are not the manifest's ({sorted(have[0])[:6]}); "
                          "re-export the bundle")
    return session


class AssistantEngine:
    """The assistant's graph on ONNX Runtime's CPU provider: one step a pass, over KV buffers
    that are the target's (host arrays, bound by address)."""

    def __init__(self, graph_path: Path, spec: ModelSpec, max_seq: int, kv: list[np.ndarray] | None = None,
                 threads: int | None = None, session: ort.InferenceSession | None = None):
        self.graph_path, self.spec, self.max_seq = graph_path, spec, max_seq
        self.name = f"draft ({Path(graph_path).name})"
        self.session = session or load_session(graph_path, spec, threads)
        self._threads = threads
        self.runs = 0
        self.vocab_size = spec.vocab_size
        width = spec.inputs[ASSISTANT_HIDDEN][-1]
        self.ids = np.zeros((1, 1), np.int64)
        self.hidden = np.zeros((1, 1, width), np.float32)
        self.position = np.zeros((1, 1), np.int64)
        self.mask = np.zeros((1, 1, 1, max_seq), np.float32)  # every slot before the position is seen
        self.logits = np.zeros((1, 1, spec.vocab_size), np.float32)
        self.state = np.zeros((1, 1, width), np.float32)
        self.binding = self.session.io_binding()
        for name, array in (("input_ids", self.ids), (ASSISTANT_HIDDEN, self.hidden), ("position_ids", self.position)):
            self.binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        for name, array in (("logits", self.logits), (ASSISTANT_STATE, self.state)):
            self.binding.bind_output(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        self._kv: list[int] = []  # the addresses bound
        self._window = 0
        if kv is not None:
            self.bind_kv(kv)

    def fork(self) -> "AssistantEngine":
        return AssistantEngine(self.graph_path, self.spec, self.max_seq, None, self._threads, self.session)

    def bind_kv(self, kv: list[np.ndarray]) -> None:
        """Bind the target's buffers the graph reads (key, value of each pair, [1, Hkv, S, D])."""
        addresses = [a.ctypes.data for a in kv]
        if addresses == self._kv:
            return
        for name, array in zip(kv_input_names(self.spec), kv):
            want = [int(d) for d in self.spec.inputs[name]]
            if list(array.shape) != want or array.dtype != np.dtype(self.spec.kv_dtype) or not array.flags.c_contiguous:
                raise BundleError(f"{self.name}: the target's {name} is {array.dtype} {list(array.shape)}; the assistant "
                                  f"reads {self.spec.kv_dtype} {want}; re-export the bundle")
            self.binding.bind_input(name, "cpu", 0, array.dtype, want, array.ctypes.data)
        self._kv = addresses

    def step(self, token: int, hidden: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray]:
        """One draft step at `position` (reading the target's slots before it) -> (logits [V],
        state [backbone]): views of this engine's buffers, valid until the next step."""
        if not 1 <= position < self.max_seq:
            raise BundleError(f"{self.name}: a step at position {position}, outside [1, {self.max_seq})")
        self.runs += 1
        self.ids[0, 0] = token
        self.hidden[0, 0] = hidden
        self.position[0, 0] = position
        if position != self._window:
            self.binding.bind_input("attention_mask", "cpu", 0, np.float32, [1, 1, 1, position], self.mask.ctypes.data)
            self._window = position
        try:
            self.session.run_with_iobinding(self.binding)
        except RuntimeError as e:
            raise BundleError(f"{self.name}: ONNX Runtime failed a step at {position} ({str(e)[:160]})") from None
        return self.logits[0, 0], self.state[0, 0]


class AssistantDrafter:
    kind = "assistant"
    proposes_trees = keeps_history = model_free = False
    reads_target = True
    backends = ("ort",)  # the target's buffers on the host, as ONNX Runtime's CPU engines keep them

    def __init__(self, engine: AssistantEngine, cost_ratio: float = 0.0):
        self.engine = engine
        self.cost_ratio = cost_ratio
        self.target = None

    @classmethod
    def from_bundle(cls, bundle: Bundle, backend: BackendChoice | str, threads: int | None) -> "AssistantDrafter":
        choice = BackendChoice.of(backend)
        if choice.device is not None and choice.device.kind != "cpu":
            raise BundleError(f"{bundle.path}: its Gemma 4 assistant runs on the CPU for now, not {choice.device}")
        spec, target = bundle.model("draft"), bundle.model("target")
        engine = AssistantEngine(bundle.file(spec.graph), spec, bundle.max_seq, threads=threads)
        return cls(engine, static_cost_ratio(bundle, spec, target))

    @staticmethod
    def describe(entry: DraftEntry) -> str:
        return f"a Gemma 4 assistant over the target's K/V and final state ({entry.source})"

    def attach(self, target) -> None:
        """The target whose K/V and states the assistant reads (an engine with `features` and,
        on the host, `kv_arrays`; a batch lane's view of its slot)."""
        if target.features is None:
            raise BundleError(f"{target.name}: returns no hidden states for the assistant; re-export the bundle")
        self.target = target

    def fork(self) -> "AssistantDrafter":
        return type(self)(self.engine.fork(), self.cost_ratio)

    def reset(self) -> None:
        pass  # nothing is kept between rounds

    def fused_with(self, target) -> bool:
        return False

    def propose(self, ids: np.ndarray, k: int, params: SamplingParams, rng: np.random.Generator,
                min_confidence: float = 0.0) -> Proposal:
        """ids [n] committed tokens -> up to k drafts, each the assistant's argmax at position n-1."""
        t0 = time.perf_counter()
        n = ids.shape[0]
        if n < 2 or k < 1:
            return Proposal.nothing()
        kv = self.target.kv_arrays
        self.engine.bind_kv([kv[2 * j + part] for j in self.engine.spec.reads_kv for part in (0, 1)])
        token, hidden = int(ids[n - 1]), self.target.features[n - 2]
        tokens = np.empty(k, dtype=np.int64)
        count = passes = 0
        first_seconds = 0.0
        for i in range(k):
            logits, state = self.engine.step(token, hidden, n - 1)
            passes += 1
            if i == 0:
                first_seconds = time.perf_counter() - t0
            draft = int(logits.argmax())
            if i > 0 and min_confidence and _softmax_max(logits) < min_confidence:
                break  # unsure: stop drafting here (the first token is always proposed)
            tokens[i] = draft
            count += 1
            token, hidden = draft, state.copy()
        return Proposal(tokens[:count], None, time.perf_counter() - t0, passes, 0, first_seconds)


__all__ = ["AssistantDrafter", "AssistantEngine"]
