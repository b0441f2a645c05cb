"""The bundle contract (docs/design.md, "The bundle contract") as typed records: export writes them, the
runtime reads them back, and neither side spells a manifest key anywhere else.

A bundle is a folder with `manifest.json`, one ONNX graph per model (and TensorRT plans
where built) and the tokenizer. The manifest records everything the runtime needs, so no
build flag is ever repeated at run time. Reading checks the format version, the type of
every field the runtime uses and (by default) the sha256 of every listed file.

    >>> d = DraftEntry(kind="self", layers=4)
    >>> d.as_dict(), DraftEntry.from_dict(d.as_dict(), "draft") == d
    ({'kind': 'self', 'layers': 4}, True)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .choices import DEVICES
from .errors import BundleError

FORMAT = "specdeploy-bundle"
FORMAT_VERSION = 2  # 2: graphs take logits_rows (core/graph_io.py)
READS_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
DRAFT_KINDS = ("model", "self", "eagle3", "mtp", "assistant", "ngram", "suffix", "none")  # the one list: export's recipes, the runtime's drafters


def one_class_per_draft_kind(classes, what: str) -> dict[str, type]:
    """{kind: class} in DRAFT_KINDS order, for classes that each declare their `kind`: export's
    recipes and the runtime's drafters both register against DRAFT_KINDS, so a kind one side
    lacks, or a class of an unknown or repeated kind, fails at import, naming it.

    >>> list(one_class_per_draft_kind([type(k, (), {"kind": k}) for k in reversed(DRAFT_KINDS)], "t"))
    ['model', 'self', 'eagle3', 'mtp', 'assistant', 'ngram', 'suffix', 'none']
    """
    by_kind: dict[str, type] = {}
    for cls in classes:
        if cls.kind not in DRAFT_KINDS or cls.kind in by_kind:
            raise TypeError(f"{what}: {cls.__name__} has kind {cls.kind!r}, "
                            f"{'registered twice' if cls.kind in by_kind else 'not one of ' + ', '.join(DRAFT_KINDS)}")
        by_kind[cls.kind] = cls
    missing = [kind for kind in DRAFT_KINDS if kind not in by_kind]
    if missing:
        raise TypeError(f"{what}: no class for draft kind {', '.join(map(repr, missing))}")
    return {kind: by_kind[kind] for kind in DRAFT_KINDS}


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _take(d: dict, key: str, kind, where: str, optional: bool = False):
    """d[key], checked to be of `kind` (bool is never an int here); one-line error naming it."""
    if key not in d:
        if optional:
            return None
        raise BundleError(f"{where}: missing field {key!r}")
    value = d[key]
    if value is None and optional:
        return None
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise BundleError(f"{where}: field {key!r} must be {name}, got {value!r:.60}")
    return value


def _positive(value: int, key: str, where: str, most: int | None = None) -> int:
    if value < 1 or (most is not None and value > most):
        allowed = f"[1, {most}]" if most is not None else "at least 1"
        raise BundleError(f"{where}: field {key!r} is {value}, outside {allowed}")
    return value


def _max_batch(d: dict, where: str) -> int:
    value = _take(d, "max_batch", int, where, optional=True)
    return 1 if value is None else _positive(value, "max_batch", where, MOST["max_batch"])


# Plausibility bounds: far beyond any model this exports, near enough to stop a tampered
# manifest from asking for absurd loops or allocations before the memory budget is checked.
MOST = {"num_layers": 1024, "num_kv_heads": 1024, "head_dim": 4096, "vocab_size": 1 << 22,
        "max_seq": 1 << 20, "max_draft": 32, "ngram": 64, "eos_token_ids": 64, "max_batch": 64}
MANIFEST_BYTES = 16 << 20  # a manifest is a few kB; past this it is not one
KV_DTYPES = ("float32", "float16", "bfloat16")
ATTENTIONS = ("exact", "fused")  # see ModelSpec.attention


def mib(n_bytes: int) -> str:
    """A byte count as the CLI and `inspect` print it."""
    return f"{n_bytes / 2**20:.1f} MiB"


# A graph past protobuf's 2 GiB keeps its weights in a file beside it, named for it: <graph>.data
# (ONNX's external data, one file a graph), listed and checksummed as every other file.
EXTERNAL_DATA = ".data"


def graph_files(folder: Path, graph: str) -> list[str]:
    """A graph's files in `folder`: the graph, and its weights file where it keeps one."""
    return [graph] + ([graph + EXTERNAL_DATA] if (Path(folder) / (graph + EXTERNAL_DATA)).is_file() else [])


def graph_bytes(folder: Path, graph: str) -> int:
    """A graph's bytes on disk: its file and its weights file where it keeps one (EXTERNAL_DATA)."""
    return sum((Path(folder) / name).stat().st_size for name in graph_files(folder, graph)
               if (Path(folder) / name).is_file())


def bundle_file_name(name: Any, where: str) -> str:
    """A file of the bundle is a plain name inside its folder: no folders, no '..', not absolute."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise BundleError(f"{where}: {name!r} is not a plain file name inside the bundle folder")
    return name


def _kv_layout(value: list | None, num_layers: int, where: str) -> tuple[tuple[int, int], ...] | None:
    """A manifest's kv_layout: at most one [num_kv_heads, head_dim] of positive integers per layer."""
    if value is None:
        return None
    if not 1 <= len(value) <= num_layers:
        raise BundleError(f"{where}: field 'kv_layout' has {len(value)} entries; expected 1..{num_layers} (num_layers)")
    out = []
    for i, entry in enumerate(value):
        if not (isinstance(entry, list) and len(entry) == 2 and all(type(x) is int for x in entry)):
            raise BundleError(f"{where}: field 'kv_layout'[{i}] is {entry!r:.60}; expected [num_kv_heads, head_dim]")
        out.append((_positive(entry[0], "num_kv_heads", where, MOST["num_kv_heads"]),
                    _positive(entry[1], "head_dim", where, MOST["head_dim"])))
    return tuple(out)


def _reads_kv(value: list | None, where: str) -> tuple[int, ...] | None:
    """A manifest's reads_kv: 1..2 distinct indices of the target's KV pairs."""
    if value is None:
        return None
    if not (1 <= len(value) <= 2 and all(type(j) is int and 0 <= j < MOST["num_layers"] for j in value)
            and len(set(value)) == len(value)):
        raise BundleError(f"{where}: field 'reads_kv' is {value!r:.60}; expected 1 or 2 distinct KV pair indices")
    return tuple(value)


@dataclass(frozen=True)
class ModelSpec:
    """One graph of the bundle (`models[role]`): the numbers needed to drive it, and the
    record of how it was built."""

    role: str  # "target" or "draft" (the key in `models`; not repeated in the entry)
    graph: str  # file name inside the bundle
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: str  # numpy dtype name of the KV buffers
    sliding_window: int | None = None
    dtype: str = "fp32"
    source: str | None = None  # the source model, resolved at export (the torch backend rebuilds it)
    source_sha256: str | None = None  # of the source's files, checked before a rebuild
    architecture: str = ""
    source_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    parameters: int = 0
    head_vocab: int | None = None  # a restricted head: logits of other tokens are -inf
    # an EAGLE-3 head: its logits cover this many draft ids (the draft entry's vocab_map maps them to target ids)
    draft_vocab: int | None = None
    inputs: dict = field(default_factory=dict)  # graph input name -> shape (symbols T, L)
    outputs: dict = field(default_factory=dict)
    kv_aliases: dict = field(default_factory=dict)  # present output -> the past input it writes in place
    quantization: dict | None = None
    parity: dict | None = None
    trt: dict | None = None  # the TensorRT plan built from this graph (`specdeploy build`)
    # "exact": verify rows equal single steps bit for bit; "fused": ONNX Runtime's fused
    # attention (GroupQueryAttention), rows equal up to rounding (docs/backends.md, "Exact and fused graphs")
    attention: str = "exact"
    # [num_kv_heads, head_dim] of each layer that keeps K/V, in order (its key and value buffers);
    # None: every layer, each num_kv_heads x head_dim. Models whose layers differ (Gemma 4: wider
    # heads on full-attention layers; layers that reuse an earlier layer's K/V keep none) state it.
    kv_layout: tuple[tuple[int, int], ...] | None = None
    # a graph that keeps no K/V and reads the target's (a Gemma 4 assistant): the target's KV
    # pairs it reads, by index into the target's buffers; None: a graph with buffers of its own
    reads_kv: tuple[int, ...] | None = None

    @property
    def kv_shapes(self) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each KV buffer, in kv_names' order (key, value per layer)."""
        if self.reads_kv is not None:
            return []
        layers = self.kv_layout or ((self.num_kv_heads, self.head_dim),) * self.num_layers
        return [tuple(shape) for shape in layers for _ in ("key", "value")]

    @property
    def num_kv_layers(self) -> int:
        """How many layers keep K/V (the graph's past/present pairs)."""
        if self.reads_kv is not None:
            return 0
        return len(self.kv_layout) if self.kv_layout else self.num_layers

    def kv_shape(self, i: int, batch: int, max_seq: int) -> tuple[int, int, int, int]:
        """The shape of KV buffer i: [batch, num_kv_heads, max_seq, head_dim]."""
        heads, dim = self.kv_shapes[i]
        return batch, heads, max_seq, dim

    @property
    def logits_rows(self) -> bool:
        """Whether the graph takes the rows whose logits it returns (format version 2 on)."""
        from .graph_io import LOGITS_ROWS

        return LOGITS_ROWS in self.inputs

    @property
    def state_names(self) -> list[tuple[str, str]]:
        """(input, output) names of the recurrent states of its linear-attention layers (none for
        a model whose every layer keeps K/V), as core/graph_io.py state_names gives them."""
        from .graph_io import state_names

        return state_names(sum(1 for name in self.inputs if name.startswith("recurrent_state_")))

    def state_shape(self, name: str, batch: int = 1) -> tuple[int, ...]:
        """The shape of state input `name` for `batch` sequences."""
        return (batch, *(int(d) for d in self.inputs[name][1:]))

    @property
    def kv_names(self) -> list[tuple[str, str]]:
        """(input, output) names of the KV buffers, in layer order: key then value."""
        from .graph_io import kv_names

        return kv_names(self.num_kv_layers)

    @classmethod
    def from_dict(cls, role: str, d: Any) -> "ModelSpec":
        where = f"manifest models.{role}"
        if not isinstance(d, dict):
            raise BundleError(f"{where}: expected an object, got {d!r:.60}")
        ints = {k: _positive(_take(d, k, int, where), k, where, MOST[k])
                for k in ("num_layers", "num_kv_heads", "head_dim", "vocab_size")}
        kv_dtype = _take(d, "kv_dtype", str, where)
        if kv_dtype not in KV_DTYPES:
            raise BundleError(f"{where}: field 'kv_dtype' is {kv_dtype!r}, not one of {', '.join(KV_DTYPES)}")
        attention = _take(d, "attention", str, where, optional=True) or "exact"
        if attention not in ATTENTIONS:
            raise BundleError(f"{where}: field 'attention' is {attention!r}, not one of {', '.join(ATTENTIONS)}")
        trt = _take(d, "trt", dict, where, optional=True)
        if trt is not None:
            bundle_file_name(trt.get("plan"), f"{where}.trt.plan")
        return cls(
            role=role,
            graph=bundle_file_name(_take(d, "graph", str, where), f"{where}.graph"),
            kv_dtype=kv_dtype,
            sliding_window=_take(d, "sliding_window", int, where, optional=True),
            source_sha256=_take(d, "source_sha256", str, where, optional=True),
            dtype=_take(d, "dtype", str, where, optional=True) or "fp32",
            source=_take(d, "source", str, where, optional=True),
            architecture=_take(d, "architecture", str, where, optional=True) or "",
            source_layers=_take(d, "source_layers", int, where, optional=True),
            hidden_size=_take(d, "hidden_size", int, where, optional=True),
            num_heads=_take(d, "num_heads", int, where, optional=True),
            parameters=_take(d, "parameters", int, where, optional=True) or 0,
            head_vocab=_take(d, "head_vocab", int, where, optional=True),
            draft_vocab=_take(d, "draft_vocab", int, where, optional=True),
            inputs=_take(d, "inputs", dict, where, optional=True) or {},
            outputs=_take(d, "outputs", dict, where, optional=True) or {},
            kv_aliases=_take(d, "kv_aliases", dict, where, optional=True) or {},
            quantization=_take(d, "quantization", dict, where, optional=True),
            parity=_take(d, "parity", dict, where, optional=True),
            trt=trt,
            attention=attention,
            kv_layout=_kv_layout(_take(d, "kv_layout", list, where, optional=True), ints["num_layers"], where),
            reads_kv=_reads_kv(_take(d, "reads_kv", list, where, optional=True), where),
            **ints,
        )

    def as_dict(self) -> dict:
        d = {
            "graph": self.graph, "source": self.source, "source_sha256": self.source_sha256,
            "architecture": self.architecture,
            "num_layers": self.num_layers, "source_layers": self.source_layers, "hidden_size": self.hidden_size,
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "dtype": self.dtype, "kv_dtype": self.kv_dtype,
            "sliding_window": self.sliding_window, "parameters": self.parameters, "inputs": self.inputs,
            "outputs": self.outputs, "kv_aliases": self.kv_aliases, "attention": self.attention,
        }
        for key in ("head_vocab", "draft_vocab", "quantization", "parity", "trt"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.kv_layout is not None:
            d["kv_layout"] = [list(shape) for shape in self.kv_layout]
        if self.reads_kv is not None:
            d["reads_kv"] = list(self.reads_kv)
        return d

    @property
    def logits_width(self) -> int:
        """The logits' last dimension: the draft vocabulary of an EAGLE-3 head, else the vocabulary."""
        return self.draft_vocab or self.vocab_size

    @property
    def feature_inputs(self) -> dict[str, int]:
        """The hidden states the graph takes beyond the contract's tensors: name -> width."""
        from .graph_io import FEATURE_INPUTS

        return {name: int(self.inputs[name][-1]) for name in FEATURE_INPUTS if name in self.inputs}

    @property
    def feature_outputs(self) -> dict[str, int]:
        """The hidden states the graph returns beyond logits and K/V: name -> width."""
        from .graph_io import FEATURE_OUTPUTS

        return {name: int(self.outputs[name][-1]) for name in FEATURE_OUTPUTS if name in self.outputs}

    def kv_bytes(self, max_seq: int) -> int:
        """What the KV buffers of this graph take: 2 per layer that keeps K/V, [1, Hkv, max_seq, D]."""
        itemsize = 4 if self.kv_dtype == "float32" else 2
        return sum(heads * max_seq * dim * itemsize for heads, dim in self.kv_shapes)

    @property
    def state_bytes(self) -> int:
        """What the recurrent states of its linear-attention layers take at one position (float32)."""
        return sum(4 * math.prod(self.state_shape(name)[1:]) for name, _ in self.state_names)

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


def kept_positions(max_draft: int) -> int:
    """How many recent positions' recurrent states a sequence keeps (runtime/backends/recurrent.py):
    a round's verify pass returns max_draft + 1, and a draft model resumes at most that far back."""
    return max_draft + 2


@dataclass(frozen=True)
class DraftEntry:
    """How the bundle drafts: `kind` and that kind's settings."""

    kind: str  # one of DRAFT_KINDS
    layers: int | None = None  # self: the target's first N layers (None: all of them)
    dtype: str | None = None  # self: the draft's weights when not the target's (a quantized self-draft)
    source: str | None = None  # model: the draft as given at export
    distilled: dict | None = None  # model, eagle3: how `specdeploy distill` made it
    aux_layers: list[int] | None = None  # eagle3: the target layers whose input states the head reads
    vocab_map: str | None = None  # eagle3: the .npy file (int64 [draft vocab]) of each draft id's target id
    max_ngram: int | None = None  # ngram, suffix: the longest and shortest n-grams looked up
    min_ngram: int | None = None

    @classmethod
    def from_dict(cls, d: Any, where: str = "manifest draft") -> "DraftEntry":
        if not isinstance(d, dict):
            raise BundleError(f"{where}: expected an object, got {d!r:.60}")
        kind = _take(d, "kind", str, where)
        if kind not in DRAFT_KINDS:
            raise BundleError(f"{where}: kind {kind!r} is not one of {', '.join(DRAFT_KINDS)}")
        entry = cls(
            kind=kind,
            layers=_take(d, "layers", int, where, optional=True),
            dtype=_take(d, "dtype", str, where, optional=True),
            source=_take(d, "source", str, where, optional=True),
            distilled=_take(d, "distilled", dict, where, optional=True),
            max_ngram=_take(d, "max_ngram", int, where, optional=True),
            min_ngram=_take(d, "min_ngram", int, where, optional=True),
            aux_layers=_take(d, "aux_layers", list, where, optional=True),
            vocab_map=_take(d, "vocab_map", str, where, optional=True),
        )
        if entry.vocab_map is not None:
            bundle_file_name(entry.vocab_map, f"{where}.vocab_map")
        if entry.aux_layers is not None and not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MOST["num_layers"] for i in entry.aux_layers):
            raise BundleError(f"{where}: field 'aux_layers' must be layer indices, got {entry.aux_layers!r:.60}")
        if kind == "eagle3" and (entry.vocab_map is None or not entry.aux_layers):
            raise BundleError(f"{where}: an eagle3 draft needs 'aux_layers' and 'vocab_map'")
        if kind == "mtp" and not entry.aux_layers:
            raise BundleError(f"{where}: an mtp draft needs 'aux_layers' (the target's final state)")
        if kind == "assistant" and not entry.aux_layers:
            raise BundleError(f"{where}: an assistant draft needs 'aux_layers' (the target's final state)")
        if entry.layers is not None:
            _positive(entry.layers, "layers", where, MOST["num_layers"])
        for key in ("max_ngram", "min_ngram"):
            if getattr(entry, key) is not None:
                _positive(getattr(entry, key), key, where, MOST["ngram"])
        if entry.min_ngram is not None and entry.max_ngram is not None and entry.min_ngram > entry.max_ngram:
            raise BundleError(f"{where}: min_ngram {entry.min_ngram} is above max_ngram {entry.max_ngram}")
        return entry

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class TokenizerEntry:
    file: str
    eos_token_ids: list[int]
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None

    @classmethod
    def from_dict(cls, d: Any, where: str = "manifest tokenizer") -> "TokenizerEntry":
        if not isinstance(d, dict):
            raise BundleError(f"{where}: expected an object, got {d!r:.60}")
        eos = _take(d, "eos_token_ids", list, where)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
            raise BundleError(f"{where}: field 'eos_token_ids' must be a list of token ids, got {eos!r:.60}")
        if len(eos) > MOST["eos_token_ids"]:
            raise BundleError(f"{where}: field 'eos_token_ids' holds {len(eos)} ids, at most {MOST['eos_token_ids']}")
        return cls(
            file=bundle_file_name(_take(d, "file", str, where), f"{where}.file"),
            eos_token_ids=list(eos),
            bos_token=_take(d, "bos_token", str, where, optional=True),
            eos_token=_take(d, "eos_token", str, where, optional=True),
            chat_template=_take(d, "chat_template", str, where, optional=True),
        )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Manifest:
    max_seq: int
    max_draft: int
    prefill_chunk: int
    draft: DraftEntry
    models: dict[str, ModelSpec]  # "target", and "draft" for a model draft
    tokenizer: TokenizerEntry
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256
    sizes: dict[str, int] = field(default_factory=dict)  # file name -> bytes (bundles before it: empty)
    created_by: str = ""
    created_at: str = ""
    export_seconds: float | None = None
    device: str | None = None  # what export made it for (core DEVICES; bundles before it: None)
    format_version: int = FORMAT_VERSION  # what the file says (a version 1 bundle stays one when rewritten)
    # sequences a pass may carry (the graphs' batch dimension B); bundles before it: 1, graphs of B = 1
    max_batch: int = 1

    @classmethod
    def from_dict(cls, d: Any, where: str = MANIFEST) -> "Manifest":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise BundleError(f"{where}: not a specdeploy manifest (no \"format\": \"{FORMAT}\")")
        version = d.get("format_version")
        if version not in READS_VERSIONS:
            raise BundleError(
                f"{where}: format version {version!r} is not supported "
                f"(this specdeploy reads versions {', '.join(map(str, READS_VERSIONS))}); re-export the bundle"
            )
        models = _take(d, "models", dict, f"{where}")
        if "target" not in models:
            raise BundleError(f"{where}: models has no 'target' entry")
        files = _take(d, "files", dict, where)
        for name, sha in files.items():
            bundle_file_name(name, f"{where}: files")
            if not (isinstance(sha, str) and len(sha) == 64):
                raise BundleError(f"{where}: files[{name!r}] must be a sha256 hex digest")
        sizes = _take(d, "sizes", dict, where, optional=True) or {}
        for name, size in sizes.items():
            if not (isinstance(size, int) and not isinstance(size, bool) and 0 <= size < 1 << 50):
                raise BundleError(f"{where}: sizes[{name!r}] must be a file's size in bytes")
        sizes = {name: size for name, size in sizes.items() if name in files}  # a size says nothing of an unlisted file
        seconds = _take(d, "export_seconds", (int, float), where, optional=True)
        max_seq = _positive(_take(d, "max_seq", int, where), "max_seq", where, MOST["max_seq"])
        manifest = cls(
            max_seq=max_seq,
            max_draft=_positive(_take(d, "max_draft", int, where), "max_draft", where, min(MOST["max_draft"], max_seq - 1)),
            prefill_chunk=_positive(_take(d, "prefill_chunk", int, where), "prefill_chunk", where, max_seq),
            draft=DraftEntry.from_dict(d.get("draft")),
            models={role: ModelSpec.from_dict(role, entry) for role, entry in models.items()},
            tokenizer=TokenizerEntry.from_dict(d.get("tokenizer")),
            files=dict(files),
            sizes=dict(sizes),
            created_by=_take(d, "created_by", str, where, optional=True) or "",
            created_at=_take(d, "created_at", str, where, optional=True) or "",
            export_seconds=seconds,
            device=_device(d, where),
            format_version=version,
            max_batch=_max_batch(d, where),
        )
        manifest.check_consistent(where)
        # Every file the runtime opens is one whose checksum the manifest records.
        opened = [manifest.tokenizer.file] + [m.graph for m in manifest.models.values()]
        opened += [m.trt["plan"] for m in manifest.models.values() if m.trt]
        opened += [manifest.draft.vocab_map] if manifest.draft.vocab_map else []
        for name in opened:
            if name not in manifest.files:
                raise BundleError(f"{where}: {name} is used but not listed in 'files' (no checksum): re-export the bundle")
        return manifest

    def check_consistent(self, where: str) -> None:
        """Fields that contradict each other are a one-line error, never a guess."""
        target = self.models["target"]
        graph_draft = self.draft.kind in ("model", "self", "eagle3", "mtp", "assistant")  # the kinds whose drafter runs a graph of the bundle
        if graph_draft != ("draft" in self.models):
            has = "has" if "draft" in self.models else "has no"
            raise BundleError(f"{where}: draft kind {self.draft.kind!r} but models {has} 'draft' entry")
        if set(self.models) - {"target", "draft"}:
            raise BundleError(f"{where}: models has roles {sorted(self.models)}; expected 'target' and 'draft' only")
        for spec in self.models.values():  # (shapes the graph contradicts are named when it loads)
            if spec.sliding_window is not None and not 1 <= spec.sliding_window <= self.max_seq:
                raise BundleError(f"{where}: models.{spec.role} has sliding_window {spec.sliding_window}, outside "
                                  f"[1, {self.max_seq}] (max_seq)")
        if self.draft.kind == "self" and self.draft.layers is not None and self.draft.layers > target.num_layers:
            raise BundleError(f"{where}: draft layers {self.draft.layers} is above the target's {target.num_layers}")
        if self.draft.kind == "assistant":
            from .graph_io import ASSISTANT_HIDDEN, AUX_HIDDEN

            draft = self.models.get("draft")
            if draft is None or draft.reads_kv is None or AUX_HIDDEN not in target.feature_outputs \
                    or ASSISTANT_HIDDEN not in draft.inputs:
                raise BundleError(f"{where}: an assistant draft needs a target that returns {AUX_HIDDEN} and a draft "
                                  f"graph that takes {ASSISTANT_HIDDEN} and reads the target's K/V (re-export the bundle)")
            if any(j >= target.num_kv_layers for j in draft.reads_kv):
                raise BundleError(f"{where}: models.draft reads_kv {list(draft.reads_kv)} reach past the target's "
                                  f"{target.num_kv_layers} KV pairs")
            if target.feature_outputs[AUX_HIDDEN] != draft.inputs[ASSISTANT_HIDDEN][-1]:
                raise BundleError(f"{where}: the target returns {AUX_HIDDEN} {target.feature_outputs[AUX_HIDDEN]} wide, "
                                  f"the assistant takes {draft.inputs[ASSISTANT_HIDDEN][-1]}")
        if self.draft.kind == "mtp":
            from .graph_io import AUX_HIDDEN, DRAFT_HIDDEN_OUT

            layer = self.models["draft"]
            if AUX_HIDDEN not in target.feature_outputs or AUX_HIDDEN not in layer.feature_inputs \
                    or DRAFT_HIDDEN_OUT not in layer.feature_outputs:
                raise BundleError(f"{where}: an mtp draft needs a target that returns {AUX_HIDDEN} and a draft graph "
                                  f"that takes it and returns {DRAFT_HIDDEN_OUT} (re-export the bundle)")
            if target.feature_outputs[AUX_HIDDEN] != layer.feature_inputs[AUX_HIDDEN]:
                raise BundleError(f"{where}: the target returns {AUX_HIDDEN} {target.feature_outputs[AUX_HIDDEN]} wide, "
                                  f"the MTP layer takes {layer.feature_inputs[AUX_HIDDEN]}")
            if layer.vocab_size != target.vocab_size:
                raise BundleError(f"{where}: the MTP layer's vocabulary is {layer.vocab_size} tokens, the target's "
                                  f"{target.vocab_size}")
        if self.draft.kind == "eagle3":
            from .graph_io import AUX_HIDDEN

            head = self.models["draft"]
            if AUX_HIDDEN not in target.feature_outputs or AUX_HIDDEN not in head.feature_inputs or not head.draft_vocab:
                raise BundleError(f"{where}: an eagle3 draft needs a target that returns {AUX_HIDDEN} and a head that "
                                  "takes it (re-export the bundle)")
            if target.feature_outputs[AUX_HIDDEN] != head.feature_inputs[AUX_HIDDEN]:
                raise BundleError(f"{where}: the target returns {AUX_HIDDEN} {target.feature_outputs[AUX_HIDDEN]} wide, "
                                  f"the head takes {head.feature_inputs[AUX_HIDDEN]}")
            if self.draft.aux_layers and any(i >= target.num_layers for i in self.draft.aux_layers):
                raise BundleError(f"{where}: draft aux_layers {self.draft.aux_layers} reach past the target's "
                                  f"{target.num_layers} layers")
        bad = [i for i in self.tokenizer.eos_token_ids if i >= target.vocab_size]
        if bad:
            raise BundleError(f"{where}: tokenizer eos_token_ids {bad[0]} is outside the vocabulary [0, {target.vocab_size})")

    @property
    def recurrent(self) -> bool:
        """Whether a model of the bundle has linear-attention layers (recurrent states)."""
        return any(m.state_names for m in self.models.values())

    def kv_bytes(self) -> int:
        """What every model's KV buffers take together."""
        return sum(m.kv_bytes(self.max_seq) for m in self.models.values())

    def kv_cost(self) -> str:
        """What --max-seq costs in memory, in words: the K/V of one sequence (each model's) and
        of every batch slot a batched server holds."""
        keeping = {role: m for role, m in self.models.items() if m.num_kv_layers}  # an assistant reads the target's
        parts = " + ".join(f"{role} {mib(m.kv_bytes(self.max_seq))} {m.kv_dtype}" for role, m in keeping.items())
        line = f"K/V {mib(self.kv_bytes())} per sequence at max_seq {self.max_seq}"
        line += f" ({parts})" if len(keeping) > 1 else f" ({self.models['target'].kv_dtype})"
        states = sum(m.state_bytes for m in self.models.values())
        if states:
            keep = kept_positions(self.max_draft)
            line += f"; recurrent states {mib(states)} a position, {mib(self.state_bytes())} per sequence ({keep} positions kept)"
        if self.max_batch > 1:
            line += f"; {mib(self.sequence_bytes() * self.max_batch)} for {self.max_batch} batch slots (serve)"
        return line

    def state_bytes(self) -> int:
        """What every model's recurrent states take for one sequence (the positions a session keeps)."""
        return sum(m.state_bytes for m in self.models.values()) * kept_positions(self.max_draft)

    def sequence_bytes(self) -> int:
        """What one sequence holds: its K/V and its recurrent states (a batch slot's memory)."""
        return self.kv_bytes() + self.state_bytes()

    def as_dict(self) -> dict:
        d = {
            "format": FORMAT,
            "format_version": self.format_version,
            "created_by": self.created_by,
            "created_at": self.created_at,
            "max_seq": self.max_seq,
            "max_draft": self.max_draft,
            "prefill_chunk": self.prefill_chunk,
            **({"max_batch": self.max_batch} if self.max_batch > 1 else {}),
            "draft": self.draft.as_dict(),
            "models": {role: m.as_dict() for role, m in self.models.items()},
            "tokenizer": self.tokenizer.as_dict(),
        }
        if self.export_seconds is not None:
            d["export_seconds"] = self.export_seconds
        if self.device is not None:
            d["device"] = self.device
        d["files"] = dict(sorted(self.files.items()))
        if self.sizes:
            d["sizes"] = dict(sorted(self.sizes.items()))
        return d

    def replace(self, **changes) -> "Manifest":
        return dataclasses.replace(self, **changes)


def not_exact_line(entry: dict) -> str:
    """A quantization record's `not_exact` entry as export and inspect print it."""
    return (f"not imported exactly: {entry['tensor']} ({entry['why']}), quantized here from its floats as "
            f"{entry['as'].split('->')[1]}")


def _device(d: dict, where: str) -> str | None:
    device = _take(d, "device", str, where, optional=True)
    if device is not None and device not in DEVICES:
        raise BundleError(f"{where}: field 'device' is {device!r}, not one of {', '.join(DEVICES)}")
    return device


def checksums(folder: Path, names) -> dict[str, str]:
    """{name: sha256} of the named files of `folder`, sorted by name."""
    return {name: sha256_file(folder / name) for name in sorted(names)}


def file_sizes(folder: Path, names) -> dict[str, int]:
    """{name: bytes} of the named files of `folder`: checked before a file is hashed, so a
    swapped file (a sparse one of gigabytes, say) is refused without reading it."""
    return {name: (folder / name).stat().st_size for name in sorted(names)}


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Write `manifest.json` whole or not at all (a temporary file renamed over it)."""
    path = Path(folder) / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.tmp")
    tmp.write_text(json.dumps(manifest.as_dict(), indent=2) + "\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class Bundle:
    path: Path
    manifest: Manifest
    digest: str = ""  # "sha256:" + the manifest file's sha256: it lists every file's, so it pins the whole bundle

    @property
    def max_seq(self) -> int:
        return self.manifest.max_seq

    @property
    def max_batch(self) -> int:
        return self.manifest.max_batch

    @property
    def max_draft(self) -> int:
        return self.manifest.max_draft

    @property
    def prefill_chunk(self) -> int:
        return self.manifest.prefill_chunk

    @property
    def draft(self) -> DraftEntry:
        return self.manifest.draft

    @property
    def draft_kind(self) -> str:
        return self.manifest.draft.kind

    @property
    def tokenizer(self) -> TokenizerEntry:
        return self.manifest.tokenizer

    def model(self, role: str) -> ModelSpec | None:
        return self.manifest.models.get(role)

    def file(self, name: str) -> Path:
        """A file of the bundle; one that lies outside the folder (a symlink out) is an error."""
        path = self.path / bundle_file_name(name, str(self.path))
        if path.is_symlink() and self.path.resolve() not in path.resolve().parents:
            raise BundleError(f"bundle file {path} links outside the bundle folder; re-export the bundle")
        return path

    def check_memory(self, budget: int | None = None, sequences: int = 1) -> None:
        """The KV buffers a session allocates (`sequences` slots of them: a batch's) fit `budget`
        bytes (default: half this machine's memory), checked before anything is allocated."""
        budget = memory_budget() if budget is None else budget
        need = self.manifest.sequence_bytes() * sequences
        if need > budget:
            many = f" for {sequences} sequences" if sequences > 1 else ""
            raise BundleError(
                f"{self.path}: the KV buffers{many} need {need / 2**30:.1f} GiB (max_seq {self.max_seq}), more than the "
                f"memory budget of {budget / 2**30:.1f} GiB (half of this machine's memory); re-export with a smaller "
                f"--max-seq{' or batch fewer' if sequences > 1 else ''}"
            )


def memory_budget() -> int:
    """Half of this machine's physical memory, in bytes."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def read_manifest(path: str | Path) -> Manifest:
    """The manifest of the bundle folder `path`, checked field by field (no file checksums)."""
    return _read_manifest(path)[0]


def _read_manifest(path: str | Path) -> tuple[Manifest, str]:
    """The manifest and the bundle's digest (the sha256 of the manifest's bytes)."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise BundleError(f"{path}: no such bundle folder")
    if manifest_path.is_symlink():
        raise BundleError(f"{manifest_path}: is a symbolic link; a bundle's manifest must be a file of its own")
    if not manifest_path.is_file():
        raise BundleError(f"{manifest_path}: missing; {path} is not a specdeploy bundle (run `specdeploy export`)")
    if manifest_path.stat().st_size > MANIFEST_BYTES:
        raise BundleError(f"{manifest_path}: {manifest_path.stat().st_size} bytes, more than a manifest's {MANIFEST_BYTES}")
    data = manifest_path.read_bytes()
    try:
        raw = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and integers past Python's digit limit
        raise BundleError(f"{manifest_path}: not valid JSON ({str(e)[:120]})") from None
    except RecursionError:
        raise BundleError(f"{manifest_path}: not a manifest (JSON nested too deeply)") from None
    return Manifest.from_dict(raw, str(manifest_path)), "sha256:" + hashlib.sha256(data).hexdigest()


def load_bundle(path: str | Path, verify: bool = True, digest: str | None = None) -> Bundle:
    """Read and check a bundle: format version, fields, and (by default) the size and sha256
    of every file. `digest` (as `specdeploy inspect` prints it): the bundle must be that one,
    its manifest included (the checksums cover every other file)."""
    manifest, actual = _read_manifest(path)
    if digest is not None and digest != actual:
        raise BundleError(f"{path}: bundle digest {actual} is not the {str(digest)[:80]} required; "
                          "the bundle was changed or is another one")
    bundle = Bundle(Path(path), manifest, actual)
    if verify:
        for m in manifest.models.values():  # a graph's weights file is read by ONNX Runtime: checked as the graph is
            data = m.graph + EXTERNAL_DATA
            if data not in manifest.files and (bundle.path / data).exists():
                raise BundleError(f"{bundle.path / data}: a graph's weights file that 'files' does not list (no "
                                  "checksum): re-export the bundle")
        verify_files(bundle.path, manifest.files, sizes=manifest.sizes)
    return bundle


def verify_files(folder: Path, files: dict[str, str], rebuild_hint: str = "re-export the bundle",
                 sizes: dict[str, int] | None = None) -> None:
    """Every listed file is present, inside `folder`, with the size (where recorded) and the
    sha256 the manifest records; sizes first, so that no file of the wrong size is read."""
    inside = Path(folder).resolve()
    for name, expected in files.items():
        f = Path(folder) / bundle_file_name(name, str(folder))
        if f.is_symlink() and inside not in f.resolve().parents:
            raise BundleError(f"bundle file {f} links outside the bundle folder; {rebuild_hint}")
        if not f.is_file():
            raise BundleError(f"bundle file {f} is missing; {rebuild_hint}")
        size = (sizes or {}).get(name)
        if size is not None and f.stat().st_size != size:
            raise BundleError(f"bundle file {f} failed its checksum ({f.stat().st_size} bytes, the manifest says {size}; "
                              f"not read): it was altered after export; {rebuild_hint}")
    for name, expected in files.items():
        f = Path(folder) / name
        actual = sha256_file(f)
        if actual != expected:
            raise BundleError(
                f"bundle file {f} failed its checksum (sha256 {actual[:12]}..., manifest says {expected[:12]}...): "
                f"it was altered after export; {rebuild_hint}"
            )
