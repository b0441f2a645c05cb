"""ONNX Runtime backend: IOBinding over KV buffers allocated once and written in place.

Every KV buffer is bound as both `past_*` input and `present_*` output, so the graph's
TensorScatter writes into it where it lies. Buffers and their bindings live as long as
the engine; a pass binds only its small inputs and a logits buffer of its T.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specdeploy.core.errors import BundleError
from specdeploy.core.graph_io import attention_mask, check_pass, io_names
from specdeploy.core.manifest import ModelSpec


def session_options(threads: int | None = None, spinning: bool = True) -> ort.SessionOptions:
    """`spinning`: whether the intra-op threads spin a while after each run, waiting for the
    next (ONNX Runtime's default). A draft's must not: after its step they would spin on the
    very cores the target's verify pass needs. Measured on 2 cores, SmolLM2 int4 target with a
    1-layer int8 draft: a T = 2 verify right after a draft step took 18.7 ms with the draft
    spinning and 10.1 ms without (a plain T = 1 step: 8.8-9.4 ms)."""
    so = ort.SessionOptions()
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads or os.cpu_count() or 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 4  # fatal only: a graph that fails to load is our one-line error, not its log
    return so


def _load(graph_path: Path, spec: ModelSpec, threads: int | None, spinning: bool) -> ort.InferenceSession:
    """An InferenceSession for one graph of the bundle, or a one-line BundleError naming the file:
    a graph ONNX Runtime cannot load, or whose inputs and outputs are not the graph contract's."""
    try:
        session = ort.InferenceSession(str(graph_path), session_options(threads, spinning),
                                       providers=["CPUExecutionProvider"])
    except Exception as e:  # InvalidProtobuf, Fail, InvalidGraph, NoSuchFile...: onnxruntime's own types
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BundleError(f"{graph_path}: ONNX Runtime cannot load this graph ({reason[:200]}); re-export the bundle") from None
    inputs, outputs = io_names(spec.num_layers)
    have = ({i.name for i in session.get_inputs()}, {o.name for o in session.get_outputs()})
    if have != (set(inputs), set(outputs)):
        missing = sorted((set(inputs) - have[0]) | (set(outputs) - have[1]))
        extra = sorted((have[0] - set(inputs)) | (have[1] - set(outputs)))
        raise BundleError(
            f"{graph_path}: its inputs and outputs are not the graph contract's for {spec.num_layers} layers "
            f"(missing {missing[:4]}, unexpected {extra[:4]}); re-export the bundle"
        )
    return session


class OrtEngine:
    """One graph of a bundle on ONNX Runtime (CPU)."""

    chains = False  # every pass returns its logits to the host
    device = "cpu"

    def __init__(
        self, graph_path: Path, spec: ModelSpec, max_seq: int, threads: int | None = None,
        session: ort.InferenceSession | None = None, spinning: bool | None = None,
    ):
        """`spinning` (see session_options): default on for the target, off for a draft."""
        self.spec = spec
        self.graph_path = graph_path
        self.name = f"{spec.role} ({graph_path.name})"
        self.max_seq = max_seq
        self.vocab_size = spec.vocab_size
        self.runs = 0  # passes begun: a prompt prefix cache trusts the KV only if nobody else ran one
        self.session = session or _load(graph_path, spec, threads, spec.role != "draft" if spinning is None else spinning)
        shape = (1, spec.num_kv_heads, max_seq, spec.head_dim)
        # Host arrays own the memory; OrtValues view it. Allocated once, bound once.
        self.kv_arrays = [np.zeros(shape, dtype=spec.kv_dtype) for _ in spec.kv_names]
        self._kv_values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.kv_arrays]
        self._binding = self.session.io_binding()
        for (inp, out), value in zip(spec.kv_names, self._kv_values):
            self._binding.bind_ortvalue_input(inp, value)
            self._binding.bind_ortvalue_output(out, value)
        self._logits: dict[int, np.ndarray] = {}  # one output buffer per distinct T
        self._logits_values: dict[int, ort.OrtValue] = {}

    @classmethod
    def from_bundle(cls, bundle, spec: ModelSpec, threads: int | None = None) -> "OrtEngine":
        return cls(bundle.file(spec.graph), spec, bundle.max_seq, threads)

    def fork(self) -> "OrtEngine":
        """Another engine over the same weights (ONNX Runtime runs one InferenceSession from
        several threads safely) with KV buffers and bindings of its own."""
        return OrtEngine(self.graph_path, self.spec, self.max_seq, session=self.session)

    def kv_addresses(self) -> list[int]:
        return [v.data_ptr() for v in self._kv_values]

    def forward(self, token_ids: np.ndarray, start: int) -> np.ndarray:
        """token_ids [T] at positions start..start+T-1 -> logits [T, V].

        The returned array is this engine's buffer for T: valid until the next pass of
        the same T.
        """
        self.runs += 1
        token_ids = np.asarray(token_ids, dtype=np.int64)
        check_pass(self.name, token_ids, start, self.max_seq, self.vocab_size)
        t = token_ids.shape[0]
        b = self._binding
        # Kept referenced until the run ends: the binding may view their memory.
        self._inputs = {
            "input_ids": np.ascontiguousarray(token_ids[None]),
            "position_ids": np.arange(start, start + t, dtype=np.int64)[None],
            "write_indices": np.array([start], dtype=np.int64),
            "attention_mask": attention_mask(start, t, self.spec.sliding_window),
        }
        for name, value in self._inputs.items():
            b.bind_cpu_input(name, value)
        if t not in self._logits:
            self._logits[t] = np.empty((1, t, self.vocab_size), dtype=np.float32)
            self._logits_values[t] = ort.OrtValue.ortvalue_from_numpy(self._logits[t])
        b.bind_ortvalue_output("logits", self._logits_values[t])
        self.session.run_with_iobinding(b)
        return self._logits[t][0]
