"""Draft recipes: how `--draft TEXT` becomes the draft part of a bundle, one class per kind.

A recipe parses its own spelling (`parse`), checks and loads what it needs against the
target (`prepare`), exports its graph if it has one (`export`) and says what the manifest
records (`entry`). `parse_draft` asks each registered recipe in turn; adding a draft kind
is adding it to core.manifest's DRAFT_KINDS, a class here and a line to `RECIPES` (and a
drafter on the runtime side).

    >>> parse_draft("self:layers=4")
    SelfDraft(layers=4, dtype=None)
    >>> parse_draft("self:dtype=int4")
    SelfDraft(layers=None, dtype='int4')
    >>> parse_draft("ngram")
    NgramDraft()
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from specdeploy.core.errors import ExportError
from specdeploy.core.choices import DTYPES
from specdeploy.core.manifest import DraftEntry, ModelSpec, one_class_per_draft_kind

from .load import Source, load_source, same_tokenizer

if TYPE_CHECKING:
    from .assistant import Assistant
    from .eagle3 import Head
    from .mtp import Mtp

# export one graph: (graph, source, role, dtype, full_model) -> its manifest entry (build.py)
ExportModel = Callable[..., ModelSpec]


class DraftRecipe(Protocol):
    kind: str

    @classmethod
    def parse(cls, text: str) -> "DraftRecipe | None":
        """The recipe `text` spells, None if it is not this kind's; a malformed spelling of
        this kind is an ExportError."""
        ...

    def prepare(self, target: Source, log: Callable[[str], None]) -> None:
        """Check the recipe against the target and load what it needs, before any writing."""
        ...

    def export(self, target: Source, dtype: str, export_model: ExportModel) -> ModelSpec | None:
        """Export the draft's graph (None: it has none)."""
        ...

    def entry(self) -> DraftEntry: ...


@dataclass
class NoDraft:
    kind = "none"

    @classmethod
    def parse(cls, text: str) -> "NoDraft | None":
        return cls() if text == "none" else None

    def prepare(self, target: Source, log: Callable[[str], None]) -> None:
        pass

    def export(self, target: Source, dtype: str, export_model: ExportModel) -> None:
        return None

    def entry(self) -> DraftEntry:
        return DraftEntry("none")


@dataclass
class NgramDraft(NoDraft):
    kind = "ngram"

    @classmethod
    def parse(cls, text: str) -> "NgramDraft | None":
        return cls() if text == "ngram" else None

    def entry(self) -> DraftEntry:
        # Matches of a single token propose too often and too wrongly: measured on SmolLM2
        # (20 varied prompts), n-grams 4..2 accept 26-27% of drafts against 18% for 3..1.
        return DraftEntry("ngram", max_ngram=4, min_ngram=2)


@dataclass
class SuffixDraft(NoDraft):
    """A suffix index over the request's own text and earlier requests' (runtime/drafters/
    suffix.py): it proposes token trees of the continuations that followed most often."""

    kind = "suffix"

    @classmethod
    def parse(cls, text: str) -> "SuffixDraft | None":
        return cls() if text == "suffix" else None

    def entry(self) -> DraftEntry:
        return DraftEntry("suffix", max_ngram=8, min_ngram=2)


@dataclass
class SelfDraft:
    """The target drafting for itself: its first N layers with its own norm and head
    (`self:layers=N`), at a lower precision (`self:dtype=int4`: the quantized self-draft,
    from a GGUF its own blocks exactly), or both (`self:layers=N,dtype=int8`)."""

    kind = "self"
    layers: int | None = None  # None: all of them
    dtype: str | None = None  # None: --draft-dtype (default: the target's)

    @classmethod
    def parse(cls, text: str) -> "SelfDraft | None":
        if not text.startswith("self:"):
            return None
        usage = f"--draft {text!r}: expected self:layers=N (N >= 1), self:dtype=D (D one of {', '.join(DTYPES)}) or both, comma separated"
        fields = {}
        for part in text[len("self:"):].split(","):
            key, _, value = part.partition("=")
            if key in fields or key not in ("layers", "dtype") or not value:
                raise ExportError(usage)
            fields[key] = value
        layers = fields.get("layers")
        if layers is not None and not (layers.isdigit() and int(layers) >= 1):
            raise ExportError(usage)
        if fields.get("dtype", "fp32") not in DTYPES:
            raise ExportError(usage)
        return cls(int(layers) if layers is not None else None, fields.get("dtype"))

    def prepare(self, target: Source, log: Callable[[str], None]) -> None:
        n = target.config.num_hidden_layers
        if self.layers is not None and self.layers >= n:
            raise ExportError(f"--draft self:layers={self.layers}: the target has {n} layers; choose 1..{n - 1}")

    def draft_dtype(self, given: str) -> str:
        """The draft's dtype: the spec's, else --draft-dtype's (which defaults to the target's)."""
        return self.dtype or given

    def export(self, target: Source, dtype: str, export_model: ExportModel) -> ModelSpec:
        return export_model(target, self.draft_dtype(dtype), num_layers=self.layers, full_model=self.layers is None)

    def entry(self) -> DraftEntry:
        return DraftEntry("self", layers=self.layers, dtype=self.dtype)


@dataclass
class ModelDraft:
    """A separate model that shares the target's tokenizer (a folder or a .gguf file)."""

    kind = "model"
    path: Path
    source: Source | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, text: str) -> "ModelDraft":
        return cls(Path(text))  # anything else is a path: checked when loaded

    def prepare(self, target: Source, log: Callable[[str], None]) -> None:
        log(f"loading draft {self.path}")
        self.source = load_source(self.path)
        diff = same_tokenizer(target.tokenizer, self.source.tokenizer)
        if diff:
            raise ExportError(f"draft {self.path} and target {target.path} have different tokenizers: {diff}")
        if self.source.config.vocab_size != target.config.vocab_size:
            raise ExportError(
                f"draft {self.path} has {self.source.config.vocab_size} logits, "
                f"target {target.path} has {target.config.vocab_size}"
            )

    def export(self, target: Source, dtype: str, export_model: ExportModel) -> ModelSpec:
        return export_model(self.source, dtype, num_layers=None, full_model=True)

    def entry(self) -> DraftEntry:
        distilled = self.source.distilled if self.source is not None else None
        # how `specdeploy distill` made it (its vocabulary is in the graph)
        record = {k: v for k, v in distilled.items() if k != "vocab"} if distilled else None
        return DraftEntry("model", source=str(self.path.resolve()), distilled=record)


@dataclass
class Eagle3Draft:
    """An EAGLE-3 head (a folder in the published layout, export/eagle3.py): one layer over the
    target's own hidden states. The target's graph then also returns the states of the
    layers the head reads."""

    kind = "eagle3"
    path: Path
    head: "Head | None" = field(default=None, repr=False)

    @classmethod
    def parse(cls, text: str) -> "Eagle3Draft | None":
        from .eagle3 import is_head_folder

        return cls(Path(text)) if is_head_folder(Path(text)) else None

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.layers

    def prepare(self, target: Source, log: Callable[[str], None]) -> None:
        from .architectures import architecture
        from .eagle3 import load_head

        if architecture(target.config).linear_attention:
            raise ExportError(f"--draft eagle3: an EAGLE-3 head over {target.config.model_type}'s linear-attention "
                              "layers is not implemented; use mtp (the checkpoint's own layer), a model, self, ngram "
                              "or suffix draft")
        log(f"loading EAGLE-3 head {self.path}")
        self.head = load_head(self.path, target.config)

    def export(self, target: Source, dtype: str, export_model: ExportModel) -> ModelSpec:
        return export_model(target, dtype, head=self.head)

    def entry(self) -> DraftEntry:
        from .eagle3_export import VOCAB_MAP

        distilled = self.head.distilled if self.head is not None else None
        record = {k: v for k, v in distilled.items() if k not in ("vocab", "curve")} if distilled else None
        return DraftEntry("eagle3", source=str(self.path.resolve()), distilled=record,
                          aux_layers=list(self.head.layers), vocab_map=VOCAB_MAP)


@dataclass
class AssistantDraft:
    """A Gemma 4 assistant (export/assistant.py): `assistant:PATH`, or PATH where its config says
    so. It reads the target's K/V and final state, so the target's graph also returns that state."""

    kind = "assistant"
    path: Path
    assistant: "Assistant | None" = field(default=None, repr=False)
    aux_layers: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "AssistantDraft | None":
        from .assistant import is_assistant_folder

        if text.startswith("assistant:"):
            return cls(Path(text[len("assistant:"):]))
        return cls(Path(text)) if is_assistant_folder(Path(text)) else None

    def prepare(self, target: Source, log: Callable[[str], None]) -> None:
        from .assistant import load_assistant

        log(f"loading Gemma 4 assistant {self.path}")
        self.assistant = load_assistant(self.path, target.config)
        self.aux_layers = (target.config.num_hidden_layers,)  # Hugging Face's hidden_states[-1]

    def export(self, target: Source, dtype: str, export_model: ExportModel) -> ModelSpec:
        return export_model(target, dtype, assistant=self.assistant)

    def entry(self) -> DraftEntry:
        return DraftEntry("assistant", source=str(self.path.resolve()), aux_layers=list(self.aux_layers))


@dataclass
class MtpDraft:
    """`mtp`: the multi-token-prediction layer the target's checkpoint carries (export/mtp.py). It
    reads the target's final state, so the target's graph also returns that state."""

    kind = "mtp"
    mtp: "Mtp | None" = field(default=None, repr=False)
    aux_layers: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "MtpDraft | None":
        return cls() if text == "mtp" else None

    def prepare(self, target: Source, log: Callable[[str], None]) -> None:
        from .mtp import load_mtp

        log(f"loading the MTP layer of {target.path}")
        self.mtp = load_mtp(target)
        self.aux_layers = (target.config.num_hidden_layers,)  # the final norm's output

    def export(self, target: Source, dtype: str, export_model: ExportModel) -> ModelSpec:
        return export_model(target, dtype, mtp=self.mtp)

    def entry(self) -> DraftEntry:
        source = str(self.mtp.path.resolve()) if self.mtp is not None else None
        return DraftEntry("mtp", source=source, aux_layers=list(self.aux_layers))


RECIPES: tuple[type, ...] = (NoDraft, NgramDraft, SuffixDraft, SelfDraft, MtpDraft, Eagle3Draft, AssistantDraft,
                             ModelDraft)  # asked in order; a path last
one_class_per_draft_kind(RECIPES, "export's draft recipes")  # one recipe per kind of DRAFT_KINDS


def parse_draft(text: str | None) -> DraftRecipe:
    """`PATH`, `assistant:PATH`, `self:layers=N`, `mtp`, `ngram`, `suffix` or `none` (None: none)."""
    for recipe in RECIPES:
        found = recipe.parse("none" if text is None else text)
        if found is not None:
            return found
    raise ExportError(f"--draft {text!r}: not a draft this specdeploy can export")
