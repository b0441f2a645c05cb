"""The decoder families export takes, one entry each, and what the graph does differently for
them (docs/architectures.md). The graph (export/graph.py) and the build (export/build.py) read
these entries; adding a family is an entry here and its tests.

Whatever an entry does not declare, the graph cannot reproduce: `check_config` refuses a
config that asks for it, in one line naming the field, before anything is exported.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from specdeploy.core.errors import ExportError

# RoPE types whose angles are fixed per position: the graph computes cos/sin from the source's
# inverse frequencies and attention scaling, exactly as its rotary module does ("proportional",
# Gemma 4's full layers: frequencies of zero past partial_rotary_factor, dims that stay as they
# are). Types whose frequencies depend on the sequence length reached (dynamic, longrope) are refused.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")

# Where a family's sliding window applies:
# "none": never; "all": every layer, the runtime's mask carries it (the manifest's sliding_window);
# "layer_types": the layers config.layer_types marks "sliding_attention", the graph masks them itself
# from position_ids (the runtime's mask stays full causal, for the other layers).
WINDOWS = ("none", "all", "layer_types")
SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"


@dataclass(frozen=True)
class LayerNorms:
    """The names of a decoder layer's norms: before attention, on attention's output (before it
    joins the residual stream), before the MLP, on the MLP's output. None: the family has none."""
    attention_in: str = "input_layernorm"
    attention_out: str | None = None
    mlp_in: str = "post_attention_layernorm"
    mlp_out: str | None = None


@dataclass(frozen=True)
class Refusal:
    """A config value the graph does not reproduce: `refuses(value)` -> the reason, or None."""
    field: str
    refuses: Callable[[Any], str | None]


def _set(what: str) -> Callable[[Any], str | None]:
    return lambda value: what if value else None


@dataclass(frozen=True)
class Architecture:
    model_type: str  # config.model_type
    family: str  # as the docs name it
    # RMSNorm kind: w * x^ (Llama), or (1 + w) * x^ multiplied in float32 before the cast (Gemma)
    unit_offset_norm: bool = False
    activation_field: str = "hidden_act"  # the config field naming the MLP activation
    activation: str = "silu"  # its usual value (the graph uses whatever ACT2FN names)
    norms: LayerNorms = LayerNorms()
    qk_norm: bool = False  # RMSNorm over each head's q and k (self_attn.q_norm, k_norm) before RoPE
    packed_qkv: bool = False  # the source's weights: self_attn.qkv_proj = q | k | v
    packed_gate_up: bool = False  # mlp.gate_up_proj = gate | up
    window: str = "none"  # WINDOWS
    rope_by_layer_type: bool = False  # config.rope_parameters has one entry per layer type
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the weights' dtype
    query_scale_field: str | None = None  # scores scaled by this field's -1/2 power, not head_dim's
    attn_softcap_field: str | None = None  # scores -> cap * tanh(scores / cap) before the mask
    final_softcap_field: str | None = None  # logits -> cap * tanh(logits / cap)
    fp16: bool = True  # False: its activations overflow float16 (the reference computes in bf16/fp32)
    # RoPE, the residual norms and (fused) attention spelled as ONNX Runtime's fused contrib ops
    # (RotaryEmbedding, SkipSimplifiedLayerNormalization, GroupQueryAttention) are implemented.
    # Without them a quantized (int8/int4) graph keeps the standard RoPE and norms around its
    # MatMulNBits projections, and --attention fused is refused.
    contrib_ops: bool = True
    # A config list with one entry per layer, 1 where the layer rotates q and k and 0 where it
    # attends without positions (SmolLM3's no_rope_layers); None: every layer rotates.
    rope_layers_field: str | None = None
    # A config flag that turns layer_types' sliding layers on (SmolLM3's use_sliding_window:
    # false, every layer attends in full); None: layer_types alone decides.
    window_flag: str | None = None
    # A learned logit per head joins each softmax's denominator and is dropped after it
    # (gpt-oss's attention sinks, self_attn.sinks): attention may give less than 1 to the context.
    sinks: bool = False
    # A mixture of experts (gpt-oss: in place of the MLP, mlp.router picks num_experts_per_tok of
    # num_local_experts, mlp.experts their clamped SwiGLU; Gemma 4 with enable_moe_block: beside
    # it): export/experts.py makes them dense.
    experts: bool = False
    # Gemma 4: each layer's heads and width from config.per_layer_config (full layers wider); the
    # layers kv_sharing_modes marks "reuse" read the K/V of the last earlier layer of their type
    # and keep none; attention_k_eq_v full layers take v from k's projection; v normed without a
    # scale; scores not scaled (the q/k norms set their size); each layer's output times its
    # layer_scalar; per-layer input embeddings (hidden_size_per_layer_input) gate each layer's end;
    # with enable_moe_block, an experts block beside each MLP (export/experts.py).
    layer_configs: bool = False
    # Qwen3.5: the layers config.layer_types marks "linear_attention" are Gated DeltaNet layers
    # with recurrent states (export/recurrent.py), the others full attention whose q_proj also
    # emits an output gate (attention output times sigmoid(gate)); RoPE may rotate only the first
    # partial_rotary_factor of each head.
    linear_attention: bool = False
    refusals: tuple[Refusal, ...] = field(default_factory=tuple)

    def rope_parameters(self, cfg) -> dict[str, dict]:
        """{layer type or "default": rope parameters} as the config gives them."""
        params = cfg.rope_parameters or {}
        if self.rope_by_layer_type:
            return {key: params[key] for key in sorted(set(cfg.layer_types))}
        return {"default": params}

    def layer_windows(self, cfg) -> list[int | None]:
        """Each layer's sliding window that the graph applies itself (None: full attention, or a
        window the runtime's mask carries)."""
        if self.window != "layer_types" or (self.window_flag and not getattr(cfg, self.window_flag, False)):
            return [None] * cfg.num_hidden_layers
        return [cfg.sliding_window if kind == SLIDING else None for kind in cfg.layer_types]

    def runtime_window(self, cfg) -> int | None:
        """The window every layer attends through, carried by the runtime's mask (None: none)."""
        return getattr(cfg, "sliding_window", None) if self.window == "all" else None

    def rope_layers(self, cfg) -> list[bool]:
        """Whether each layer rotates its q and k (False: a layer without positions)."""
        if self.rope_layers_field is None:
            return [True] * cfg.num_hidden_layers
        return [bool(flag) for flag in getattr(cfg, self.rope_layers_field)]

    def dense_experts(self, cfg) -> bool:
        """Whether the model has experts export/experts.py makes dense: gpt-oss's MLP, or Gemma 4's
        block beside it (enable_moe_block)."""
        return self.experts or (self.layer_configs and bool(cfg.enable_moe_block))

    def fused(self, cfg) -> bool:
        """Whether ONNX Runtime's fused attention graph (GroupQueryAttention, which rotates every
        layer's q and k and has no sink input in the version we write) reproduces this model."""
        return self.contrib_ops and not self.sinks and all(self.rope_layers(cfg))

    def scaling(self, cfg, head_dim: int) -> float:
        if self.layer_configs:
            return 1.0
        return float(getattr(cfg, self.query_scale_field) if self.query_scale_field else head_dim) ** -0.5

    def softcaps(self, cfg) -> tuple[float | None, float | None]:
        """(attention, final logit) soft-caps; None where the family or the config has none."""
        def read(name):
            value = getattr(cfg, name) if name else None
            return float(value) if value else None
        return read(self.attn_softcap_field), read(self.final_softcap_field)


def _no_sliding(value) -> str | None:
    return "a sliding window on some layers is not implemented for this family" if value else None


def _partial_rotary(cfg) -> str | None:
    factor = (cfg.rope_parameters or {}).get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    return None if factor in (None, 1, 1.0) else f"partial_rotary_factor {factor}: rotating part of each head is not implemented"


LLAMA_LIKE = dict(refusals=(Refusal("pretraining_tp", lambda v: f"{v} (sliced projections) is not implemented"
                                    if v not in (None, 1) else None),))

GEMMA = dict(
    unit_offset_norm=True, activation_field="hidden_activation", activation="gelu_pytorch_tanh",
    norms=LayerNorms("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"),
    window="layer_types", embed_scale=True, query_scale_field="query_pre_attn_scalar",
    attn_softcap_field="attn_logit_softcapping", final_softcap_field="final_logit_softcapping",
    fp16=False, contrib_ops=False,
)

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("llama", "Llama", **LLAMA_LIKE),
    Architecture("smollm3", "SmolLM3", rope_layers_field="no_rope_layers", window="layer_types",
                 window_flag="use_sliding_window"),
    Architecture("gpt_oss", "gpt-oss", window="layer_types", sinks=True, experts=True, fp16=False),
    Architecture("qwen2", "Qwen2", refusals=(Refusal("use_sliding_window", _no_sliding),)),
    Architecture("mistral", "Mistral", window="all"),
    Architecture("qwen3", "Qwen3", qk_norm=True, contrib_ops=False,
                 refusals=(Refusal("use_sliding_window", _no_sliding),)),
    Architecture("phi3", "Phi-3 / Phi-4", packed_qkv=True, packed_gate_up=True, window="all", contrib_ops=False),
    Architecture("gemma2", "Gemma 2", **GEMMA,
                 refusals=(Refusal("use_bidirectional_attention", _set("bidirectional attention is not implemented")),)),
    Architecture("gemma3_text", "Gemma 3 (text)", qk_norm=True, rope_by_layer_type=True, **GEMMA,
                 refusals=(Refusal("use_bidirectional_attention", _set("bidirectional attention is not implemented")),)),
    Architecture("qwen3_5_text", "Qwen3.5 (text)", unit_offset_norm=True, qk_norm=True, linear_attention=True,
                 contrib_ops=False, fp16=False,
                 refusals=(Refusal("attention_bias", _set("attention biases are not implemented")),)),
    Architecture("gemma4_text", "Gemma 4 (text)", qk_norm=True, rope_by_layer_type=True, layer_configs=True,
                 **{**GEMMA, "unit_offset_norm": False, "query_scale_field": None, "attn_softcap_field": None},
                 refusals=(Refusal("use_bidirectional_attention", _set("bidirectional attention is not implemented")),)),
)}


def architecture(cfg) -> Architecture:
    """The entry for a config's model_type; an unsupported one is a one-line error."""
    entry = ARCHITECTURES.get(cfg.model_type)
    if entry is None:
        raise ExportError(f"architecture {cfg.model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return entry


def check_config(cfg) -> Architecture:
    """The entry for `cfg`, or a one-line ExportError naming the first config field whose value
    the graph would not reproduce (never a silently different model)."""
    arch = architecture(cfg)
    for refusal in arch.refusals:
        why = refusal.refuses(getattr(cfg, refusal.field, None))
        if why:
            raise ExportError(f"{arch.family}: config {refusal.field}: {why}")
    for key, params in arch.rope_parameters(cfg).items():
        where = "rope_parameters" + ("" if key == "default" else f"[{key!r}]")
        kind = (params or {}).get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ExportError(f"{arch.family}: config {where}: rope_type {kind!r} is not implemented "
                              f"(implemented: {', '.join(ROPE_TYPES)})")
    if arch.rope_layers_field:
        flags = list(getattr(cfg, arch.rope_layers_field) or [])
        if len(flags) != cfg.num_hidden_layers or set(flags) - {0, 1}:
            raise ExportError(f"{arch.family}: config {arch.rope_layers_field}: {flags}: one 0 or 1 per layer expected "
                              f"({cfg.num_hidden_layers} layers)")
    why = None if arch.linear_attention else _partial_rotary(cfg)
    if why:
        raise ExportError(f"{arch.family}: config rope_parameters: {why}")
    if arch.linear_attention:
        unknown = sorted(set(cfg.layer_types) - {LINEAR, FULL})
        if unknown:
            raise ExportError(f"{arch.family}: config layer_types: {unknown[0]!r} is not implemented "
                              f"(implemented: {LINEAR!r}, {FULL!r})")
        if FULL not in cfg.layer_types:
            raise ExportError(f"{arch.family}: config layer_types: no {FULL!r} layer (a model of linear layers only "
                              "is not implemented)")
    elif arch.window == "layer_types":
        unknown = sorted(set(cfg.layer_types) - {SLIDING, FULL})
        if unknown:
            raise ExportError(f"{arch.family}: config layer_types: {unknown[0]!r} is not implemented")
    elif set(getattr(cfg, "layer_types", None) or [FULL]) - {FULL} and arch.window == "none":
        raise ExportError(f"{arch.family}: config layer_types: {SLIDING!r} layers are not implemented for this family")
    return arch


def check_export(cfg, dtype: str, attention: str, what: str) -> None:
    """Refuse, in one line, a dtype or attention the family's graph does not implement."""
    arch = architecture(cfg)
    if dtype == "fp16" and not arch.fp16:
        raise ExportError(f"{what}: --dtype fp16: {arch.family}'s activations overflow float16 (its reference "
                          "runs in bfloat16 or float32); use fp32")
    if not arch.fused(cfg) and attention == "fused":
        why = "its attention sinks" if arch.sinks else "its layers without positions" if arch.contrib_ops else arch.family
        raise ExportError(f"{what}: --attention fused: ONNX Runtime's fused attention graph is not implemented for "
                          f"{why}; use --attention exact")


__all__ = ["ARCHITECTURES", "Architecture", "FULL", "LINEAR", "LayerNorms", "ROPE_TYPES", "WINDOWS", "architecture", "check_config",
           "check_export"]
