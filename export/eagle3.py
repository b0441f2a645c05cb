"""EAGLE-3 draft heads (docs/drafters.md, "EAGLE-3 heads"): the published layout, checked
against a target, as an eager reference (training, parity) and as a graph of the contract.

A head is one decoder layer that reads the target's own hidden states:

    fused     = fc([h_a | h_b | h_c])       the target's states at the inputs of three of its
                                            layers, side by side (3H -> H), for a row the
                                            target computed; or the head's own last output
                                            (H) for a row it drafted itself
    x         = [input_layernorm(embed(next token)) | hidden_norm(fused)]      2H wide
    h         = fused + o_proj(attention(q, k, v of x; RoPE at the row's position))
    out       = h + mlp(post_attention_layernorm(h))      fed back to the next draft step
    logits    = lm_head(norm(out))                        over the draft vocabulary
    target id = draft id + d2t[draft id]

Row p of the head pairs the target's state at position p with the token at p + 1, and
predicts the token at p + 2. The head has no embedding of its own: it reads the target's.
Its RoPE is its own config's (the published Llama-3.1 heads: base 10000 over a target of
500000), the one it was trained with.

The published folder: `config.json` (architectures ["LlamaForCausalLMEagle3"], the layer's
sizes, `draft_vocab_size`, the target's rope settings, optionally
`eagle_config.eagle_aux_hidden_state_layer_ids`) and `model.safetensors` or
`pytorch_model.bin` with `fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`
(int64 [draft vocab]) and `t2d` (bool [vocab]). Layer id i means the input of the target's
layer i (Hugging Face's hidden_states[i]); the default ids are 2, N // 2 and N - 3, side by
side in ascending order.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from specdeploy.core.errors import ExportError

from .architectures import ROPE_TYPES
from .source_check import check_numbers, check_values, read_json

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
IGNORED = ("embed_tokens.weight",)  # some heads carry a copy of the target's embedding: the target's is used
# Activations of the head's MLP: transformers' own, without weights of their own (prelu and
# xielu have some, which the published layout does not carry).
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
# What a weight may be stored as: each is exact in the float32 the head runs in (float64 is
# checked as float32, so a value past its range is refused as the infinity it would become).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
# What Llama's rope of type "default" reads: anything else (a factor, a partial_rotary_factor)
# it ignores, where another reader of the same file might not.
ROPE_KEYS = ("rope_type", "type", "rope_theta")


def _show(value, most: int = 40) -> str:
    """A value of the user's file for a message: its repr, cut with an ellipsis past `most`."""
    text = repr(value)
    return text if len(text) <= most else text[:most] + "..."


def _names_a_head(archs) -> bool:
    """Whether a config's `architectures` names an EAGLE-3 head class, in any spelling: a list
    of names (the published one), or a bare string, which HeadConfig.read then refuses rather
    than let it pass for an ordinary model's config."""
    names = [archs] if isinstance(archs, str) else archs if isinstance(archs, (list, dict)) else []
    return any(isinstance(a, str) and a in ARCHITECTURES for a in names)


def is_head_folder(path: Path) -> bool:
    """Whether `path` is a folder whose config names an EAGLE-3 head."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        d = json.loads(config.read_text())
    except (ValueError, OSError, RecursionError):  # not a head's config: the model loader says what it is
        return False
    return isinstance(d, dict) and _names_a_head(d.get("architectures"))


def default_layers(n: int) -> tuple[int, ...]:
    """The common choice of target layers, ascending: 2, N // 2 and N - 3 (a target of fewer
    than 6 layers: whichever of them exist, distinct)."""
    return tuple(sorted({i for i in (2, n // 2, n - 3) if 0 <= i < n}))


@dataclass(frozen=True)
class HeadConfig:
    """What a head's config.json says, checked for type and range."""

    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    hidden_act: str
    aux_layers: tuple[int, ...] | None  # None: default_layers of the target
    norm_before_residual: bool = False

    @classmethod
    def read(cls, folder: Path) -> "HeadConfig":
        """The config of the head in `folder`, or one line naming config.json and the field:
        every value the head is built from is checked here, before any weight is read, so a
        head that reads is the file's (no field transformers would drop or turn into a
        rotary of zeros, none that fails later in a module's constructor)."""
        path = Path(folder) / "config.json"
        d = read_json(path, "head config")
        if not isinstance(d, dict):
            raise ExportError(f"{path}: the head's config is {type(d).__name__}, not a JSON object")

        def refuse(key: str, why: str):
            raise ExportError(f"{path}: {key}: {why}")

        def number(key, kind=int, default=None):
            value = d.get(key, default)
            ok = value is not None and not isinstance(value, bool) \
                and isinstance(value, (int, float) if kind is float else int)
            if ok and kind is float:
                try:
                    ok = math.isfinite(float(value))
                except OverflowError:  # an integer past float's range
                    ok = False
            if not ok or value <= 0:
                raise ExportError(f"{path}: '{key}' must be a positive {'number (finite)' if kind is float else 'integer'}, "
                                  f"got {_show(value)}")
            return kind(value)

        archs = d.get("architectures")
        # A bare string is refused, not read as the one-element list: trusted loaders take the
        # published form only, and a string's characters compared as names was the old misreading.
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs) or not _names_a_head(archs):
            refuse("architectures", f"{_show(archs, 60)}: expected a list of class names holding one of "
                                    f"{', '.join(ARCHITECTURES)}")
        if d.get("num_hidden_layers", 1) != 1:
            raise ExportError(f"{path}: num_hidden_layers {_show(d.get('num_hidden_layers'))}: an EAGLE-3 head has one layer")
        hidden = number("hidden_size")
        heads = number("num_attention_heads")
        kv = number("num_key_value_heads", default=heads)
        given_head_dim = number("head_dim") if "head_dim" in d else None
        intermediate = number("intermediate_size")
        vocab = number("vocab_size")
        max_positions = number("max_position_embeddings", default=2048)
        eps = number("rms_norm_eps", float, 1e-6)
        theta = number("rope_theta", float, 10000.0)
        rope_key, rope_scaling = cls._rope_scaling(d, refuse)
        # transformers' reading: the rope dict's own values first, the top-level rope_theta
        # only where the dict has none (export/distill_eagle3.py writes both).
        rope = {"rope_theta": theta, **(rope_scaling or {})}
        # The remaining numbers as export/source_check.py checks a model's: sizes past any
        # model's, heads that do not divide, rope parameters not positive and finite.
        check_numbers(SimpleNamespace(
            hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, head_dim=given_head_dim,
            intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=max_positions,
            num_hidden_layers=d.get("num_hidden_layers"), rms_norm_eps=eps), str(path))
        # (check_numbers calls the rope dict rope_parameters, transformers' name: the field the
        # file gave it under is named beside the file)
        check_numbers(SimpleNamespace(rope_parameters=rope), f"{path} ({rope_key or 'rope_theta'})")
        head_dim = given_head_dim or hidden // heads
        if head_dim % 2:
            refuse("head_dim", f"{head_dim}: the rotary turns pairs of a head's values, so it must be even")
        draft_vocab = number("draft_vocab_size", default=vocab)
        if draft_vocab > vocab:
            refuse("draft_vocab_size", f"{draft_vocab}: a draft vocabulary within the vocabulary (vocab_size {vocab})")
        act = d.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            refuse("hidden_act", f"{_show(act)} is not one of {', '.join(ACTIVATIONS)}")
        nested = d.get("eagle_config")
        if nested is not None and not isinstance(nested, dict):
            refuse("eagle_config", f"{_show(nested)} is not an object")
        layers = (nested or {}).get("eagle_aux_hidden_state_layer_ids", d.get("eagle_aux_hidden_state_layer_ids"))
        if layers is not None and (not isinstance(layers, list) or len(layers) != 3
                                   or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)):
            raise ExportError(f"{path}: eagle_aux_hidden_state_layer_ids {_show(layers, 60)}: expected three layer ids")
        top = d.get("eagle_aux_hidden_state_layer_ids")
        if nested and "eagle_aux_hidden_state_layer_ids" in nested and top is not None and top != layers:
            refuse("eagle_aux_hidden_state_layer_ids", f"{_show(top)} at the top level and {_show(layers)} in eagle_config "
                   "disagree: which target layers the head reads is ambiguous")
        before_residual = d.get("norm_before_residual", False)
        if not isinstance(before_residual, bool):  # bool("false") is True: another model
            refuse("norm_before_residual", f"{_show(before_residual)}: expected true or false")
        cfg = cls(
            hidden_size=hidden,
            target_hidden_size=number("target_hidden_size", default=hidden),
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            intermediate_size=intermediate,
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            rms_norm_eps=eps,
            rope_theta=theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            hidden_act=act,
            aux_layers=tuple(sorted(layers)) if layers is not None else None,
            norm_before_residual=before_residual,
        )
        cfg._check_layer(path, lambda why: refuse(rope_key or "rope_theta", f"{_show(rope, 80)}: {why}"))
        return cfg

    @staticmethod
    def _rope_scaling(d: dict, refuse) -> tuple[str | None, dict | None]:
        """(the field that gave it, the head's rope dict): `rope_scaling`, or `rope_parameters`
        (transformers 5's spelling, which it reads in place of rope_theta too), checked for a
        type the graph computes and for values transformers would ignore."""
        given = {key: d[key] for key in ("rope_scaling", "rope_parameters") if d.get(key) is not None}
        for key, value in given.items():
            if not isinstance(value, dict):
                refuse(key, f"{_show(value)} is not an object")
            if any(isinstance(v, dict) for v in value.values()):
                refuse(key, "rope parameters per layer type; an EAGLE-3 head has one layer and one rope")
        if len(given) == 2 and given["rope_scaling"] != given["rope_parameters"]:
            refuse("rope_scaling", "it and rope_parameters disagree: which rope the head was trained with is ambiguous")
        if not given:
            return None, None
        key, params = next(iter(given.items()))
        kind = params.get("rope_type", params.get("type", "default"))
        if "rope_type" in params and "type" in params and params["type"] != kind:
            refuse(key, f"rope_type {_show(kind, 20)} and type {_show(params['type'], 20)} disagree")
        if not isinstance(kind, str) or kind not in ROPE_TYPES:
            refuse(key, f"rope_type {_show(kind, 30)} is not implemented (implemented: {', '.join(ROPE_TYPES)}; the head's "
                        "graph computes fixed angles per position)")
        ignored = sorted(str(k) for k in params if k not in ROPE_KEYS)
        if kind == "default" and ignored:  # transformers drops them with a warning: a factor without a type
            refuse(key, f"{', '.join(ignored)} is ignored by rope_type 'default' (given or implied); name the rope_type "
                        "that reads it")
        return key, params

    def _check_layer(self, path: Path, refuse_rope) -> None:
        """Build the head's Llama config and rotary as its module will, and refuse what
        transformers will not build from the config (its own checks: hidden_size a multiple
        of the heads even where head_dim is given, the keys a rope type needs; its rope code's
        zero divisions) or what the rotary would compute from it: frequencies that are not
        finite (a base so small they overflow float32), or fewer than head_dim / 2 of them (a
        partial rotary the graph does not do)."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        try:
            from huggingface_hub.errors import StrictDataclassError  # transformers 5's config validation
        except ImportError:  # an older huggingface_hub: transformers raises ValueError there
            StrictDataclassError = ValueError
        try:
            rotary = LlamaRotaryEmbedding(self.llama_config())
        except (ValueError, KeyError, TypeError, ArithmeticError, StrictDataclassError) as e:
            cause = e.__cause__ or e  # the validation error wraps the reason
            text = " ".join(str(cause).split())  # one line
            failed = f"{type(cause).__name__}: {text[:160]}"
        else:
            failed = None
        if failed:
            raise ExportError(f"{path}: transformers cannot build the head's layer from it ({failed})")
        inv, scale = rotary.inv_freq, float(rotary.attention_scaling)
        if tuple(inv.shape) != (self.head_dim // 2,):
            refuse_rope(f"{inv.numel()} rotary frequencies for head_dim {self.head_dim}; the graph rotates the whole head")
        if not bool(torch.isfinite(inv).all()) or bool((inv < 0).any()) or not math.isfinite(scale) or scale <= 0:
            refuse_rope(f"the rotary frequencies it gives are not finite and non-negative (attention scaling {scale:.3g})")

    def llama_config(self):
        """A LlamaConfig of the head's layer: its RoPE (scaling included) and MLP."""
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                           head_dim=self.head_dim, num_hidden_layers=1, vocab_size=self.vocab_size,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                           max_position_embeddings=self.max_position_embeddings, hidden_act=self.hidden_act)

    def as_config(self, layers: tuple[int, ...], target_layers: int) -> dict:
        """The published config.json of a head with these settings. The layer ids are written
        only where they are not the default: systems disagree on what an explicit id means
        (vLLM: the input of that layer, as here; SGLang: its output), but not on the default."""
        ids = {} if tuple(layers) == default_layers(target_layers) else \
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}
        return {**ids,
            "architectures": [ARCHITECTURES[0]], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "target_hidden_size": self.target_hidden_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act, "norm_before_residual": self.norm_before_residual,
            "tie_word_embeddings": False, "torch_dtype": "float32",
        }

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the published layout and its shape."""
        h, d = self.hidden_size, self.head_dim
        return {
            "fc.weight": (h, 3 * self.target_hidden_size),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (self.num_heads * d, 2 * h),
            "midlayer.self_attn.k_proj.weight": (self.num_kv_heads * d, 2 * h),
            "midlayer.self_attn.v_proj.weight": (self.num_kv_heads * d, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, self.num_heads * d),
            "midlayer.mlp.gate_proj.weight": (self.intermediate_size, h),
            "midlayer.mlp.up_proj.weight": (self.intermediate_size, h),
            "midlayer.mlp.down_proj.weight": (h, self.intermediate_size),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
            "d2t": (self.draft_vocab_size,),
            "t2d": (self.vocab_size,),
        }


def read_weights(folder: Path, cfg: HeadConfig) -> dict[str, torch.Tensor]:
    """The head's tensors, every one present with the shape its config implies (a one-line
    error names the first that is not); `d2t` and `t2d` may be left out by a head over the
    whole vocabulary."""
    folder = Path(folder)
    found = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not found:
        raise ExportError(f"{folder}: no {' or '.join(WEIGHT_FILES)} (the head's weights)")
    path = found[0]
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
        else:  # weights_only: tensors and containers only, never code a pickle would run
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors' and torch's own errors for a damaged file
        first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise ExportError(f"{path}: cannot read the head's weights ({first})") from None
    # A .bin may hold any container of tensors and plain values: the head's is a flat mapping.
    if not isinstance(tensors, dict) or not all(isinstance(k, str) for k in tensors):
        raise ExportError(f"{path}: holds a {type(tensors).__name__}, not a mapping of tensor names to tensors")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type != "cpu":
            what = f"of type {type(t).__name__}" if not isinstance(t, torch.Tensor) else f"a {t.layout} tensor on {t.device}"
            raise ExportError(f"{path}: entry {_show(name, 80)} is {what}, not a dense CPU tensor")
    shapes = cfg.shapes()
    if cfg.draft_vocab_size == cfg.vocab_size:
        tensors.setdefault("d2t", torch.zeros(cfg.vocab_size, dtype=torch.long))
        tensors.setdefault("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
    for name, shape in shapes.items():
        if name not in tensors:
            raise ExportError(f"{path}: tensor {name!r} is missing (an EAGLE-3 head has {', '.join(shapes)})")
        if tuple(tensors[name].shape) != shape:
            raise ExportError(f"{path}: tensor {name!r} is {list(tensors[name].shape)}; the head's config makes it "
                              f"{list(shape)}")
    extra = sorted(set(tensors) - set(shapes) - set(IGNORED))
    if extra:
        raise ExportError(f"{path}: tensor {_show(extra[0], 80)} is not part of an EAGLE-3 head")
    for name in shapes:
        t = tensors[name]
        if name == "d2t" and t.dtype not in INDEX_DTYPES:  # float offsets would be truncated to other tokens
            raise ExportError(f"{path}: tensor 'd2t' is {t.dtype}; it holds token offsets, an integer type")
        if name == "t2d" and t.dtype not in (torch.bool, *INDEX_DTYPES):
            raise ExportError(f"{path}: tensor 't2d' is {t.dtype}; it is a mask over the vocabulary, bool")
        if name == "t2d" and t.dtype != torch.bool and not bool(((t == 0) | (t == 1)).all()):
            raise ExportError(f"{path}: tensor 't2d' holds values other than 0 and 1; it is a mask over the vocabulary")
        if name not in ("d2t", "t2d") and t.dtype not in FLOAT_DTYPES:
            raise ExportError(f"{path}: tensor {name!r} is {t.dtype}; the head's weights are floating point "
                              f"({', '.join(str(d).removeprefix('torch.') for d in FLOAT_DTYPES)})")
    # No NaN or infinity in a weight, as the float32 module will hold it: found here, by name,
    # not later as a parity failure or as drafts that are never accepted.
    held = {name: t.float() if t.dtype == torch.float64 else t for name, t in tensors.items()
            if name in shapes and t.is_floating_point()}
    check_values(SimpleNamespace(named_parameters=held.items, named_buffers=dict().items), str(path))
    d2t = tensors["d2t"].long()
    ids = torch.arange(cfg.draft_vocab_size) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or ids.unique().numel() != ids.numel():
        raise ExportError(f"{path}: tensor 'd2t' maps draft ids outside [0, {cfg.vocab_size}) or two onto one token")
    return {name: tensors[name] for name in shapes}


@dataclass
class Head:
    """A head as read from its folder, checked against a target."""

    path: Path
    config: HeadConfig
    weights: dict[str, torch.Tensor]
    layers: tuple[int, ...]  # the target layers it reads, ascending
    distilled: dict | None = None  # made by `specdeploy distill --kind eagle3`: its record

    @property
    def target_ids(self) -> torch.Tensor:
        """Each draft id's target id, int64 [draft vocab]."""
        return torch.arange(self.config.draft_vocab_size) + self.weights["d2t"].long()


def load_head(folder: Path, target_config) -> Head:
    """Read a head and check it against the target it will draft for: hidden size,
    vocabulary, layer ids, RoPE. Each mismatch is a one-line error naming both."""
    folder = Path(folder)
    cfg = HeadConfig.read(folder)
    n = target_config.num_hidden_layers
    where = f"EAGLE-3 head {folder}"
    if cfg.target_hidden_size != target_config.hidden_size or cfg.hidden_size != target_config.hidden_size:
        raise ExportError(f"{where}: hidden size {cfg.hidden_size} (target_hidden_size {cfg.target_hidden_size}); the "
                          f"target's is {target_config.hidden_size}")
    if cfg.vocab_size != target_config.vocab_size:
        raise ExportError(f"{where}: vocab_size {cfg.vocab_size}; the target has {target_config.vocab_size} tokens")
    layers = cfg.aux_layers if cfg.aux_layers is not None else default_layers(n)
    if len(set(layers)) != 3 or max(layers) >= n:
        raise ExportError(f"{where}: reads target layers {list(layers)}; expected three distinct layers of the "
                          f"target's 0..{n - 1}")
    # The head's RoPE is its own, the one it was trained with (EAGLE's published heads train
    # with base 10000 over a Llama-3.1 target of 500000): its config's, never the target's
    # (HeadConfig.read has checked it, building the rotary as the module will).
    weights = read_weights(folder, cfg)
    record = folder / "distill.json"
    distilled = read_json(record, "distill record") if record.is_file() else None
    if distilled is not None and not isinstance(distilled, dict):  # the manifest takes it as an object
        raise ExportError(f"{record}: the distill record is {type(distilled).__name__}, not a JSON object")
    return Head(folder, cfg, weights, tuple(layers), distilled)


# -- the eager reference, written from the published definition -----------------------------

class _Attention(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(2 * h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.mlp = LlamaMLP(cfg.llama_config())


class Eagle3Head(nn.Module):
    """The head as published (its state_dict is the published layout), with the target's
    embedding beside it (frozen, not saved). `forward` is the reference: every row of a
    sequence at once, over the earlier rows' K/V kept as tensors (`past`)."""

    def __init__(self, cfg: HeadConfig, embed: nn.Module):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        self.cfg = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(cfg.llama_config())
        self._embed = [embed]  # a list: not a submodule, so not in the state_dict

    @classmethod
    def from_head(cls, head: Head, embed: nn.Module) -> "Eagle3Head":
        module = cls(head.config, embed)
        module.load_state_dict(head.weights)
        return module.eval()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._embed[0](ids)

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's three states (3H wide) through fc; the head's own (H) as they are."""
        return self.fc(hidden) if hidden.shape[-1] == self.fc.in_features else hidden

    def project(self, ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor):
        """-> (residual, q [B, heads, T, D], k, v [B, kv heads, T, D]), q and k rotated."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer, cfg = self.midlayer, self.cfg
        fused = self.fuse(hidden)
        if cfg.norm_before_residual:
            fused = layer.hidden_norm(fused)
            residual, normed = fused, fused
        else:
            residual, normed = fused, layer.hidden_norm(fused)
        x = torch.cat([layer.input_layernorm(self.embed(ids)), normed], dim=-1)
        b, t, _ = x.shape
        attn = layer.self_attn
        q = attn.q_proj(x).view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return residual, q, k, v

    def attend(self, q, keys, values, bias) -> torch.Tensor:
        """Softmax attention of q [B, heads, T, D] over keys/values [B, kv heads, S, D] under the
        additive `bias` [B or 1, 1, T, S] -> [B, T, heads * D]."""
        groups = self.cfg.num_heads // self.cfg.num_kv_heads
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        scores = q @ keys.transpose(-1, -2) / self.cfg.head_dim**0.5 + bias
        out = torch.softmax(scores.float(), -1).to(q.dtype) @ values
        b, _, t, _ = q.shape
        return out.transpose(1, 2).reshape(b, t, -1)

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of the layer: o_proj into the residual, then the MLP block -> the state fed back."""
        layer = self.midlayer
        h = residual + layer.self_attn.o_proj(attended)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out)).float()

    def forward(self, ids, hidden, position_ids, past=None):
        """ids [B, T] (the token after each row's state), hidden [B, T, 3H or H], position_ids
        [B, T]; past: (keys, values) of the rows before, or None -> (out [B, T, H], logits
        [B, T, draft vocab], (keys, values) with these rows appended)."""
        residual, q, k, v = self.project(ids, hidden, position_ids)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        t, s = q.shape[2], k.shape[2]
        bias = torch.full((t, s), float("-inf")).triu(s - t + 1)[None, None]
        out = self.finish(residual, self.attend(q, k, v, bias))
        return out, self.logits(out), (k, v)


# -- the graph of the contract ------------------------------------------------------------------

class Eagle3Graph(nn.Module):
    """The head as a graph of the contract (export/graph.py), over one static KV buffer pair
    written in place, with the hidden states beside the token inputs:

        aux_hidden_states [1, T, 3H]  the target's states for rows it computed (else zeros)
        draft_hidden      [1, T, H]   the head's own last state for a row it drafts (else zeros)
     -> logits [1, R, draft vocab], present_key_0 / present_value_0, draft_hidden_out [1, R, H]

    fc has no bias, so fc(zeros) adds nothing: one graph serves both kinds of row. It borrows
    the head module's own submodules (quantized in place for int8/int4)."""

    state_layout = ()  # no linear-attention layers: no recurrent states (export/recurrent.py)

    feature_outputs_order = ("draft_hidden_out",)

    def __init__(self, head: Eagle3Head, embed: nn.Module, inplace: bool = False):
        super().__init__()
        cfg = head.cfg
        self.cfg = cfg
        self.embed_tokens = embed
        self.fc, self.layer, self.norm, self.lm_head = head.fc, head.midlayer, head.norm, head.lm_head
        self.register_buffer("inv_freq", head.rotary.inv_freq.detach().clone().float(), persistent=False)
        self.rope_scale = float(head.rotary.attention_scaling)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.kv_layout = [(cfg.num_kv_heads, cfg.head_dim)]  # one layer's K/V (onnx_export.kv_buffers)
        self.scaling = cfg.head_dim**-0.5
        self.num_layers = 1
        self.inplace = inplace
        self.fused = self.contrib_ops = False
        self.head_vocab = None
        self.quantization = None
        self.feature_inputs = {"aux_hidden_states": 3 * cfg.target_hidden_size, "draft_hidden": cfg.hidden_size}
        self.feature_outputs = {"draft_hidden_out": cfg.hidden_size}

    def _rms(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from .graph import rms_norm

        return rms_norm(norm, x, self.cfg.rms_norm_eps)

    def forward(self, input_ids, position_ids, write_indices, attention_mask, past: list[torch.Tensor],
                logits_rows: torch.Tensor, aux_hidden_states: torch.Tensor, draft_hidden: torch.Tensor):
        from .graph import _rotate_half, kv_write_inplace
        from .ops import attention_reference, kv_write

        b, t = input_ids.shape
        dtype = self.norm.weight.dtype
        layer, d = self.layer, self.head_dim
        fused = self.fc(aux_hidden_states.to(dtype)) + draft_hidden.to(dtype)
        if self.cfg.norm_before_residual:
            residual = normed = self._rms(layer.hidden_norm, fused)
        else:
            residual, normed = fused, self._rms(layer.hidden_norm, fused)
        x = torch.cat([self._rms(layer.input_layernorm, self.embed_tokens(input_ids).to(dtype)), normed], dim=-1)
        attn = layer.self_attn
        q = attn.q_proj(x).view(b, t, self.num_heads, d).transpose(1, 2)
        k = attn.k_proj(x).view(b, t, self.num_kv_heads, d).transpose(1, 2)
        v = attn.v_proj(x).view(b, t, self.num_kv_heads, d).transpose(1, 2)
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(dtype)[:, None]
        sin = (emb.sin() * self.rope_scale).to(dtype)[:, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        mask = attention_mask[:, :, None].to(dtype)
        out, key_cache, value_cache = attention_reference(q, k, v, past[0], past[1], write_indices, mask, self.scaling,
                                                          kv_write_inplace if self.inplace else kv_write)
        h = residual + attn.o_proj(out)
        h = h + layer.mlp(self._rms(layer.post_attention_layernorm, h))
        h = h.index_select(1, logits_rows)
        logits = self.lm_head(self._rms(self.norm, h)).float()
        return logits, key_cache, value_cache, h.float()


def quantize_head(head: Eagle3Head, scheme: str, zero: str) -> dict:
    """Every linear of the head as MatMulNBits blocks (quantized here: a head comes as floats),
    in place. Returns the manifest's record."""
    from .blocks import quantize_float
    from .ops import ACCURACY_LEVEL
    from .quantize import SCHEMES, QuantLinear

    bits = SCHEMES[scheme]
    count = 0
    owners = [(head, "fc"), (head, "lm_head")] + [(head.midlayer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] \
        + [(head.midlayer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")]
    for owner, name in owners:
        weight = getattr(owner, name).weight.detach().float().numpy()
        if weight.shape[1] % 32:
            raise ExportError(f"EAGLE-3 head {name}: input dimension {weight.shape[1]} is not a multiple of the "
                              "32-weight block; use --dtype fp32")
        setattr(owner, name, QuantLinear(quantize_float(weight, bits, zero), None))
        count += 1
    return {"scheme": scheme, "quant_scheme": "exact", "zero": zero if bits == 4 else "none",
            "method": "weight-only, blocks along the input dimension, MatMulNBits", "block_size": 32,
            "accuracy_level": ACCURACY_LEVEL,
            "linear_bits": bits, "head_bits": bits, "embedding": "float32",
            "tensors": {f"float->int{bits}": count}, "imported_exactly": 0, "quantized_from_float": count,
            "not_exact": [], "source": None}


__all__ = ["ARCHITECTURES", "Eagle3Graph", "Eagle3Head", "Head", "HeadConfig", "default_layers", "is_head_folder", "load_head",
           "quantize_head", "read_weights"]
