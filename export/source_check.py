"""A source is exactly the file's model or it is refused: the checks export runs before it builds
anything (docs/architectures.md, "What export checks").

    numbers   every architecture number a config (or a GGUF's metadata) gives: positive, finite,
              dividing what it must divide; token ids inside the vocabulary
    layers    the layers the file's tensors hold equal the config's layer count
    tensors   every weight the config implies is in the file with the shape the model needs;
              none missing, none left over (a model built on the meta device: no memory)
    values    after loading: no NaN or infinity in any weight, each named where it is found

Each check is cheap (milliseconds, no weight memory), so a hostile number costs nothing, and
each failure is one line naming the file and the tensor or field. A model that loads after
these checks is the file's: transformers would otherwise drop tensors past the config's layer
count and fill weights the file lacks with random values, without a word.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Iterable

from specdeploy.core.errors import ExportError

# Integer fields that size the model: each must be a positive integer where the config has it.
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "query_pre_attn_scalar")
# Float fields: finite, and positive where a zero or a negative would be meaningless.
POSITIVE_FLOATS = ("rms_norm_eps", "attn_logit_softcapping", "final_logit_softcapping")
FINITE_FLOATS = ("initializer_range",)
# rope parameters: each positive and finite where present (rope_type and the layer types aside).
ROPE_NUMBERS = ("rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
TOKEN_IDS = ("eos_token_id", "bos_token_id", "pad_token_id")
# Sizes past these are no model anyone ships; refused before anything is built from them.
MOST = {"num_hidden_layers": 1024, "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 4096,
        "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "vocab_size": 1 << 22}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_numbers(cfg, where: str) -> None:
    """One-line ExportError naming the first config field whose value is no model's: a size
    that is not a positive integer (or is past MOST), a float that is not finite (or not
    positive where it must be), heads that do not divide, a token id outside the vocabulary."""
    def refuse(name: str, why: str):
        raise ExportError(f"{where}: config {name}: {why}")

    for name in SIZES:
        value = getattr(cfg, name, None)
        if value is None:
            continue
        if not _is_int(value) or value <= 0:
            refuse(name, f"{value!r}: expected a positive integer")
        if value > MOST.get(name, 1 << 40):
            refuse(name, f"{value} is past the largest this export takes ({MOST.get(name, 1 << 40)})")
    for names, positive in ((POSITIVE_FLOATS, True), (FINITE_FLOATS, False)):
        for name in names:
            value = getattr(cfg, name, None)
            if value is None:
                continue
            if not _is_number(value) or not math.isfinite(value) or (positive and value <= 0):
                refuse(name, f"{value!r}: expected a {'positive ' if positive else ''}finite number")
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if heads and kv and heads % kv:
        refuse("num_key_value_heads", f"{kv} does not divide num_attention_heads ({heads})")
    hidden = getattr(cfg, "hidden_size", None)
    if heads and hidden and getattr(cfg, "head_dim", None) is None and hidden % heads:
        refuse("num_attention_heads", f"{heads} does not divide hidden_size ({hidden}) and no head_dim is given")
    for key, params in _rope_entries(cfg):
        for name in ROPE_NUMBERS:
            value = params.get(name)
            if value is not None and (not _is_number(value) or not math.isfinite(value) or value <= 0):
                refuse(f"{key}[{name!r}]", f"{value!r}: expected a positive finite number")
        factor = params.get("factor")
        if params.get("rope_type") in ("linear", "yarn", "llama3") and factor is not None and factor < 1:
            refuse(f"{key}[{'factor'!r}]", f"{factor}: a context-extension factor is at least 1")
    vocab = getattr(cfg, "vocab_size", None)
    for name in TOKEN_IDS:
        value = getattr(cfg, name, None)
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is not None and (not _is_int(token) or not 0 <= token < (vocab or 0)):
                refuse(name, f"{token!r}: expected a token id in 0..{(vocab or 1) - 1}")


def _rope_entries(cfg) -> list[tuple[str, dict]]:
    """("rope_parameters" or "rope_parameters['<layer type>']", its parameters) for each set of
    rope parameters the config holds (one, or one per layer type)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if not isinstance(params, dict):
        return []
    if all(isinstance(v, dict) for v in params.values()) and params:
        return [(f"rope_parameters[{k!r}]", v) for k, v in params.items()]
    return [("rope_parameters", params)]


# -- the file's tensors ---------------------------------------------------------------------------

_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")
# GGUF tensors transformers' reader does not map to a weight and that carry nothing the graph
# lacks: llama.cpp stores llama3/longrope frequency factors that the config states too.
GGUF_DERIVED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def check_layers(found: Iterable[str], pattern: re.Pattern, layers: int, where: str, field: str) -> None:
    """The file's tensors hold exactly layers 0..layers-1."""
    held = {int(m.group(1)) for name in found if (m := pattern.search(name))}
    if held != set(range(layers)):
        count = f"{len(held)} layer(s)" + ("" if held == set(range(len(held))) else f" (numbered {_ranges(held)})")
        raise ExportError(f"{where}: the config says {field} {layers} but the file's tensors hold {count}; "
                          "refusing a model that is not the file's")


def _ranges(ids: set[int]) -> str:
    ids = sorted(ids)
    return ", ".join(str(i) for i in ids[:6]) + (", ..." if len(ids) > 6 else "")


def expected_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """{weight name: shape} of the model `cfg` describes, built on the meta device (no memory),
    without the output head where it is tied to the embedding."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        for name in list(shapes):
            if name.endswith("lm_head.weight"):
                del shapes[name]
    return shapes


def compare(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], where: str,
            name_of=lambda name: name, size=lambda shape: shape) -> None:
    """Refuse a weight missing from the file, one the model has no place for, or one of another
    shape; `name_of` gives a weight's name as the file spells it, `size` what of a shape must
    agree (the shape itself, or its element count)."""
    for name, shape in expected.items():
        theirs = found.get(name_of(name))
        if theirs is None:
            raise ExportError(f"{where}: tensor {name_of(name)} is missing from the file (the config implies it, "
                              f"shape {list(shape)}); refusing to fill it with random values")
        if size(tuple(theirs)) != size(tuple(shape)):
            raise ExportError(f"{where}: tensor {name_of(name)} has shape {list(theirs)} where the config implies "
                              f"{list(shape)}")
    extra = sorted(set(found) - {name_of(name) for name in expected})
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise ExportError(f"{where}: tensor {extra[0]}{more} in the file has no place in the model the config "
                          "describes; refusing a model that is not the file's")


def safetensors_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} from the headers of a folder's .safetensors files (no weights read)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{folder}: no .safetensors weights in the folder")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as e:  # the safetensors reader on bytes anyone could have written
            raise ExportError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0][:200]})") from None
    return shapes


def check_folder(folder: Path, cfg) -> None:
    """A Hugging Face folder's safetensors hold exactly the weights `cfg` implies."""
    found = safetensors_shapes(folder)
    check_layers(found, _HF_LAYER, cfg.num_hidden_layers, str(folder), "num_hidden_layers")
    expected = expected_tensors(cfg)
    model_class = _model_class(cfg)
    # What transformers itself drops without a word and rightly so: a tied head saved beside the
    # embedding it equals, the rotary frequencies older checkpoints saved, the class's own list.
    ignored = [re.compile(p) for p in (getattr(model_class, "_keys_to_ignore_on_load_unexpected", None) or [])]
    ignored.append(re.compile(r"rotary_emb\.inv_freq$"))
    if getattr(cfg, "tie_word_embeddings", False):
        ignored.append(re.compile(r"(^|\.)lm_head\.weight$"))
    found = {n: shape for n, shape in found.items() if not any(p.search(n) for p in ignored)}
    prefix = getattr(model_class, "base_model_prefix", "model")
    # A checkpoint saved from the bare decoder names its weights without the causal LM's prefix.
    bare = prefix and not any(n.startswith(prefix + ".") for n in found)
    compare(expected, found, str(folder), (lambda n: n[len(prefix) + 1:] if n.startswith(prefix + ".") else n)
            if bare else (lambda n: n))


def _model_class(cfg):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(cfg)]


def read_gguf(path: Path):
    """gguf-py's reader over `path`, or one line saying the file is not a readable GGUF."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf-py's parser on bytes anyone could have written: struct, numpy, unicode errors
        raise ExportError(f"{path}: not a readable GGUF file ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None


# GGUF metadata (`<arch>.<key>`) that sizes the model: a positive integer each (or an array of them).
GGUF_SIZES = ("block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
              "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
              "attention.sliding_window", "rope.dimension_count")
GGUF_POSITIVE = ("rope.freq_base", "attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon",
                 "rope.scaling.factor", "attn_logit_softcapping", "final_logit_softcapping")


def check_gguf_metadata(path: Path, reader) -> None:
    """The numbers a GGUF's metadata sizes its model with, checked before transformers reads
    them into a config (a zero head count would be a division by zero there)."""
    field = reader.get_field("general.architecture")
    if field is None:
        raise ExportError(f"{path}: no general.architecture in the GGUF metadata")
    arch = field.contents()
    if not isinstance(arch, str):
        raise ExportError(f"{path}: general.architecture is not a string")
    for names, integer in ((GGUF_SIZES, True), (GGUF_POSITIVE, False)):
        for name in names:
            key = f"{arch}.{name}"
            field = reader.get_field(key)
            if field is None:
                continue
            try:
                value = field.contents()
            except Exception:  # a value gguf-py cannot decode
                raise ExportError(f"{path}: GGUF metadata {key}: unreadable value") from None
            for v in value if isinstance(value, list) else [value]:
                ok = _is_int(v) and 0 < v <= (1 << 31) - 1 if integer else \
                    _is_number(v) and math.isfinite(v) and v > 0
                if not ok:
                    raise ExportError(f"{path}: GGUF metadata {key}: {v!r}: expected a positive "
                                      f"{'integer below 2^31' if integer else 'finite number'}")
    # transformers reads one head width, and for some families takes it from the rotary width:
    # a file whose widths differ would be read as another model.
    def scalar(name):
        field = reader.get_field(f"{arch}.{name}")
        value = field.contents() if field is not None else None
        return value if _is_int(value) else None
    width = scalar("attention.key_length")
    if width is None and scalar("embedding_length") and scalar("attention.head_count"):
        width = scalar("embedding_length") // scalar("attention.head_count")
    for name in ("attention.value_length", "rope.dimension_count"):
        value = scalar(name)
        if width is not None and value is not None and value != width:
            what = "rotating part of each head" if name.startswith("rope") else "values narrower or wider than keys"
            raise ExportError(f"{path}: GGUF metadata {arch}.{name}: {value} where the heads are {width} wide: "
                              f"{what} is not implemented")


def check_gguf(path: Path, cfg, reader) -> None:
    """A GGUF's tensors are exactly the weights `cfg` (read from its metadata) implies: each
    weight's GGUF name (gguf-py's own name map, as transformers reads the file) present with its
    element count, and no tensor left over."""
    import gguf

    found = {t.name: tuple(int(d) for d in reversed(list(t.shape))) for t in reader.tensors}
    where = str(path)
    check_layers(found, _GGUF_LAYER, cfg.num_hidden_layers, where, "block_count")
    arch_name = reader.get_field("general.architecture").contents()
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise ExportError(f"{where}: general.architecture {arch_name!r} is not one gguf-py knows")
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)

    def gguf_name(name: str) -> str:
        base, _, suffix = name.rpartition(".")
        mapped = names.get_name(base)
        return f"{mapped}.{suffix}" if mapped else name

    expected = {gguf_name(n): s for n, s in expected_tensors(cfg).items()}
    # Shapes are compared by element count: what transformers' reader reshapes and reorders
    # (llama.cpp interleaves each q and k head's rotary halves) keeps the count, and the count
    # is what must agree.
    have = {n: s for n, s in found.items() if n not in GGUF_DERIVED}
    compare(expected, have, where, size=math.prod)


def check_values(model, where: str) -> None:
    """No NaN or infinity in any weight of a loaded model: the first one found, by name."""
    import torch

    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = tensor[~torch.isfinite(tensor)]
            kinds = sorted({"NaN" if math.isnan(v) else ("+inf" if v > 0 else "-inf") for v in bad[:1000].tolist()})
            raise ExportError(f"{where}: tensor {name} holds {bad.numel()} non-finite value(s) ({', '.join(kinds)})")


def check_loading(info: dict, where: str) -> None:
    """transformers' own account of the load: anything missing, left over or resized is a refusal
    (a second guard behind check_folder / check_gguf)."""
    for key, what in (("missing_keys", "is missing from the file"), ("unexpected_keys", "has no place in the model"),
                      ("mismatched_keys", "has another shape than the model's")):
        names = sorted(str(n) for n in info.get(key) or ())
        if names:
            raise ExportError(f"{where}: tensor {names[0]} {what}" + (f" (and {len(names) - 1} more)" if len(names) > 1 else ""))


def read_json(path: Path, what: str) -> Any:
    """A JSON file another party could have written: its value, or one line naming it."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ExportError(f"{path}: not a readable {what} ({str(e).splitlines()[0][:160]})") from None


__all__ = ["check_folder", "check_gguf", "check_layers", "check_loading", "check_numbers", "check_values",
           "check_gguf_metadata", "expected_tensors", "read_gguf", "read_json"]
