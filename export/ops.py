"""The custom ops of the export graphs, with their eager meanings and ONNX translations, in
one place: what the exporter turns into which ONNX node (`onnx_translations`).

Each op is a PyTorch custom op: its body is the eager meaning (the parity reference and the
torch backend run it), and its ONNX function is what `torch.onnx.export` writes instead.

- `kv_write`: standard ONNX `TensorScatter` (opset 24), which ONNX Runtime and TensorRT run
  in place when the output aliases the input buffer. Every graph has it.
- ONNX Runtime contrib ops (domain com.microsoft), for the int8/int4 and fused graphs only:
  ONNX Runtime's CPU and CUDA providers run them, TensorRT's ONNX parser reads none of them,
  so the fp32/fp16 graphs keep standard ops. The onnx package has no schemas for contrib ops
  and the exporter's tracer needs one, so `register_schema` declares the inputs and
  attributes we use, as ONNX Runtime's contrib op documentation gives them (version 1):
  `rotary` (RotaryEmbedding), `skip_rms_norm` (SkipSimplifiedLayerNormalization),
  `group_query_attention` (GroupQueryAttention), `matmul_nbits` (MatMulNBits),
  `gather_block_quantized` (GatherBlockQuantized).
"""
from __future__ import annotations

import torch

OPSET = 24  # the graphs' standard opset: TensorScatter needs 24
BLOCK = 32  # MatMulNBits / GatherBlockQuantized block size along the input dimension
ACCURACY_LEVEL = 4  # MatMulNBits: int8 activations per block (MLAS's fast CPU path)


def aligned(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (element-wise) over x, its last dimension padded with zeros to a multiple of 16 where
    it is not one. ONNX Runtime computes Exp, Sin, Cos, Softplus, Sigmoid and SiLU 16 floats at
    a time and a remainder one by one, and the two paths round differently (measured: Sin over
    6 angles, Softplus over 6 heads, a few ulps): a row must take the same path whatever T is,
    so that a verify pass's rows equal single steps bit for bit."""
    width = x.shape[-1]
    if width % 16 == 0:
        return fn(x)
    return fn(torch.cat((x, x.new_zeros((*x.shape[:-1], 16 - width % 16))), dim=-1))[..., :width]


# -- the KV write (every graph)

@torch.library.custom_op("specdeploy::kv_write", mutates_args=())
def kv_write(cache: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor) -> torch.Tensor:
    """cache [B, H, S, D], update [B, H, T, D], write_indices [B] -> cache with rows written."""
    out = cache.clone()
    t = update.shape[2]
    for b in range(cache.shape[0]):
        i = int(write_indices[b])
        out[b, :, i : i + t] = update[b]
    return out


@kv_write.register_fake
def _(cache, update, write_indices):
    return torch.empty_like(cache)


def kv_write_onnx(cache, update, write_indices):
    from onnxscript import values

    return values.Opset("", OPSET).TensorScatter(cache, update, write_indices, axis=-2)


DOMAIN = "com.microsoft"


def register_schema(name: str, inputs: list[tuple[str, str]], types: dict[str, list[str]], attributes: dict[str, str],
                    optional: tuple[str, ...] = (), outputs: list[tuple[str, str]] | None = None,
                    domain: str = DOMAIN) -> None:
    """`optional` names attributes, inputs and outputs that may be left out; `outputs`
    defaults to one output of the first input's type."""
    import onnx
    from onnx.defs import OpSchema

    if onnx.defs.has(name, domain):
        return
    param = OpSchema.FormalParameter
    option = OpSchema.FormalParameterOption

    def formal(n: str, t: str):
        return param(n, t, param_option=option.Optional if n in optional else option.Single)

    schema = OpSchema(
        name, domain, 1,
        doc=f"{name} ({'ONNX Runtime contrib op' if domain == DOMAIN else 'lowered before the graph is saved'})",
        inputs=[formal(n, t) for n, t in inputs],
        outputs=[formal(n, t) for n, t in (outputs or [("Y", inputs[0][1])])],
        type_constraints=[(t, allowed, t) for t, allowed in types.items()],
        attributes=[
            OpSchema.Attribute(a, getattr(OpSchema.AttrType, kind), a, required=a not in optional)
            for a, kind in attributes.items()
        ],
    )
    onnx.defs.register_schema(schema)


def contrib(name: str):
    from onnxscript import values

    return getattr(values.Opset(DOMAIN, 1), name)


@torch.library.custom_op("specdeploy::rotary", mutates_args=())
def rotary(x: torch.Tensor, position_ids: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
           num_heads: int) -> torch.Tensor:
    """x [B, T, H*D] rotated at position_ids [B, T]: the non-interleaved (rotate-half) RoPE
    of Llama, cos/sin read from caches [P, D/2]. The eager meaning of RotaryEmbedding."""
    b, t, hidden = x.shape
    d = hidden // num_heads
    cos = cos_cache[position_ids][:, :, None]  # [B, T, 1, D/2]
    sin = sin_cache[position_ids][:, :, None]
    xh = x.view(b, t, num_heads, d)
    x1, x2 = xh[..., : d // 2], xh[..., d // 2 :]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.reshape(b, t, hidden)


@rotary.register_fake
def _(x, position_ids, cos_cache, sin_cache, num_heads):
    return torch.empty_like(x)


def rotary_onnx(x, position_ids, cos_cache, sin_cache, num_heads):
    register_schema(
        "RotaryEmbedding",
        [("input", "T"), ("position_ids", "M"), ("cos_cache", "T"), ("sin_cache", "T")],
        {"T": ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "M": ["tensor(int64)"]},
        {"interleaved": "INT", "num_heads": "INT"},
    )
    return contrib("RotaryEmbedding")(x, position_ids, cos_cache, sin_cache, interleaved=0, num_heads=num_heads)


def rope_caches(inv_freq: torch.Tensor, scale: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, D/2] in float32, computed as the standard-op graph computes them."""
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq.float()[None]
    return freqs.cos() * scale, freqs.sin() * scale


# -- the fused graph (--attention fused): residual + norm, and attention with its rotary
#    embedding and KV write, one node each.

@torch.library.custom_op("specdeploy::skip_rms_norm", mutates_args=())
def skip_rms_norm(x: torch.Tensor, skip: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + skip) * weight, x + skip): the eager meaning of
    SkipSimplifiedLayerNormalization's first and fourth outputs (the residual stream goes on)."""
    total = x + skip
    t32 = total.float()
    normed = (t32 / torch.sqrt(t32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight.to(x.dtype) * normed, total


@skip_rms_norm.register_fake
def _(x, skip, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


def skip_rms_norm_onnx(x, skip, weight, eps):
    register_schema(
        "SkipSimplifiedLayerNormalization",
        [("input", "T"), ("skip", "T"), ("gamma", "T")],
        {"T": ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "U": ["tensor(float)"]},
        {"epsilon": "FLOAT"},
        optional=("epsilon", "mean", "inv_std_var", "input_skip_bias_sum"),
        outputs=[("output", "T"), ("mean", "U"), ("inv_std_var", "U"), ("input_skip_bias_sum", "T")],
    )
    normed, _, _, total = contrib("SkipSimplifiedLayerNormalization")(x, skip, weight, epsilon=eps)
    return normed, total


def attention_reference(q, k, v, key_cache, value_cache, write_indices, mask, scaling: float,
                        write, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped-query attention over the static KV buffers, q/k/v [B, heads, T, D] already
    rotated: write k/v at write_indices with `write`, attend to the first L slots under the
    additive mask [B, 1, 1, T, L]. The exact graph's attention, and the eager meaning of the
    fused one. `softcap` (Gemma 2): scores -> softcap * tanh(scores / softcap) before the mask.
    `sinks` [heads] (gpt-oss): each head's logit joins the softmax as one more column, which is
    dropped after it (its weight is what the head gives to no token)."""
    b, heads, t, d = q.shape
    kv_heads = key_cache.shape[1]
    groups = heads // kv_heads
    window = mask.shape[-1]
    if k is not None:  # None: a layer that reads another layer's K/V (Gemma 4's shared layers) writes none
        key_cache = write(key_cache, k.to(key_cache.dtype), write_indices)
        value_cache = write(value_cache, v.to(value_cache.dtype), write_indices)
    keys = key_cache[:, :, :window].to(q.dtype)  # [B, Hkv, L, D]: slots past the length are never read
    values = value_cache[:, :, :window].to(q.dtype)
    # The G query heads that share a KV head are stacked as G*T rows of one plain matmul.
    qg = q.reshape(b, kv_heads, groups * t, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scaling  # [B, Hkv, G*T, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, kv_heads, groups, t, window) + mask
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    else:
        sink = sinks.float().view(1, kv_heads, groups, 1, 1).expand(b, kv_heads, groups, t, 1)
        # the sink first: each score keeps its column whatever the pass's L (a row's sum then
        # adds in the same order in a verify pass as in a single step, where the masked columns
        # past it add zeros; put last, it moved with L and the rows differed by an ulp)
        probs = torch.softmax(torch.cat((sink, scores.float()), dim=-1), dim=-1)[..., 1:].to(q.dtype)
    out = torch.matmul(probs.view(b, kv_heads, groups * t, window), values)  # [B, Hkv, G*T, D]
    out = out.reshape(b, heads, t, d).transpose(1, 2).reshape(b, t, heads * d)
    return out, key_cache, value_cache


def fused_attention_eager(qkv, key_cache, value_cache, write_indices, attention_mask, cos_cache, sin_cache,
                          num_heads: int, kv_heads: int, scaling: float, write):
    """The eager meaning of GroupQueryAttention over packed q|k|v [B, T, (H + 2 Hkv) D]:
    rotate q and k at their positions (the write index onwards), then attention_reference."""
    b, t, _ = qkv.shape
    d = key_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, kv_heads * d, kv_heads * d], dim=-1)
    positions = write_indices[:, None] + torch.arange(t, device=qkv.device)
    q = rotary(q, positions, cos_cache.to(q.dtype), sin_cache.to(q.dtype), num_heads)
    k = rotary(k, positions, cos_cache.to(k.dtype), sin_cache.to(k.dtype), kv_heads)
    shape = lambda x, h: x.reshape(b, t, h, d).transpose(1, 2)  # noqa: E731
    return attention_reference(shape(q, num_heads), shape(k, kv_heads), shape(v, kv_heads), key_cache, value_cache,
                               write_indices, attention_mask[:, :, None].to(q.dtype), scaling, write)


@torch.library.custom_op("specdeploy::group_query_attention", mutates_args=())
def group_query_attention(
    qkv: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, write_indices: torch.Tensor,
    attention_mask: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor, num_heads: int, kv_heads: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attention output [B, T, H*D], key cache, value cache written): see fused_attention_eager."""
    return fused_attention_eager(qkv, key_cache, value_cache, write_indices, attention_mask, cos_cache, sin_cache,
                                 num_heads, kv_heads, scaling, kv_write)


@group_query_attention.register_fake
def _(qkv, key_cache, value_cache, write_indices, attention_mask, cos_cache, sin_cache, num_heads, kv_heads, scaling):
    d = key_cache.shape[-1]
    return qkv.new_empty((*qkv.shape[:2], num_heads * d)), torch.empty_like(key_cache), torch.empty_like(value_cache)


def group_query_attention_onnx(qkv, key_cache, value_cache, write_indices, attention_mask, cos_cache, sin_cache,
                               num_heads, kv_heads, scaling):
    """GroupQueryAttention with past and present sharing one buffer (ONNX Runtime shares them
    when both are bound to the same memory, as the runtime binds every KV buffer): sequence b's
    T new rows are written at slots write_indices[b] .. write_indices[b] + T - 1 (its
    seqlens_k: the last row's slot), and each row attends causally over its own sequence's
    slots up to it; total = L (the mask's last dim), the longest. The mask's values are not
    read: this graph serves contiguous causal passes only (prefill, steps, chain verification),
    one sequence or a batch of them."""
    from onnxscript import values

    register_schema(
        "GroupQueryAttention",
        [("query", "T"), ("key", "T"), ("value", "T"), ("past_key", "T"), ("past_value", "T"),
         ("seqlens_k", "M"), ("total_sequence_length", "M"), ("cos_cache", "T"), ("sin_cache", "T")],
        {"T": ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "M": ["tensor(int32)"]},
        {"num_heads": "INT", "kv_num_heads": "INT", "do_rotary": "INT", "rotary_interleaved": "INT", "scale": "FLOAT",
         "local_window_size": "INT"},
        optional=("key", "value", "past_key", "past_value", "cos_cache", "sin_cache", "do_rotary", "rotary_interleaved",
                  "scale", "local_window_size"),
        outputs=[("output", "T"), ("present_key", "T"), ("present_value", "T")],
    )
    op = values.Opset("", 24)
    total = op.Shape(attention_mask, start=3, end=4)  # [1]: L
    rows = op.Shape(qkv, start=1, end=2)  # [1]: T
    seqlens = op.Cast(op.Sub(op.Add(write_indices, rows), op.Constant(value_ints=[1])), to=6)  # [B] int32
    return contrib("GroupQueryAttention")(
        qkv, None, None, key_cache, value_cache, seqlens, op.Cast(op.Squeeze(total), to=6), cos_cache, sin_cache,
        num_heads=num_heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0, scale=scaling,
    )


# -- weight-only quantized linears and embeddings (int8/int4 graphs)

def unpack_nbits(packed: torch.Tensor, zero_points: torch.Tensor | None, k: int, n: int, bits: int,
                 block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """MatMulNBits' B and zero points -> the values q [N, K/block, block] and each block's zero
    point [N, K/block], uint8. 4-bit: two a byte, low nibble first (zero points likewise, each
    row padded to whole bytes); no zero points: every block's is 2^(bits - 1), as the op assumes."""
    nb = k // block
    if zero_points is None:
        zero_points = torch.full((n * ((nb + 1) // 2 if bits == 4 else nb),), 0x88 if bits == 4 else 128,
                                 dtype=torch.uint8, device=packed.device)
    if bits == 4:
        q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(n, nb, block)
        zp = torch.stack([zero_points & 0x0F, zero_points >> 4], dim=-1).reshape(n, -1)[:, :nb]
    else:
        q = packed.reshape(n, nb, block)
        zp = zero_points.reshape(n, nb)
    return q, zp


@torch.library.custom_op("specdeploy::matmul_nbits", mutates_args=())
def matmul_nbits(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, k: int, n: int, bits: int,
    block: int = BLOCK,
) -> torch.Tensor:
    """x [..., K] @ dequantized(B)^T -> [..., N]: the eager meaning of MatMulNBits at
    accuracy level 4, whose CPU kernel first quantizes each block (`block`: 16 or 32) of
    activations of a row to int8 (scale = max |x| / 127, round to nearest); done here the same way, so the
    reference and ONNX Runtime differ only in summation order. No zero points: every
    block's is 2^(bits - 1) (symmetric), as MatMulNBits assumes when the input is absent."""
    nb = k // block
    xb = x.reshape(*x.shape[:-1], nb, block)
    scale = xb.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    x = (torch.round(xb * inverse) * scale).reshape(x.shape)
    q, zp = unpack_nbits(packed, zero_points, k, n, bits, block)
    w = (q.float() - zp.float()[..., None]) * scales.reshape(n, nb, 1)
    return torch.matmul(x, w.reshape(n, k).to(x.dtype).t())


@matmul_nbits.register_fake
def _(x, packed, scales, zero_points, k, n, bits, block=BLOCK):
    return x.new_empty((*x.shape[:-1], n))


def matmul_nbits_onnx(x, packed, scales, zero_points, k, n, bits, block=BLOCK):
    register_schema(
        "MatMulNBits",
        [("A", "T1"), ("B", "T2"), ("scales", "T1"), ("zero_points", "T3")],
        {"T1": ["tensor(float)", "tensor(float16)"], "T2": ["tensor(uint8)"], "T3": ["tensor(uint8)"]},
        {"K": "INT", "N": "INT", "bits": "INT", "block_size": "INT", "accuracy_level": "INT"},
        optional=("accuracy_level", "zero_points"),
    )
    return contrib("MatMulNBits")(
        x, packed, scales, zero_points, K=k, N=n, bits=bits, block_size=block, accuracy_level=ACCURACY_LEVEL
    )


@torch.library.custom_op("specdeploy::gather_block_quantized", mutates_args=())
def gather_block_quantized(packed: torch.Tensor, ids: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The rows `ids` of a symmetric 4-bit table [N, K] (packed as MatMulNBits' B: two
    values a byte, low nibble first; one scale per block of 32; zero point 8), dequantized:
    the eager meaning of GatherBlockQuantized (gather_axis 0, quantize_axis 1)."""
    nb = k // BLOCK
    rows = packed.reshape(n, k // 2)[ids]  # [..., K/2]
    q = torch.stack([rows & 0x0F, rows >> 4], dim=-1).reshape(*ids.shape, nb, BLOCK)
    return ((q.float() - 8) * scales.reshape(n, nb)[ids][..., None]).reshape(*ids.shape, k)


@gather_block_quantized.register_fake
def _(packed, ids, scales, n, k):
    return scales.new_empty((*ids.shape, k))


def gather_block_quantized_onnx(packed, ids, scales, n, k):
    from onnxscript import values

    register_schema(
        "GatherBlockQuantized",
        [("data", "T1"), ("indices", "Tind"), ("scales", "T2")],
        {"T1": ["tensor(uint8)"], "Tind": ["tensor(int64)", "tensor(int32)"], "T2": ["tensor(float)", "tensor(float16)"]},
        {"gather_axis": "INT", "quantize_axis": "INT", "block_size": "INT", "bits": "INT"},
        outputs=[("output", "T2")],
    )
    std = values.Opset("", 18)
    data = std.Reshape(packed, std.Constant(value_ints=[n, k // 2]))
    table_scales = std.Reshape(scales, std.Constant(value_ints=[n, k // BLOCK]))
    return contrib("GatherBlockQuantized")(data, ids, table_scales, gather_axis=0, quantize_axis=1, block_size=BLOCK, bits=4)


def onnx_translations() -> dict:
    """The exporter's custom translation table: each custom op -> the ONNX function above."""
    from .recurrent import gated_delta_rule_onnx

    ops = torch.ops.specdeploy
    return {
        ops.gated_delta_rule.default: gated_delta_rule_onnx,
        ops.kv_write.default: kv_write_onnx,
        ops.matmul_nbits.default: matmul_nbits_onnx,
        ops.gather_block_quantized.default: gather_block_quantized_onnx,
        ops.rotary.default: rotary_onnx,
        ops.skip_rms_norm.default: skip_rms_norm_onnx,
        ops.group_query_attention.default: group_query_attention_onnx,
    }
