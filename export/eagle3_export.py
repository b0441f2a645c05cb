"""An EAGLE-3 head into a bundle: its graph (export/eagle3.py, Eagle3Graph), its draft-to-target
vocabulary map, and the parity check of the graph against PyTorch eager and against the
reference forward written from the published definition."""
from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from specdeploy.core.choices import KV_DTYPE, NUMPY_DTYPES
from specdeploy.core.errors import ExportError
from specdeploy.core.graph_io import AUX_HIDDEN, DRAFT_HIDDEN, DRAFT_HIDDEN_OUT, LOGITS_ROWS, attention_mask, graph_facts, kv_names
from specdeploy.core.manifest import ModelSpec

from .eagle3 import Eagle3Graph, Eagle3Head, Head, quantize_head
from .load import Source, source_digest
from .onnx_export import PARITY_RTOL, TORCH_DTYPE, _rel_diff, check_draft_parity, export_onnx, kv_buffers
from .quantize import SCHEMES, QuantEmbedding

GRAPH_FILE = "draft.onnx"
VOCAB_MAP = "draft_vocab.npy"  # int64 [draft vocab]: each draft id's target id


def head_graph(head: Head, target: Source, dtype: str, zero: str = "min", standard: bool = False
               ) -> tuple[Eagle3Graph, Eagle3Head]:
    """(the graph module at `dtype`, the float reference module). int8/int4 quantize the head's
    linears (and at int4 the embedding it reads, to 4-bit blocks: the draft only proposes;
    `standard`, for TensorRT's parser, keeps the embedding float)."""
    embed = target.model.model.embed_tokens
    reference = Eagle3Head.from_head(head, embed)
    module = copy.deepcopy(reference)
    record = None
    if dtype in SCHEMES:
        record = quantize_head(module, dtype, zero)
        if SCHEMES[dtype] == 4 and not standard:
            embed = QuantEmbedding.of(embed.weight)
            record["embedding"] = "int4"
    else:
        module = module.to(TORCH_DTYPE[dtype])
        embed = copy.deepcopy(embed).to(TORCH_DTYPE[dtype])
    graph = Eagle3Graph(module, embed).eval()
    graph.quantization = record
    return graph, reference


def head_entry(graph: Eagle3Graph, reference: Eagle3Head, head: Head, dtype: str, max_seq: int) -> ModelSpec:
    cfg = head.config
    kv_shape = [1, cfg.num_kv_heads, max_seq, cfg.head_dim]
    kv = kv_names(1)
    return ModelSpec(
        role="draft", graph=GRAPH_FILE, source=str(Path(head.path).resolve()), source_sha256=source_digest(head.path),
        architecture="eagle3", num_layers=1, source_layers=1, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        draft_vocab=cfg.draft_vocab_size, dtype=dtype, kv_dtype=KV_DTYPE[dtype],
        parameters=sum(p.numel() for p in reference.parameters()),  # the head's own (it reads the target's embedding)
        inputs={"input_ids": ["1", "T"], "position_ids": ["1", "T"], "write_indices": ["1"],
                "attention_mask": ["1", "1", "T", "L"], **{i: kv_shape for i, _ in kv}, LOGITS_ROWS: ["R"],
                AUX_HIDDEN: ["1", "T", 3 * cfg.target_hidden_size], DRAFT_HIDDEN: ["1", "T", cfg.hidden_size]},
        outputs={"logits": ["1", "R", cfg.draft_vocab_size], **{o: kv_shape for _, o in kv},
                 DRAFT_HIDDEN_OUT: ["1", "R", cfg.hidden_size]},
        kv_aliases={o: i for i, o in kv},
        quantization=graph.quantization,
    )


def export_head(head: Head, target: Source, dtype: str, *, work: Path, max_seq: int, max_draft: int,
                prefill_chunk: int, log: Callable[[str], None], device: str = "cpu") -> ModelSpec:
    """The head's graph, vocabulary map and manifest entry, written into `work`."""
    if dtype == "bf16":
        raise ExportError("--draft-dtype bf16 with an EAGLE-3 head: its graph runs on ONNX Runtime; use fp32, fp16, "
                          "int8 or int4")
    t0 = time.perf_counter()
    standard = device == "tensorrt"
    graph, reference = head_graph(head, target, dtype, "none" if standard else "min", standard)
    spec = head_entry(graph, reference, head, dtype, max_seq)
    quantized = graph.quantization is not None
    forms = export_onnx(graph, work / GRAPH_FILE, max_seq, TORCH_DTYPE[dtype], optimize=not quantized or standard,
                        facts=graph_facts(spec), standard_quant=quantized and standard)
    if forms is not None:
        graph.quantization = {**graph.quantization, "method": "weight-only, blocked DequantizeLinear + MatMul",
                              "dequantize_linear": forms}
        spec = spec.replace(quantization=graph.quantization)
    np.save(work / VOCAB_MAP, head.target_ids.numpy().astype(np.int64), allow_pickle=False)
    log(f"  draft: exported the EAGLE-3 head ({dtype}; target layers {list(head.layers)}, "
        f"{head.config.draft_vocab_size} draft tokens) in {time.perf_counter() - t0:.1f}s; checking parity")
    parity = check_head_parity(graph, reference, work / GRAPH_FILE, spec, max_seq, max_draft, prefill_chunk, dtype)
    log(head_parity_line(parity))
    return spec.replace(parity=parity)


def head_parity_line(parity: dict) -> str:
    """What export says of check_head_parity's record on the terminal."""
    against = parity["max_rel_diff_eager_vs_reference"]
    return (f"  draft: parity ok (max relative difference {parity['max_rel_diff_ort_vs_eager']:.1e}"
            + (f"; eager against the published forward {against:.1e})" if against is not None else ")"))


def head_schedule(max_seq: int, max_draft: int, prefill_chunk: int) -> list[tuple[int, int, bool]]:
    """(start, T, from the target) passes as a round makes them: a catch-up over target rows,
    draft steps over the head's own states, a catch-up that rewrites their slots, a step."""
    c = max(2, min(prefill_chunk, max_seq // 4))
    k = min(max_draft, 3)
    passes = [(0, c, True)] + [(c + i, 1, False) for i in range(k)] + [(c, k + 1, True), (c + k + 1, 1, False)]
    return [p for p in passes if p[0] + p[1] <= max_seq]


def check_head_parity(graph, reference, onnx_path: Path, spec: ModelSpec, max_seq: int, max_draft: int,
                      prefill_chunk: int, dtype: str, seed: int = 0) -> dict:
    """The same passes through ONNX Runtime, the eager graph module (logits and the state it
    returns), and for a float32 head the reference forward over K/V kept as tensors. Any graph
    of a head's contract (AUX_HIDDEN, DRAFT_HIDDEN in; DRAFT_HIDDEN_OUT out) with its reference
    (`forward(ids, hidden, position_ids, past) -> (out, logits, past)`): an EAGLE-3 head, an MTP
    layer (export/mtp.py)."""
    from specdeploy.runtime.backends.ort import OrtEngine

    engine = OrtEngine(onnx_path, spec, max_seq) if dtype in NUMPY_DTYPES else None
    rng = np.random.default_rng(seed)
    width, own_width = graph.feature_inputs[AUX_HIDDEN], graph.feature_inputs[DRAFT_HIDDEN]
    past = kv_buffers(graph, max_seq, TORCH_DTYPE[dtype])
    ref_past = None
    worst_ort = worst_ref = 0.0
    state = None  # the head's last state, [H]
    graph.inplace = True
    try:
        with torch.no_grad():
            for i, (start, t, from_target) in enumerate(head_schedule(max_seq, max_draft, prefill_chunk)):
                ids = rng.integers(0, spec.vocab_size, size=t)
                aux = rng.standard_normal((t, width)).astype(np.float32) if from_target else np.zeros((t, width), np.float32)
                own = np.zeros((t, own_width), np.float32) if from_target else np.repeat(state[None], t, 0)
                last = from_target and i == 0  # the first catch-up asks for its last row only, as the drafter does
                rows = torch.tensor([t - 1]) if last else torch.arange(t)
                logits, _, _, out = graph(
                    torch.from_numpy(ids)[None], torch.arange(start, start + t)[None], torch.tensor([start]),
                    torch.from_numpy(attention_mask(start, t)), past, rows, torch.from_numpy(aux)[None],
                    torch.from_numpy(own)[None])
                logits, out = logits[0].numpy(), out[0].numpy()
                if engine is not None:
                    got = engine.forward(ids, start, last=last, features={AUX_HIDDEN: aux, DRAFT_HIDDEN: own})
                    worst_ort = max(worst_ort, _rel_diff(got.copy(), logits),
                                    _rel_diff(engine.outputs[DRAFT_HIDDEN_OUT].copy(), out))
                if dtype == "fp32":
                    if ref_past is not None:  # rolled back to `start`, as the buffers are by their length
                        ref_past = (ref_past[0][:, :, :start], ref_past[1][:, :, :start])
                    hidden = torch.from_numpy(aux if from_target else own)[None]
                    ref_out, ref_logits, ref_past = reference(torch.from_numpy(ids)[None], hidden,
                                                              torch.arange(start, start + t)[None], ref_past)
                    worst_ref = max(worst_ref, _rel_diff(logits, ref_logits[0, rows].numpy()),
                                    _rel_diff(out, ref_out[0, rows].numpy()))
                state = out[-1]
    finally:
        graph.inplace = False
    bound = PARITY_RTOL[dtype]
    check_draft_parity(onnx_path.name, "the head's graph module", worst_ort, worst_ref, bound)
    return {"passes": [list(p[:2]) for p in head_schedule(max_seq, max_draft, prefill_chunk)],
            "max_rel_diff_ort_vs_eager": worst_ort if engine is not None else None,
            "max_rel_diff_eager_vs_reference": worst_ref if dtype == "fp32" else None, "bound": bound}


def rebuild_head(spec: ModelSpec, target: ModelSpec) -> Eagle3Graph:
    """The head's graph module as export made it (what the torch backend runs): from the head
    folder and the target source the manifest names, each checked against its sha256."""
    from specdeploy.core.errors import BundleError

    from .eagle3 import load_head
    from .load import check_recorded_source, load_source

    for entry, what in ((spec, "EAGLE-3 head"), (target, "target")):
        check_recorded_source(entry.source, entry.source_sha256, what)
    try:
        source = load_source(target.source)
        head = load_head(Path(spec.source), source.config)
    except ExportError as e:
        raise BundleError(f"the torch backend rebuilds the EAGLE-3 head: {e}") from None
    standard = "dequantize_linear" in (spec.quantization or {})  # exported --for tensorrt (export_head)
    graph, reference = head_graph(head, source, spec.dtype, "none" if standard else "min", standard)
    if sum(p.numel() for p in reference.parameters()) != spec.parameters:
        raise BundleError(f"{spec.source}: the head's parameter count differs from the manifest's; re-export the bundle")
    return graph


__all__ = ["GRAPH_FILE", "VOCAB_MAP", "check_head_parity", "export_head", "head_graph", "head_parity_line", "rebuild_head"]
