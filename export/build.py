"""Build a bundle: load -> graph -> ONNX -> parity -> tokenizer -> manifest (checksums last).

The bundle is written into a temporary folder beside `out` and moved into place only
when complete, so a failed export never leaves a half-written bundle or loses an old one.
"""
from __future__ import annotations

import copy
import shutil
import tempfile
from contextlib import contextmanager
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specdeploy.runtime.bundle import FORMAT, FORMAT_VERSION, MANIFEST, ModelSpec, sha256_file
from specdeploy.runtime.errors import ExportError

from .graph import SpecGraph, restrict_head
from .load import Source, eos_token_ids, load_source, same_tokenizer
from .onnx_export import DTYPES, KV_DTYPES, check_parity, export_onnx, io_names
from .quantize import SCHEMES, quantize_model

VERSION = "0.1.0"


@contextmanager
def atomic_folder(out: Path):
    """A temporary folder beside `out` to write into: it replaces `out` when the block ends
    and is removed if anything fails, so `out` is never half written and an old one is kept
    until the new one is whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield work
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


@dataclass(frozen=True)
class DraftSpec:
    kind: str  # "model", "self", "ngram" or "none"
    path: Path | None = None
    layers: int | None = None


def parse_draft(text: str | None) -> DraftSpec:
    """`PATH`, `self:layers=N`, `ngram` or `none`.

    >>> parse_draft("self:layers=4")
    DraftSpec(kind='self', path=None, layers=4)
    """
    if text is None or text == "none":
        return DraftSpec("none")
    if text == "ngram":
        return DraftSpec("ngram")
    if text.startswith("self:"):
        m = re.fullmatch(r"self:layers=(\d+)", text)
        if not m or int(m.group(1)) < 1:
            raise ExportError(f"--draft {text!r}: expected self:layers=N with N >= 1")
        return DraftSpec("self", layers=int(m.group(1)))
    return DraftSpec("model", path=Path(text))


def model_entry(graph: SpecGraph, source: Source, graph_file: str, dtype: str, max_seq: int) -> dict:
    cfg = source.config
    window = getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None
    inputs, outputs = io_names(graph.num_layers)
    kv_shape = [1, graph.num_kv_heads, max_seq, graph.head_dim]
    entry = {
        "graph": graph_file,
        "source": str(source.path),
        "architecture": cfg.model_type,
        "num_layers": graph.num_layers,
        "source_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_heads": graph.num_heads,
        "num_kv_heads": graph.num_kv_heads,
        "head_dim": graph.head_dim,
        "vocab_size": cfg.vocab_size,
        "dtype": dtype,
        "kv_dtype": KV_DTYPES[dtype],
        "sliding_window": window if window and window < max_seq else None,
        "parameters": sum(p.numel() for p in graph.parameters()),
        "inputs": {
            "input_ids": ["1", "T"],
            "position_ids": ["1", "T"],
            "write_indices": ["1"],
            "attention_mask": ["1", "1", "T", "L"],
            **{name: kv_shape for name in inputs[4:]},
        },
        "outputs": {"logits": ["1", "T", cfg.vocab_size], **{name: kv_shape for name in outputs[1:]}},
        "kv_aliases": {o: i for i, o in zip(inputs[4:], outputs[1:])},
    }
    if graph.head_vocab is not None:
        entry["head_vocab"] = int(graph.head_vocab.shape[0])  # logits of other tokens are -inf
    return entry


def _export_model(
    graph: SpecGraph, source: Source, work: Path, role: str, dtype: str, max_seq: int, max_draft: int,
    prefill_chunk: int, full_model: bool, log: Callable[[str], None],
) -> dict:
    graph_file = f"{role}.onnx"
    t0 = time.perf_counter()
    if graph.quantization is not None:  # the CPU graphs: ONNX Runtime's fused RoPE too
        graph.use_contrib_ops(max_seq)
    export_onnx(graph, work / graph_file, max_seq, DTYPES[dtype], optimize=graph.quantization is None)
    entry = model_entry(graph, source, graph_file, dtype, max_seq)
    if graph.quantization is not None:
        entry["quantization"] = graph.quantization
    log(f"  {role}: exported {graph.num_layers} layers ({dtype}) in {time.perf_counter() - t0:.1f}s; checking parity")
    spec = ModelSpec.from_manifest(role, entry)
    # A quantized graph is compared with its own eager module (dequantized weights, int8
    # activation blocks as MatMulNBits computes them), not with the float source: it is
    # another model. GGUF blocks imported exactly were checked tensor by tensor on import.
    entry["parity"] = check_parity(
        graph, work / graph_file, spec, max_seq, max_draft, prefill_chunk, dtype,
        hf_model=source.model if full_model and graph.quantization is None else None,
    )
    log(f"  {role}: parity ok (max relative logit difference {entry['parity']['max_rel_diff_ort_vs_eager']:.1e})")
    return entry


def _graph(source: Source, dtype: str, num_layers: int | None = None) -> SpecGraph:
    """The graph of `source` at `dtype`; int8/int4 quantize a copy (the source stays float,
    so a target and its draft may differ in dtype)."""
    record = None
    vocab = source.head_vocab
    model = copy.deepcopy(source.model) if dtype in SCHEMES or vocab else source.model
    if vocab:
        restrict_head(model, vocab)
    if dtype in SCHEMES:
        gguf = source.path if source.path.suffix == ".gguf" else None
        record = quantize_model(model, dtype, gguf, num_layers)
    else:
        model = model.to(DTYPES[dtype])
    graph = SpecGraph(model, num_layers, head_vocab=vocab).eval()
    graph.inv_freq = graph.inv_freq.float()  # RoPE angles stay in fp32 whatever the weights
    graph.quantization = record
    return graph


def tokenizer_entry(source: Source, work: Path) -> dict:
    tok = source.tokenizer
    tok.backend_tokenizer.save(str(work / "tokenizer.json"))
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return {
        "file": "tokenizer.json",
        "eos_token_ids": eos_token_ids(source),
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "chat_template": template,
    }


def build_bundle(
    target: str | Path,
    draft: str | None,
    out: str | Path,
    max_seq: int = 1024,
    max_draft: int = 8,
    dtype: str = "fp32",
    prefill_chunk: int = 64,
    log: Callable[[str], None] = lambda _: None,
    draft_dtype: str | None = None,
) -> dict:
    """Export a target (and its draft) into the bundle folder `out`; returns the manifest.
    `dtype` is the target's, `draft_dtype` the draft model's (default: the target's)."""
    out = Path(out)
    spec = parse_draft(draft)
    draft_dtype = dtype if draft_dtype is None else draft_dtype
    for flag, value in (("--dtype", dtype), ("--draft-dtype", draft_dtype)):
        if value not in DTYPES:
            raise ExportError(f"{flag} {value!r}: expected one of {', '.join(DTYPES)}")
    if not 2 <= max_seq <= 1 << 17:
        raise ExportError(f"--max-seq {max_seq}: expected 2..131072")
    if not 1 <= max_draft <= 32 or max_draft >= max_seq:
        raise ExportError(f"--max-draft {max_draft}: expected 1..32 and below --max-seq")
    if out.exists() and not (out / MANIFEST).is_file() and any(out.iterdir()):
        raise ExportError(f"{out}: exists and is not a bundle; refusing to overwrite it")
    torch.manual_seed(0)
    started = time.perf_counter()
    log(f"loading target {target}")
    target_source = load_source(target)
    cfg = target_source.config
    if spec.kind == "self" and spec.layers >= cfg.num_hidden_layers:
        raise ExportError(
            f"--draft self:layers={spec.layers}: the target has {cfg.num_hidden_layers} layers; "
            f"choose 1..{cfg.num_hidden_layers - 1}"
        )
    draft_source = None
    if spec.kind == "model":
        log(f"loading draft {spec.path}")
        draft_source = load_source(spec.path)
        diff = same_tokenizer(target_source.tokenizer, draft_source.tokenizer)
        if diff:
            raise ExportError(f"draft {spec.path} and target {target} have different tokenizers: {diff}")
        if draft_source.config.vocab_size != cfg.vocab_size:
            raise ExportError(
                f"draft {spec.path} has {draft_source.config.vocab_size} logits, target {target} has {cfg.vocab_size}"
            )
    with atomic_folder(out) as work:
        common = dict(max_seq=max_seq, max_draft=max_draft, prefill_chunk=prefill_chunk, log=log)
        graph = _graph(target_source, dtype)
        models = {"target": _export_model(graph, target_source, work, "target", dtype=dtype, full_model=True, **common)}
        if spec.kind == "self":
            graph = _graph(target_source, draft_dtype, spec.layers)
            models["draft"] = _export_model(graph, target_source, work, "draft", dtype=draft_dtype, full_model=False, **common)
        elif spec.kind == "model":
            graph = _graph(draft_source, draft_dtype)
            models["draft"] = _export_model(graph, draft_source, work, "draft", dtype=draft_dtype, full_model=True, **common)
        draft_entry = {"kind": spec.kind}
        if spec.kind == "self":
            draft_entry["layers"] = spec.layers
        elif spec.kind == "model":
            draft_entry["source"] = str(spec.path)
            if draft_source.distilled:  # how `specdeploy distill` made it (its vocabulary is in the graph)
                draft_entry["distilled"] = {k: v for k, v in draft_source.distilled.items() if k != "vocab"}
        elif spec.kind == "ngram":
            # Matches of a single token propose too often and too wrongly: measured on SmolLM2
            # (20 varied prompts), n-grams 4..2 accept 26-27% of drafts against 18% for 3..1.
            draft_entry.update(max_ngram=4, min_ngram=2)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created_by": f"specdeploy {VERSION}",
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "max_seq": max_seq,
            "max_draft": max_draft,
            "prefill_chunk": prefill_chunk,
            "draft": draft_entry,
            "models": models,
            "tokenizer": tokenizer_entry(target_source, work),
            "export_seconds": round(time.perf_counter() - started, 1),
        }
        manifest["files"] = {p.name: sha256_file(p) for p in sorted(work.iterdir()) if p.is_file()}
        (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"bundle written to {out} in {time.perf_counter() - started:.0f}s")
    return manifest
