"""ONNX Runtime contrib ops (domain com.microsoft) the CPU graphs use, as PyTorch custom ops.

Each op has an eager meaning (the parity reference and the torch backend) and a translation
for the exporter. The onnx package has no schemas for contrib ops and the exporter's tracer
needs one, so `register_schema` declares the inputs and attributes we use, as ONNX
Runtime's contrib op documentation gives them (com.microsoft, version 1).

Only the int8/int4 graphs use them: they are for ONNX Runtime's CPU provider, and
TensorRT's ONNX parser does not read them (the fp32/fp16 graphs keep standard ops).
"""
from __future__ import annotations

import torch

DOMAIN = "com.microsoft"


def register_schema(name: str, inputs: list[tuple[str, str]], types: dict[str, list[str]], attributes: dict[str, str],
                    optional: tuple[str, ...] = ()) -> None:
    import onnx
    from onnx.defs import OpSchema

    if onnx.defs.has(name, DOMAIN):
        return
    param = OpSchema.FormalParameter
    schema = OpSchema(
        name, DOMAIN, 1,
        doc=f"{name} (ONNX Runtime contrib op)",
        inputs=[param(n, t) for n, t in inputs],
        outputs=[param("Y", inputs[0][1])],
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
        {"T": ["tensor(float)", "tensor(float16)"], "M": ["tensor(int64)"]},
        {"interleaved": "INT", "num_heads": "INT"},
    )
    return contrib("RotaryEmbedding")(x, position_ids, cos_cache, sin_cache, interleaved=0, num_heads=num_heads)


def rope_caches(inv_freq: torch.Tensor, scale: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, D/2] in float32, computed as the standard-op graph computes them."""
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq.float()[None]
    return freqs.cos() * scale, freqs.sin() * scale
