"""Build a bundle: load -> graph -> ONNX -> parity -> tokenizer -> manifest (checksums last).

The bundle is written into a temporary folder beside `out` and moved into place only
when complete, so a failed export never leaves a half-written bundle or loses an old one.
Export writes only where it loses nothing: a folder that is missing, empty, or a bundle it
recognises by its manifest's format field, never the folder it runs in or one above it.
"""
from __future__ import annotations

import copy
import glob
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from specdeploy.core.errors import BundleError, ExportError
from specdeploy.core.graph_io import AUX_HIDDEN, LOGITS_ROWS, graph_facts, io_names, kv_names, state_names
from specdeploy.core.choices import DEVICE_DTYPE, DEVICES, DTYPES, KV_CHOICES, KV_DTYPE, QUANT_SCHEMES
from specdeploy.core.manifest import ATTENTIONS, FORMAT, MANIFEST, MOST, Manifest, ModelSpec, TokenizerEntry, checksums, file_sizes, not_exact_line, write_manifest

from .architectures import architecture, check_export
from .experts import densify_experts
from .graph_cache import GraphCache, cache_key
from .drafts import parse_draft
from .graph import SpecGraph, restrict_head
from .load import Source, eos_token_ids, load_source, source_digest
from .onnx_export import PARITY_TEXT, TORCH_DTYPE, check_parity, export_onnx
from .quantize import SCHEMES, quantize_model

VERSION = "0.1.0"
PREFILL_CHUNK = 64  # prompt tokens per prefill pass unless told (at most max_seq)
# --max-seq's default: the model's own context (config max_position_embeddings), at most this
# many tokens: what summaries of long documents need, at a K/V cost export states (SmolLM2
# int4: 360 MiB per sequence in float32, 180 MiB in float16). A model that names no context: 2048.
DEFAULT_MAX_SEQ = 8192
UNNAMED_CONTEXT = 2048
# --kv-dtype's default for an int8/int4 target on the CPU with exact attention: float16, as
# llama.cpp keeps its K/V: half the memory (180 MiB a sequence for SmolLM2 at 8192), a decode
# step no slower (0.91-0.94x of float32's at 3-6k tokens in bare steps, 0.94-1.01x in paired
# decode loops), KL against fp32 0.0143 beside float32 K/V's 0.0138 (results/long_prompts).
# Elsewhere the dtype's own (KV_DTYPE).
CPU_INT_KV = "fp16"
# A draft graph that runs on ONNX Runtime only (int8/int4) takes the fused attention unless
# told otherwise, and the source's own blocks: re-quantizing a GGUF's blocks drops the
# draft's agreement with the target from 94% to 72% (docs/quantization.md, "Exact and fast schemes").
DRAFT_DEFAULTS = {"attention": "fused", "quant_scheme": "exact"}


WORK_PREFIX = ".{name}.export-{pid}-"  # a work folder's name: the pid of the export writing it, beside `out`


def check_out(out: Path, ours: Callable[[Path], bool] | None = None, what: str = "a specdeploy bundle") -> None:
    """Refuse, in one line and before any work, an `--out` whose replacement would lose
    something: a file, a folder under a file, the folder the export runs in (or one above it),
    or a folder that holds anything but `what` (recognised by `ours`, default: is_bundle)."""
    ours = ours or is_bundle
    where = out.resolve()
    if where == Path.cwd().resolve() or where in Path.cwd().resolve().parents:
        raise ExportError(f"--out {out}: the folder this export runs in (or one above it); choose another folder")
    for folder in (where, *where.parents):
        if folder.exists() and not folder.is_dir():
            what = "is a file" if folder == where else f"lies under the file {folder}"
            raise ExportError(f"--out {out}: {what}; choose a folder")
    if where.is_dir() and any(where.iterdir()) and not ours(where):
        raise ExportError(f"--out {out}: exists, is not empty and is not {what}; refusing to replace it "
                          "(choose a new or empty folder)")


def is_bundle(folder: Path) -> bool:
    """Whether `folder` holds a specdeploy bundle: its manifest.json is ours by its format
    field (a manifest.json of anything else, a browser extension's say, is not)."""
    manifest = folder / MANIFEST
    if manifest.is_symlink() or not manifest.is_file() or manifest.stat().st_size > 1 << 22:
        return False
    try:
        data = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


@contextmanager
def atomic_folder(out: Path, log: Callable[[str], None] = lambda m: None):
    """A temporary folder beside `out` to write into: it replaces `out` when the block ends
    and is removed if anything fails, SIGTERM included, so `out` is never half written and an
    old one is kept until the new one is whole. Work folders that an export killed outright
    (SIGKILL) left behind are removed by the next export to the same place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(out, log)
    work = Path(tempfile.mkdtemp(prefix=WORK_PREFIX.format(name=out.name, pid=os.getpid()), dir=out.parent))
    try:
        with _terminate_as_exception():
            yield work
            if out.exists():  # the old bundle moves aside first: a failure here loses neither
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
                out.rename(old / "bundle")
                work.rename(out)
                shutil.rmtree(old, ignore_errors=True)
            else:
                work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


class Terminated(ExportError):
    pass


@contextmanager
def _terminate_as_exception():
    """SIGTERM as an exception while the export runs (main thread only: where Python lets a
    handler be set), so the work folder is cleaned up like any failure."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated("export stopped by SIGTERM; nothing was written")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _remove_abandoned(out: Path, log: Callable[[str], None]) -> None:
    prefix = WORK_PREFIX.format(name=out.name, pid="")[:-1]  # up to the pid
    for folder in out.parent.glob(f"{glob.escape(prefix)}*"):
        pid, _, rest = folder.name[len(prefix):].partition("-")
        if not (folder.is_dir() and pid.isdigit() and len(rest) == 8):  # mkdtemp's 8 characters
            continue  # not a work folder of ours: never touched
        pid = int(pid)
        if pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        log(f"removed {folder}: the work folder of an export that was killed")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def model_window(cfg, max_seq: int) -> int | None:
    """The sliding attention window of every layer of a model (the runtime's mask carries it),
    None when it has none shorter than the buffer. Windows on some layers only (Gemma) the
    graph applies itself (export/architectures.py)."""
    window = architecture(cfg).runtime_window(cfg)
    return window if window and window < max_seq else None


def check_layer_windows(cfg, max_seq: int, max_draft: int, what: str) -> None:
    """A window the graph applies itself must exceed the longest draft: a tree's rows find
    their ancestors by slot (export/graph.py, SpecGraph._window_mask)."""
    for window in architecture(cfg).layer_windows(cfg):
        if window is not None and window <= max_draft:
            raise ExportError(f"{what}: config sliding_window {window}: at most --max-draft {max_draft}; "
                              "choose a smaller --max-draft")


def feature_shapes(graph) -> tuple[dict, dict]:
    """The manifest's shapes of a graph's hidden-state inputs and outputs (core/graph_io.py
    FEATURE_INPUTS, FEATURE_OUTPUTS): a target's come for every row (T), a head's for the rows
    whose logits it returns (R)."""
    b = "B"
    outputs = {name: [b, "T" if name == AUX_HIDDEN else "R", width] for name, width in graph.feature_outputs.items()}
    return {name: [b, "T", width] for name, width in graph.feature_inputs.items()}, outputs


def model_entry(graph: SpecGraph, source: Source, role: str, graph_file: str, dtype: str, max_seq: int,
                kv_dtype: str | None = None) -> ModelSpec:
    """The manifest entry of a graph whose batch dimension B is dynamic (the bundle's max_batch
    bounds it). `kv_dtype` (a numpy name): its KV buffers' (default: the dtype's, KV_DTYPE)."""
    cfg = source.config
    inputs, outputs = io_names(len(graph.kv_layout))
    feature_in, feature_out = feature_shapes(graph)
    kv_inputs = [name for name, _ in kv_names(len(graph.kv_layout))]
    kv_shapes = [["B", heads, max_seq, dim] for heads, dim in graph.kv_layout for _ in range(2)]
    # a linear-attention layer's states: in before the pass [B, ...], out after each returned row [B, R, ...]
    state_shapes = [list(shape) for pair in graph.state_layout for shape in pair]
    names = state_names(len(graph.state_layout))
    state_in = {i: ["B", *shape] for (i, _), shape in zip(names, state_shapes)}
    state_out = {o: ["B", "R", *shape] for (_, o), shape in zip(names, state_shapes)}
    uniform = len(graph.kv_layout) == graph.num_layers and len(set(graph.kv_layout)) == 1
    return ModelSpec(
        role=role,
        graph=graph_file,
        source=str(Path(source.path).resolve()),
        source_sha256=source.sha256,
        architecture=cfg.model_type,
        num_layers=graph.num_layers,
        source_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_heads=graph.num_heads,
        num_kv_heads=graph.kv_layout[0][0],
        head_dim=graph.kv_layout[0][1],
        kv_layout=None if uniform else tuple(graph.kv_layout),
        vocab_size=cfg.vocab_size,
        dtype=dtype,
        kv_dtype=kv_dtype or KV_DTYPE[dtype],
        sliding_window=model_window(cfg, max_seq),
        parameters=graph_parameters(graph, bool(getattr(cfg, "tie_word_embeddings", False))),
        inputs={
            "input_ids": ["B", "T"],
            "position_ids": ["B", "T"],
            "write_indices": ["B"],
            "attention_mask": ["B", "1", "T", "L"],
            **dict(zip(kv_inputs, kv_shapes)),
            LOGITS_ROWS: ["R"],
            **feature_in,
            **state_in,
        },
        outputs={"logits": ["B", "R", cfg.vocab_size], **dict(zip(outputs[1:], kv_shapes)), **state_out, **feature_out},
        kv_aliases={o: i for i, o in zip(kv_inputs, outputs[1:])},
        # a restricted head: logits of other tokens are -inf
        head_vocab=int(graph.head_vocab.shape[0]) if graph.head_vocab is not None else None,
        quantization=graph.quantization,
    )


def _export_model(
    graph: SpecGraph, source: Source, *, work: Path, role: str, dtype: str, attention: str, max_seq: int,
    max_draft: int, prefill_chunk: int, full_model: bool, log: Callable[[str], None], device: str = "cpu",
    max_batch: int = 1, kv_dtype: str | None = None, windowed: bool = False,
) -> ModelSpec:
    """`windowed`: attention reads the K/V as bound (onnx_export.read_bound_kv), for ONNX Runtime's CPU provider."""
    graph_file = f"{role}.onnx"
    if graph.state_layout and device != "cpu":
        raise ExportError(f"--for {device}: {graph.arch.family}'s linear-attention layers keep recurrent states, which "
                          "only ONNX Runtime's CPU provider keeps yet; use --for cpu")
    t0 = time.perf_counter()
    fused = attention == "fused"
    quantized = graph.quantization is not None
    standard = device == "tensorrt"  # standard ONNX ops only (TensorRT's parser reads no contrib op)
    if (quantized and graph.arch.contrib_ops and not standard) or fused:  # ONNX Runtime's fused contrib ops
        graph.use_contrib_ops(max_seq, fused=fused)
    spec = model_entry(graph, source, role, graph_file, dtype, max_seq, kv_dtype).replace(attention=attention)
    # constant folding: TensorRT's parser wants constant axes and shapes (skipped for ONNX Runtime's
    # quantized graphs, on which it takes minutes and which ONNX Runtime folds at load)
    fold = not (graph.contrib_ops or (quantized and not standard))
    forms = export_onnx(graph, work / graph_file, max_seq, getattr(torch, spec.kv_dtype), optimize=fold,
                        facts=graph_facts(spec), standard_quant=quantized and standard, max_batch=max(max_batch, 2),
                        windowed=windowed and not fused)
    if forms is not None:
        graph.quantization = {**graph.quantization, "method": "weight-only, blocked DequantizeLinear + MatMul",
                              "dequantize_linear": forms}
        spec = spec.replace(quantization=graph.quantization)
    kv = "" if spec.kv_dtype == KV_DTYPE[dtype] else f", {spec.kv_dtype} KV"
    log(f"  {role}: exported {graph.num_layers} layers ({dtype}, {attention} attention{kv}) in "
        f"{time.perf_counter() - t0:.1f}s; checking parity")
    for line in quantization_lines(graph.quantization):
        log(f"  {role}: {line}")
    # A quantized graph is compared with its own eager module (dequantized weights, int8
    # activation blocks as MatMulNBits computes them), not with the float source: it is
    # another model. GGUF blocks imported exactly were checked tensor by tensor on import.
    parity = check_parity(
        graph, work / graph_file, spec, max_seq, max_draft, prefill_chunk, dtype,
        hf_model=source.model if full_model and not quantized else None,
        text_ids=source.tokenizer.encode(PARITY_TEXT) if quantized else None,
    )
    ort_diff, source_diff = parity["max_rel_diff_ort_vs_eager"], parity["max_rel_diff_eager_vs_source"]
    if ort_diff is not None:
        log(f"  {role}: parity ok (max relative logit difference {ort_diff:.1e})")
    else:  # bf16: no ONNX Runtime CPU kernels to run the graph here
        against = "" if source_diff is None else f"; eager against the source {source_diff:.1e}"
        log(f"  {role}: parity: the graph was not run (ONNX Runtime's CPU provider has no bfloat16 kernels){against}")
    return spec.replace(parity=parity)


def quantization_lines(record: dict | None) -> list[str]:
    """What a quantized export says on the terminal: where its blocks came from, and each GGUF
    tensor that could not be imported as it is (quantized here from the file's floats), and why."""
    lines: list[str] = []
    if not record:
        return lines
    if record.get("source") is not None:
        tensors = ", ".join(f"{n} {k}" for k, n in record["tensors"].items())
        lines.append(f"weights from {Path(record['source']).name}: {tensors} "
                     f"({record['imported_exactly']} imported exactly, {record['quantized_from_float']} quantized here)")
    if "dequantize_linear" in record:
        forms = record["dequantize_linear"]
        lines.append(f"DequantizeLinear + MatMul: {forms['int4']} int4 weights, {forms['int8']} int8 (8-bit blocks, and 4-bit "
                     "blocks that are not symmetric, kept exact in 8 bits: TensorRT's weight-only int4 is symmetric)")
    lines += [not_exact_line(entry) for entry in record.get("not_exact", [])]
    return lines


def graph_parameters(graph: torch.nn.Module, tied: bool = False) -> int:
    """The weights a graph computes with: its float parameters and, for a quantized graph, the
    values its blocks stand for. `tied` (the source's head is its embedding): that table counted
    once, as the source counts it, where the graph keeps it in two forms (a float embedding
    beside a quantized head, or two block forms)."""
    from .experts import DenseExperts
    from .quantize import QuantEmbedding, QuantLinear

    def stored(m):  # (the tensor holding a table's values, how many values it stands for)
        if isinstance(m, QuantLinear):
            return m.packed, m.in_features * m.out_features
        if isinstance(m, QuantEmbedding):
            return m.packed, m.num_embeddings * m.embedding_dim
        return m.weight, m.weight.numel()

    count, seen = sum(p.numel() for p in graph.parameters()), set()
    for module in graph.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)) and id(module.packed) not in seen:
            seen.add(id(module.packed))
            count += stored(module)[1]
            bias = getattr(module, "bias", None)  # a quantized projection's bias is a buffer
            if isinstance(bias, torch.Tensor) and not isinstance(bias, torch.nn.Parameter):
                count += bias.numel()
        if isinstance(module, DenseExperts) and module.down_bias is not None:  # a buffer: weights @ biases
            count += module.down_bias.numel()
    embed, head = getattr(graph, "embed_tokens", None), getattr(graph, "lm_head", None)
    if tied and embed is not None and head is not None:
        (a, size), (b, head_size) = stored(embed), stored(head)
        if a is not b and size == head_size:
            count -= size
    return count


def source_graph(source: Source, dtype: str, num_layers: int | None = None, quant_scheme: str = "exact",
                 zero: str | None = None, aux_layers: tuple[int, ...] | None = None) -> SpecGraph:
    """The graph of `source` at `dtype`; int8/int4 quantize a copy as `quant_scheme` says
    (the source stays float, so a target and its draft may differ in dtype and scheme);
    `zero` overrides the scheme's 4-bit form of weights quantized here ("none": symmetric,
    what TensorRT's weight-only int4 takes); `aux_layers`: the graph also returns the states
    entering these layers (a target with an EAGLE-3 head)."""
    record = None
    vocab = source.head_vocab
    experts = architecture(source.config).dense_experts(source.config)
    model = copy.deepcopy(source.model) if dtype in SCHEMES or vocab or experts else source.model
    if experts:
        densify_experts(model)
    if vocab:
        restrict_head(model, vocab)
    if dtype in SCHEMES:
        gguf = source.path if source.path.suffix == ".gguf" else None
        record = quantize_model(model, dtype, gguf, num_layers, quant_scheme, **({"zero": zero} if zero else {}))
    else:
        model = model.to(TORCH_DTYPE[dtype])
    graph = SpecGraph(model, num_layers, head_vocab=vocab, aux_layers=aux_layers).eval()
    for name in set(graph.rope_of_layer):  # RoPE angles stay in fp32 whatever the weights
        setattr(graph, name, getattr(graph, name).float())
    graph.quantization = record
    return graph


def rebuild_graph(spec: ModelSpec, aux_layers: tuple[int, ...] | None = None) -> SpecGraph:
    """The module a bundle's graph was exported from, rebuilt from the source model its
    manifest entry names (what the torch backend runs); a source that changed since export
    (another parameter count) is an error. `aux_layers`: the target of an EAGLE-3 bundle."""
    if spec.source is None or not Path(spec.source).exists():
        raise BundleError(
            f"the torch backend rebuilds the {spec.role} from its source model: {spec.source}: "
            "no such model folder or .gguf file"
        )
    if spec.source_sha256 is not None and source_digest(Path(spec.source)) != spec.source_sha256:
        raise BundleError(
            f"{spec.source}: the {spec.role}'s source model changed after export (its sha256 differs from the "
            "manifest's); re-export the bundle"
        )
    try:
        source = load_source(spec.source)
    except ExportError as e:
        raise BundleError(f"the torch backend rebuilds the {spec.role} from its source model: {e}") from None
    record = spec.quantization or {}
    graph = source_graph(source, spec.dtype, spec.num_layers, record.get("quant_scheme", "exact"), record.get("zero"),
                         aux_layers)
    count = graph_parameters(graph, bool(getattr(source.config, "tie_word_embeddings", False)))
    floats = sum(p.numel() for p in graph.parameters())  # what bundles before graph_parameters recorded
    if spec.parameters not in (count, floats):
        raise BundleError(
            f"{spec.source}: has {count} parameters for the {spec.role}, the bundle's manifest says "
            f"{spec.parameters}; the source changed after export"
        )
    return graph


def tokenizer_entry(source: Source, work: Path) -> TokenizerEntry:
    tok = source.tokenizer
    tok.backend_tokenizer.save(str(work / "tokenizer.json"))
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return TokenizerEntry(
        file="tokenizer.json",
        eos_token_ids=eos_token_ids(source),
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        chat_template=template,
    )


def check_lengths(max_seq: int, max_draft: int, prefill_chunk: int | None) -> int:
    """--max-seq, --max-draft and --prefill-chunk against each other; the prefill chunk (its
    default: PREFILL_CHUNK, at most max_seq)."""
    if not 2 <= max_seq <= 1 << 17:
        raise ExportError(f"--max-seq {max_seq}: expected 2..131072")
    if not 1 <= max_draft <= 32 or max_draft >= max_seq:
        raise ExportError(f"--max-draft {max_draft}: expected 1..32 and below --max-seq ({max_seq})")
    if prefill_chunk is None:
        prefill_chunk = min(PREFILL_CHUNK, max_seq)
    if not 1 <= prefill_chunk <= max_seq:
        raise ExportError(f"--prefill-chunk {prefill_chunk}: expected 1..{max_seq} (--max-seq)")
    return prefill_chunk


def default_max_seq(cfg, log: Callable[[str], None]) -> int:
    """--max-seq unless told: the model's context, at most DEFAULT_MAX_SEQ (said on the terminal)."""
    context = getattr(cfg, "max_position_embeddings", None)
    if not isinstance(context, int) or context < 2:
        log(f"--max-seq {UNNAMED_CONTEXT}: the model's config names no context (max_position_embeddings)")
        return UNNAMED_CONTEXT
    if context > DEFAULT_MAX_SEQ:
        log(f"--max-seq {DEFAULT_MAX_SEQ}: the model reads up to {context} tokens; a longer --max-seq holds more K/V")
        return DEFAULT_MAX_SEQ
    log(f"--max-seq {context}: the model's context")
    return context


def check_kv_dtype(kv_dtype: str, dtype: str, attention: str, device: str) -> None:
    """--kv-dtype: float16 KV buffers for a target whose activations are float32; the dtype's
    own KV otherwise (KV_DTYPE). One-line refusals name the flag and the reason."""
    if kv_dtype not in KV_CHOICES:
        raise ExportError(f"--kv-dtype {kv_dtype!r}: expected one of {', '.join(KV_CHOICES)}")
    if KV_CHOICES[kv_dtype] == KV_DTYPE[dtype]:
        return
    if KV_DTYPE[dtype] != "float32":
        raise ExportError(f"--kv-dtype {kv_dtype} with --dtype {dtype}: a {dtype} graph keeps {KV_DTYPE[dtype]} KV "
                          "buffers; --kv-dtype fp16 is for fp32, int8 and int4 targets")
    if attention == "fused":
        raise ExportError(f"--kv-dtype {kv_dtype} with --attention fused: GroupQueryAttention takes KV buffers of its "
                          "activations' type (float32); use --attention exact")
    if device == "tensorrt":
        raise ExportError(f"--kv-dtype {kv_dtype} with --for tensorrt: float16 KV beside float32 activations has not "
                          "run on TensorRT; leave --kv-dtype at its default there")


def build_bundle(
    target: str | Path,
    draft: str | None,
    out: str | Path,
    max_seq: int | None = None,
    max_draft: int = 8,
    dtype: str = "fp32",
    prefill_chunk: int | None = None,
    log: Callable[[str], None] = lambda _: None,
    draft_dtype: str | None = None,
    attention: str = "exact",
    quant_scheme: str = "exact",
    draft_attention: str | None = None,
    draft_quant_scheme: str | None = None,
    device: str = "cpu",
    max_batch: int = 8,
    kv_dtype: str | None = None,
    cache: str | Path | None = None,
) -> Manifest:
    """Export a target (and its draft) into the bundle folder `out`; returns the manifest.
    `dtype`, `attention` and `quant_scheme` are the target's; the draft model's default to
    DRAFT_DEFAULTS where its graph runs on ONNX Runtime only (int8/int4), else the target's.
    A draft owes no exactness (a wrong proposal is only rejected): its graph may be the fastest.
    `device` (core DEVICES) is where the bundle will run: `dtype` None takes its default
    (DEVICE_DTYPE; fp32 for a family whose activations overflow fp16), and for "tensorrt" every
    graph keeps to standard ONNX (int8/int4 as DequantizeLinear + MatMul) and is checked
    against TensorRT's parser before the bundle is written. `kv_dtype` (KV_CHOICES) is the
    target's KV buffers: fp16 halves what a long context reads and holds for a target whose
    activations are float32 (check_kv_dtype); None: CPU_INT_KV for an int8/int4 target --for
    cpu with exact attention, else the dtype's own. `cache`: a folder where each exported graph is
    kept, and from which a graph with the same source and choices is reused (export/graph_cache.py)."""
    out = Path(out)
    if device not in DEVICES:
        raise ExportError(f"--for {device!r}: expected one of {', '.join(DEVICES)}")
    recipe = parse_draft(draft)
    if device == "tensorrt":
        for flag, value in (("--attention", attention), ("--draft-attention", draft_attention),
                            ("--quant-scheme", quant_scheme), ("--draft-quant-scheme", draft_quant_scheme)):
            if value in ("fused", "fast"):
                raise ExportError(f"--for tensorrt: {flag} {value} uses ONNX Runtime's contrib ops, which TensorRT's "
                                  "parser does not read; leave it at its default")
        for flag, value in (("--dtype", dtype), ("--draft-dtype", draft_dtype)):
            if value == "bf16":
                raise ExportError(f"--for tensorrt: {flag} bf16: the trt backend stages its buffers in numpy, which has "
                                  "no bfloat16; use fp16, or --for cuda (the torch backend runs bf16)")
    for flag, value, allowed in (
        ("--dtype", dtype or "fp32", DTYPES), ("--draft-dtype", draft_dtype or "fp32", DTYPES),
        ("--attention", attention, ATTENTIONS), ("--draft-attention", draft_attention or "exact", ATTENTIONS),
        ("--quant-scheme", quant_scheme, QUANT_SCHEMES), ("--draft-quant-scheme", draft_quant_scheme or "exact", QUANT_SCHEMES),
    ):
        if value not in allowed:
            raise ExportError(f"{flag} {value!r}: expected one of {', '.join(allowed)}")
    if kv_dtype is not None and dtype is not None:  # else once --for has chosen the dtype
        check_kv_dtype(kv_dtype, dtype, attention, device)
    if attention == "fused" and dtype in SCHEMES and recipe.kind != "none":
        raise ExportError(
            f"--attention fused with an {dtype} target: its verify rows differ from single steps by more than "
            "near-ties (its int8 activation rounding amplifies the fused attention's rounding), so speculation "
            "would change the output; use --attention exact, or --draft none (plain decoding)"
        )
    if not 1 <= max_batch <= MOST["max_batch"]:
        raise ExportError(f"--max-batch {max_batch}: expected 1..{MOST['max_batch']}")
    if max_seq is not None:  # checked before the model loads; the default once it has
        prefill_chunk = check_lengths(max_seq, max_draft, prefill_chunk)
    check_out(out)
    torch.manual_seed(0)
    started = time.perf_counter()
    log(f"loading target {target}")
    target_source = load_source(target)
    if max_seq is None:
        max_seq = default_max_seq(target_source.config, log)
        prefill_chunk = check_lengths(max_seq, max_draft, prefill_chunk)
    if dtype is None:
        dtype = DEVICE_DTYPE[device]
        if dtype == "fp16" and not architecture(target_source.config).fp16:
            dtype = "fp32"
        log(f"--for {device}: --dtype {dtype}")
        if kv_dtype is not None:
            check_kv_dtype(kv_dtype, dtype, attention, device)
    if recipe.kind == "assistant":
        from .assistant import check_choices

        draft_dtype = draft_dtype or "fp32"  # the assistant's graph is fp32 (export/assistant.py), whatever the target's
        check_choices(draft_dtype, device)  # before the target is exported
    draft_dtype = dtype if draft_dtype is None else draft_dtype
    if kv_dtype is None and device == "cpu" and dtype in SCHEMES and attention == "exact":
        kv_dtype = CPU_INT_KV
    recipe.prepare(target_source, log)
    graphs = GraphCache(cache, log) if cache is not None else None
    with atomic_folder(out, log) as work:
        common = dict(work=work, max_seq=max_seq, max_draft=max_draft, prefill_chunk=prefill_chunk, log=log)
        batched = dict(max_batch=max_batch)

        def export_model(source: Source, model_dtype: str, role: str = "draft", num_layers: int | None = None,
                         full_model: bool = True, head=None, assistant=None, mtp=None) -> ModelSpec:
            if head is not None:  # an EAGLE-3 head: its own graph over the target's states
                from .eagle3_export import export_head

                return export_head(head, target_source, model_dtype, device=device, **common)
            if mtp is not None:  # the target checkpoint's MTP layer: its graph over the target's final state
                from .mtp import export_mtp

                return export_mtp(mtp, target_source, model_dtype, device=device, **common)
            if assistant is not None:  # a Gemma 4 assistant: its graph over the target's K/V and state
                from .assistant import export_assistant

                return export_assistant(assistant, target_source, models["target"], model_dtype, device=device,
                                        **common)
            if role == "target":
                model_attention, scheme = attention, quant_scheme
            else:
                cpu_only = model_dtype in SCHEMES and device != "tensorrt"
                model_attention = draft_attention or (DRAFT_DEFAULTS["attention"] if cpu_only else attention)
                scheme = draft_quant_scheme or (DRAFT_DEFAULTS["quant_scheme"] if cpu_only else quant_scheme)
            window = model_window(source.config, max_seq)
            if model_attention == "fused" and window is not None:
                if (draft_attention if role == "draft" else attention) == "fused":
                    raise ExportError(f"--{'draft-' if role == 'draft' else ''}attention fused: {source.path} attends "
                                      f"through a sliding window of {window}, which the fused graph does not take; use exact")
                model_attention = "exact"
            told = (draft_attention if role == "draft" else attention) == "fused"
            if model_attention == "fused" and not told and not architecture(source.config).fused(source.config):
                model_attention = "exact"  # a draft's default, where the family has no fused graph
            check_export(source.config, model_dtype, model_attention, str(source.path))
            check_layer_windows(source.config, max_seq, max_draft, str(source.path))
            aux = getattr(recipe, "aux_layers", None) if role == "target" else None
            model_kv = KV_CHOICES[kv_dtype] if kv_dtype and role == "target" else None
            # K/V read as bound at the window: an int graph for the CPU (ONNX Runtime's alone: a float
            # graph may become TensorRT plans, whose KV write wants a static sequence dimension), but
            # for a target whose K/V a Gemma 4 assistant reads (its graph takes them [1, Hkv, max_seq, D])
            windowed = device == "cpu" and model_attention == "exact" and model_dtype in SCHEMES and not (
                role == "target" and recipe.kind == "assistant")
            key = None
            if graphs is not None:
                key = cache_key(source.sha256, role=role, dtype=model_dtype, num_layers=num_layers,
                                attention=model_attention, quant_scheme=scheme, device=device, aux_layers=aux,
                                kv_dtype=model_kv, full_model=full_model, max_seq=max_seq, max_draft=max_draft,
                                prefill_chunk=prefill_chunk, max_batch=max_batch, windowed=windowed)
                spec = graphs.get(key, work, source.path)
                if spec is not None:
                    return spec
            graph = source_graph(source, model_dtype, num_layers, scheme, "none" if device == "tensorrt" else None, aux)
            spec = _export_model(graph, source, role=role, dtype=model_dtype, attention=model_attention,
                                 full_model=full_model, device=device, **common, **batched, kv_dtype=model_kv,
                                 windowed=windowed)
            if graphs is not None:
                graphs.put(key, work, spec)
            return spec

        models = {"target": export_model(target_source, dtype, role="target")}
        draft_model = recipe.export(target_source, draft_dtype, export_model)
        if draft_model is not None:
            models["draft"] = draft_model
        manifest = Manifest(
            created_by=f"specdeploy {VERSION}",
            created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            max_seq=max_seq,
            max_draft=max_draft,
            prefill_chunk=prefill_chunk,
            max_batch=max_batch,
            draft=recipe.entry(),
            models=models,
            tokenizer=tokenizer_entry(target_source, work),
            export_seconds=round(time.perf_counter() - started, 1),
            device=device,
        )
        names = [p.name for p in work.iterdir() if p.is_file()]
        manifest = manifest.replace(files=checksums(work, names), sizes=file_sizes(work, names))
        write_manifest(work, manifest)
        if device == "tensorrt":  # the promise --for tensorrt makes: TensorRT's parser takes every node
            from .trt_ops import check_bundle

            problems = check_bundle(work)
            if problems:
                raise ExportError(f"--for tensorrt: {len(problems)} node(s) TensorRT's parser refuses, the first: "
                                  f"{problems[0]}")
            log("  check-trt: TensorRT's parser takes every node of every graph")
    log(f"  {manifest.kv_cost()}")
    log(f"bundle written to {out} in {time.perf_counter() - started:.0f}s")
    return manifest
