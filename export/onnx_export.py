"""Graph -> ONNX, and the on-the-spot parity check against PyTorch eager."""
from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import torch

from specdeploy.core.choices import NUMPY_DTYPES
from specdeploy.core.graph_io import GRAPH_FACTS, LOGITS_ROWS, attention_mask, bypass_nodes, io_names
from specdeploy.core.manifest import EXTERNAL_DATA, ModelSpec
from specdeploy.core.errors import ExportError

from .graph import SpecGraph
from .ops import OPSET, kv_write, onnx_translations
from .recurrent import lower_scans

# --dtype -> the float type of the graph's activations and KV cache. int8/int4 are
# weight-only (export/quantize.py): activations and the KV cache stay float32.
TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.float32,
               "int4": torch.float32}  # per core DTYPES
# Largest |ONNX Runtime - eager| allowed, relative to the largest |logit|, per dtype. The
# int graphs' eager module rounds activations to int8 blocks exactly as MatMulNBits does
# (a single node matches it to 1e-6, tests/test_quant.py), but rounding is discontinuous:
# ONNX Runtime's fused float ops (layer norm, SiLU, attention scale) differ from eager in
# the last bits, a value that lands on the other side of a rounding boundary moves by one
# int8 step, and over 30 layers that compounds. Random token ids compound it most: on
# SmolLM2 int4 (fast scheme, 30 layers) 0.075 with a float embedding and 0.42 with the
# 4-bit one, where the same graphs differ by 0.04-0.06 on text. So the int graphs' passes
# read text (PARITY_TEXT): there the fast graph gives 0.039 and the same graph with its
# embedding's nibbles swapped in eager 1.05. The bound catches a wrong graph; the quality
# table (benchmarks/quant_quality.py) measures the quantized model against fp32.
PARITY_RTOL = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 8e-2, "int8": 0.25, "int4": 0.25}
MIN_TEXT_IDS = 16  # fewer text ids than this (a model smaller than its tokenizer): random ids
# The text the int graphs' parity passes read (its token ids, repeated to the schedule's length).
PARITY_TEXT = (
    "A speculative decoder drafts a few tokens cheaply, then the target model checks them all in one "
    "pass and keeps the longest prefix it agrees with. The output is the target's own: greedy decoding "
    "gives the same tokens, sampling the same distribution. Whether it pays depends on how often the "
    "draft is right and on what a draft step costs next to a verify pass."
)


def kv_buffers(graph: SpecGraph, max_seq: int, dtype: torch.dtype, batch: int = 1) -> list[torch.Tensor]:
    """Zeroed KV buffers of `graph`: a key and a value buffer per layer that keeps K/V (kv_layout)."""
    return [torch.zeros((batch, heads, max_seq, dim), dtype=dtype) for heads, dim in graph.kv_layout for _ in range(2)]


def state_buffers(graph: SpecGraph, batch: int = 1) -> list[torch.Tensor]:
    """Zeroed states of `graph`'s linear-attention layers (float32): convolution, recurrent per layer."""
    return [torch.zeros((batch, *shape), dtype=torch.float32) for pair in graph.state_layout for shape in pair]


def export_onnx(graph: SpecGraph, path: Path, max_seq: int, kv_dtype: torch.dtype, optimize: bool = True,
                facts: dict | None = None, standard_quant: bool = False, max_batch: int = 1,
                windowed: bool = False) -> dict[str, int] | None:
    """Export with torch.onnx (dynamo), name the dynamic dims B, T and L, run onnx.checker.

    `windowed`: attention reads the K/V buffers as bound, [B, Hkv, L, D] (`read_bound_kv`), not a
    prefix sliced out of [B, Hkv, max_seq, D].

    `max_batch` > 1: the batch dimension B (sequences per pass, each with its own KV slot,
    write index and mask) is dynamic, 1..max_batch; 1 keeps it fixed at 1 (an EAGLE-3 head).

    `standard_quant`: each MatMulNBits rewritten as DequantizeLinear + MatMul (export/qdq.py);
    returns how many weights became INT4 and INT8 (None without it).
    `optimize` runs the exporter's graph optimizer (constant folding: TensorRT's parser
    wants constant axes and shapes as initializers). The CPU-only quantized graphs skip it:
    ONNX Runtime folds the same at load, and on them the optimizer's pattern matching
    takes minutes."""
    import onnx

    t = 3
    b = 2 if max_batch > 1 else 1  # an example of 2: a dim of 1 would be fixed at 1
    example = (
        torch.zeros((b, t), dtype=torch.int64),
        torch.arange(t)[None].expand(b, t).contiguous(),
        torch.zeros(b, dtype=torch.int64),
        torch.zeros((b, 1, t, t), dtype=torch.float32),
        kv_buffers(graph, max_seq, kv_dtype, b),
        torch.tensor([0, 2]),  # logits_rows: R = 2 of T = 3, so that the exporter ties neither to the other
        *(torch.zeros((b, t, width)) for width in graph.feature_inputs.values()),  # an EAGLE-3 head's states
    )
    if graph.state_layout:  # the linear-attention layers' states before the pass
        example = (*example, state_buffers(graph, b))
    dim_t = torch.export.Dim("T", min=1, max=max_seq)
    dim_l = torch.export.Dim("L", min=1, max=max_seq)
    dim_r = torch.export.Dim("R", min=1, max=max_seq)
    batched = max_batch > 1
    dim_b = torch.export.Dim("B", min=1, max=max_batch) if batched else None
    first = {0: dim_b} if batched else {}
    dynamic = {
        "input_ids": {**first, 1: dim_t},
        "position_ids": {**first, 1: dim_t},
        "write_indices": first or None,
        "attention_mask": {**first, 2: dim_t, 3: dim_l},
        "past": [first or None] * (2 * len(graph.kv_layout)),
        "logits_rows": {0: dim_r},
        **{name: {**first, 1: dim_t} for name in graph.feature_inputs},
        **({"states": [first or None] * (2 * len(graph.state_layout))} if graph.state_layout else {}),
    }
    inputs, outputs = io_names(len(graph.kv_layout), True, tuple(graph.feature_inputs), tuple(graph.feature_outputs),
                               len(graph.state_layout))
    with warnings.catch_warnings(), _quiet_exporter():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            graph,
            example,
            input_names=inputs,
            output_names=outputs,
            opset_version=OPSET,
            dynamo=True,
            dynamic_shapes=dynamic,
            custom_translation_table=onnx_translations(),
            verbose=False,
            optimize=optimize,
        )
    external = weight_bytes(graph) > INLINE_BYTES
    program.save(path, external_data=external)
    model = onnx.load(str(path))  # the weights too, where they were written beside it
    lower_scans(model)  # the recurrences of linear-attention layers, as standard ONNX
    _name_dims(model)
    _drop_unused_outputs(model)
    if windowed:
        read_bound_kv(model)
    counts = None
    if standard_quant:  # MatMulNBits as DequantizeLinear + MatMul: the same values in standard ONNX
        from .qdq import to_dequantize_linear

        counts = to_dequantize_linear(model)
    if facts is not None:  # what the manifest will say of this graph (core/graph_io.py GRAPH_FACTS)
        onnx.helper.set_model_props(model, {GRAPH_FACTS: json.dumps(facts, sort_keys=True)})
    save_graph(model, path, external)
    onnx.checker.check_model(str(path), full_check=True)
    ops = {n.op_type for n in model.graph.node}
    writer = "GroupQueryAttention" if graph.fused else "TensorScatter"
    if writer not in ops:
        raise ExportError(f"{path}: export produced no {writer} node; the KV cache would not be written in place")
    return counts


# Weights past this are written beside the graph, in <graph>.data (core/manifest.py EXTERNAL_DATA):
# protobuf refuses a message of 2 GiB or more, and an ONNX file is one message. Below it a graph
# stays one file, as bundles always had it.
INLINE_BYTES = 1 << 30


def weight_bytes(module: torch.nn.Module) -> int:
    """What a module's parameters and buffers take: about what its graph's initializers take."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}  # a tied table once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def save_graph(model, path: Path, external: bool) -> None:
    """Write `model` to `path`; with `external`, its weights into EXTERNAL_DATA beside it (one
    file, replaced whole: onnx appends to a weights file it finds there)."""
    import onnx

    data = Path(path).with_name(Path(path).name + EXTERNAL_DATA)
    data.unlink(missing_ok=True)
    if external:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name,
                  size_threshold=1024)
    else:
        onnx.save(model, str(path))


def _name_dims(model) -> None:
    """Give the exporter's symbolic dims the contract's names: B (sequences), T (tokens), L
    (window) and R (logit rows)."""
    graph_inputs = {i.name: i for i in model.graph.input}
    batch = graph_inputs["input_ids"].type.tensor_type.shape.dim[0].dim_param
    rename = {
        **({batch: "B"} if batch else {}),
        graph_inputs["input_ids"].type.tensor_type.shape.dim[1].dim_param: "T",
        graph_inputs["attention_mask"].type.tensor_type.shape.dim[3].dim_param: "L",
        graph_inputs[LOGITS_ROWS].type.tensor_type.shape.dim[0].dim_param: "R",
    }
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in rename:
                dim.dim_param = rename[dim.dim_param]


def read_bound_kv(model) -> int:
    """Make attention read each KV buffer whole, as the runtime binds it: [B, Hkv, L, D], L the
    mask's window, instead of slicing the first L slots out of a [B, Hkv, max_seq, D] buffer.

    The Slice copied the live prefix of every K and V, every layer, every pass: at 3k tokens of
    context the largest operator of an int4 SmolLM2 step. Bound at the window, the buffer is the
    prefix: the runtime lays its slots out at the window's stride (runtime/backends/ort.py,
    "KV capacity") and the score and value products read it where it lies. The values read are
    the same, in the same order, so logits are bit-identical to the sliced graph's. -> the
    Slices removed."""
    graph = model.graph
    kv = {v.name for v in list(graph.input) + list(graph.output) if v.name.startswith(("past_", "present_"))}
    cut = [n for n in graph.node if n.op_type == "Slice" and n.input[0] in kv]
    bypass_nodes(graph, cut, {n.output[0]: n.input[0] for n in cut})
    for value in list(graph.input) + list(graph.output):
        if value.name in kv:
            dims = value.type.tensor_type.shape.dim
            dims[2].Clear()
            dims[2].dim_param = "L"
    _drop_dead_nodes(model)
    return len(cut)


def _reads(nodes) -> set[str]:
    """The names `nodes` read, those their subgraphs (a Scan's, an If's branches) read included."""
    import onnx

    read = set()
    for node in nodes:
        read.update(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                read |= _reads(sub.node) | {out.name for out in sub.output}
    return read


def _drop_dead_nodes(model) -> None:
    """Remove the nodes whose outputs nothing reads (what computed the Slices' bounds)."""
    graph = model.graph
    while True:
        read = _reads(graph.node) | {out.name for out in graph.output}
        dead = [n for n in graph.node if not any(out in read for out in n.output if out)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    produced = {out for node in graph.node for out in node.output} | {v.name for v in graph.input}
    kept = [v for v in graph.value_info if v.name in produced]
    del graph.value_info[:]
    graph.value_info.extend(kept)


# Outputs a contrib op computes only when they are named (ONNX: an empty name is an omitted
# optional output). The exporter names every output of a custom translation.
OPTIONAL_OUTPUTS = {"SkipSimplifiedLayerNormalization": (1, 2, 3)}  # mean, inv_std_var, input_skip_bias_sum


def _drop_unused_outputs(model) -> None:
    """Omit the optional outputs nothing reads. SkipSimplifiedLayerNormalization allocates and
    writes its mean and inverse standard deviation whenever they are named: on SmolLM2 int4
    (fast scheme, fused: 60 such nodes) a step took about 2% longer with them (raw runs of
    both graphs on one thread pool, alternating step by step, both load orders)."""
    graph = model.graph
    read = {name for node in graph.node for name in node.input} | {out.name for out in graph.output}
    dropped = set()
    for node in graph.node:
        for i in OPTIONAL_OUTPUTS.get(node.op_type, ()):
            if i < len(node.output) and node.output[i] and node.output[i] not in read:
                dropped.add(node.output[i])
                node.output[i] = ""
        while node.output and not node.output[-1]:
            node.output.pop()  # trailing omitted outputs may simply be left off
    kept = [v for v in graph.value_info if v.name not in dropped]
    del graph.value_info[:]
    graph.value_info.extend(kept)


class _quiet_exporter:
    """torch.onnx prints progress lines to stdout and warnings to logging; keep the CLI clean."""

    def __enter__(self):
        import contextlib
        import io

        self._redirect = contextlib.redirect_stdout(io.StringIO())
        self._redirect.__enter__()
        self._level = logging.getLogger("torch").level
        logging.getLogger("torch").setLevel(logging.ERROR)

    def __exit__(self, *exc):
        logging.getLogger("torch").setLevel(self._level)
        return self._redirect.__exit__(*exc)


def parity_schedule(max_seq: int, max_draft: int, prefill_chunk: int) -> list[tuple[int, int]]:
    """(start, T) passes that cover a prefill chunk, single steps and verify passes at
    several write positions, all inside the buffer."""
    chunk = min(prefill_chunk, max(1, max_seq // 4))
    schedule = [(0, chunk)]
    pos = chunk
    for t in (1, max_draft + 1, 1, 2, max_draft + 1, 1):
        if pos + t > max_seq:
            break
        schedule.append((pos, t))
        pos += t
    return schedule


def check_draft_parity(name: str, what: str, worst_ort: float, worst_ref: float, bound: float) -> None:
    """A draft graph's two parity figures against `bound`: ONNX Runtime against eager, and eager
    (`what`: the head's, the assistant's graph module) against the published forward."""
    if worst_ort > bound:
        raise ExportError(f"{name}: ONNX Runtime differs from PyTorch eager by {worst_ort:.2e} (relative to the "
                          f"largest value), over the {bound:.0e} bound")
    if worst_ref > bound:
        raise ExportError(f"{name}: {what} differs from the published forward by {worst_ref:.2e}, over {bound:.0e}")


def _rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    """Largest difference relative to the largest logit (at least 1). Logits that are -inf
    (tokens outside a distilled draft's head) must be -inf in both: else the difference is inf."""
    real = np.isfinite(want)
    if not np.array_equal(real, np.isfinite(got)) or not np.array_equal(got[~real], want[~real]):
        return float("inf")
    if not real.any():
        return 0.0
    return float(np.abs(got[real] - want[real]).max()) / max(1.0, float(np.abs(want[real]).max()))


def check_parity(
    graph: SpecGraph,
    onnx_path: Path,
    spec: ModelSpec,
    max_seq: int,
    max_draft: int,
    prefill_chunk: int,
    dtype: str,
    hf_model=None,
    seed: int = 0,
    text_ids: np.ndarray | None = None,
) -> dict:
    """Run the same passes through ONNX Runtime and PyTorch eager; compare every logit.

    The passes read random token ids, or with `text_ids` (repeated as needed) a text's:
    the quantized graphs' check (PARITY_RTOL). Text ids past the model's vocabulary are
    left out; with fewer than MIN_TEXT_IDS left, the ids are random. With `hf_model`,
    eager is also checked against the source model's own forward over the whole sequence
    (the slow reference). Returns the max differences; raises on a difference past
    PARITY_RTOL.
    """
    from specdeploy.runtime.backends.ort import OrtEngine

    # bf16: ONNX Runtime's CPU provider has no bfloat16 kernels; eager is checked against the source
    engine = OrtEngine(onnx_path, spec, max_seq, threads=None) if dtype in NUMPY_DTYPES else None
    past = kv_buffers(graph, max_seq, getattr(torch, spec.kv_dtype))
    states = state_buffers(graph) if graph.state_layout else None  # eager's, carried from pass to pass
    rng = np.random.default_rng(seed)
    schedule = parity_schedule(max_seq, max_draft, prefill_chunk)
    total = sum(t for _, t in schedule)
    text = np.asarray(text_ids if text_ids is not None else [], dtype=np.int64)
    text = text[(text >= 0) & (text < spec.vocab_size)]  # a model smaller than its tokenizer reads what it has
    if text.size < MIN_TEXT_IDS:
        ids = rng.integers(0, spec.vocab_size, size=total)
    else:
        ids = np.resize(text, total)
    graph.inplace = True
    worst_ort = worst_hf = worst_states = 0.0
    eager_rows = []
    try:
        with torch.no_grad():
            for i, (start, t) in enumerate(schedule):
                chunk = ids[start : start + t]
                last = t > 1 and i % 2 == 1  # every other pass of several tokens asks for its last row only
                mask = torch.from_numpy(attention_mask(start, t, spec.sliding_window))
                outputs = graph(
                    torch.from_numpy(chunk)[None], torch.arange(start, start + t)[None], torch.tensor([start]), mask, past,
                    None, states,
                )
                if states is not None:  # the states after the pass's last row open the next
                    states = [s[:, -1] for s in outputs[1 + len(past) : 1 + len(past) + len(states)]]
                want = outputs[0][0].float().numpy()
                eager_rows.append(want)
                if engine is None:
                    continue
                got = engine.forward(chunk, start, last=last).copy()
                if engine.features is not None:  # a target for an EAGLE-3 head: the states it returns, every row
                    worst_states = max(worst_states, _rel_diff(engine.features[start : start + t], outputs[-1][0].numpy()))
                if got.shape[0] != (1 if last else t):
                    raise ExportError(f"{onnx_path.name}: a pass of {t} tokens asked for {1 if last else t} logit rows "
                                      f"and returned {got.shape[0]}")
                worst_ort = max(worst_ort, _rel_diff(got, want[-got.shape[0]:]))
            if hf_model is not None:
                ref = hf_model(torch.from_numpy(ids)[None]).logits[0].float().numpy()
                if graph.head_vocab is not None:  # a distilled draft: its head covers these tokens only
                    outside = np.ones(ref.shape[-1], dtype=bool)
                    outside[graph.head_vocab.numpy()] = False
                    ref[:, outside] = -np.inf
                worst_hf = _rel_diff(np.concatenate(eager_rows), ref)
    finally:
        graph.inplace = False
    # Float16 KV buffers (export --kv-dtype fp16) under float32 activations: a key or value that
    # ONNX Runtime and eager compute a float32 ulp apart can round to neighbouring float16
    # values (measured on SmolLM2 fp32: 3.7e-4 against eager, 1e-4 the float32 bound), and both
    # round what the source keeps in float32: the check holds them to the fp16 graphs' bound.
    bound = max(PARITY_RTOL[dtype], PARITY_RTOL["fp16"]) if spec.kv_dtype == "float16" else PARITY_RTOL[dtype]
    if worst_ort > bound:
        raise ExportError(
            f"{onnx_path.name}: ONNX Runtime logits differ from PyTorch eager by {worst_ort:.2e} "
            f"(relative to the largest logit), over the {bound:.0e} bound"
        )
    if worst_states > bound:
        raise ExportError(f"{onnx_path.name}: the hidden states ONNX Runtime returns for an EAGLE-3 head differ from "
                          f"PyTorch eager by {worst_states:.2e} (relative to the largest), over the {bound:.0e} bound")
    if worst_hf > bound:
        raise ExportError(
            f"{onnx_path.name}: the exported module differs from the source model by {worst_hf:.2e}, over {bound:.0e}"
        )
    return {
        "passes": [list(p) for p in schedule],
        "max_rel_diff_ort_vs_eager": worst_ort if engine is not None else None,
        "max_rel_diff_eager_vs_source": worst_hf if hf_model is not None else None,
        **({"max_rel_diff_states_ort_vs_eager": worst_states} if engine is not None and engine.features is not None else {}),
        "bound": bound,
    }




__all__ = ["PARITY_TEXT", "TORCH_DTYPE", "check_parity", "export_onnx", "io_names", "kv_write"]
