"""Weight-only block quantization of a graph's linear layers, as ONNX Runtime `MatMulNBits`.

Two schemes for weights quantized here, both in blocks of 32 along the input dimension (one block: one
scale, and a zero point or a minimum):

    int4   4-bit, asymmetric: w = d * q + m, q in 0..15 (GGUF's Q4_1; Q4_0 is d * (q - 8))
    int8   8-bit, symmetric:  w = d * (q - 128), q in 0..255 (GGUF's Q8_0)

Under the exact scheme (QUANT_SCHEMES) the output head is int8: it is a fifth of a small
model's compute and the logits decide every token, so it keeps the finer grid, and the
token embedding stays float. The fast scheme puts both in 4 bits, the embedding in the
tied head's own blocks (a lookup reads one row per token: mostly a smaller file). The KV
cache stays float.

Where the source is a GGUF file, its block-quantized tensors are imported exactly, whatever
their type (export/gguf_blocks.py: Q4_0 ... Q8_0, the K-quants Q2_K ... Q6_K, IQ4_NL, IQ4_XS):
each block's scale, minimum and values are repacked, never re-quantized, in blocks of 16 or
32 and 4- or 8-bit storage, and the import is checked by dequantizing it and comparing with
the float weights transformers read from the same file (they must be equal). Only the
file's float tensors (and any other source) are quantized here, from their float weights
(round to nearest per block of 32), and export names each such GGUF tensor on the terminal.

In the graph a quantized linear is one `com.microsoft::MatMulNBits` node (B packed, one
scale per block, uint8 zero points, the block's own size) with `accuracy_level` 4: activations are quantized
to int8 per block of each row, so rows never share a scale and a verify pass's rows equal
single steps bit for bit (tests/test_quant.py checks it). Q4_1's minimum is one extra
term: x @ M^T over blocks is (per-block sums of x) @ mins, an fp32 MatMul 1/32 the size
(1/16 for a K-quant's blocks of 16).
In PyTorch eager (the parity reference and the torch backend) the same op dequantizes the
blocks and multiplies in float32.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdeploy.core.errors import ExportError
from specdeploy.core.choices import QUANT_SCHEMES

from .architectures import architecture
from .blocks import Blocks, pack, quantize_float
from .gguf_blocks import GGUF_TYPES, GgufWeights, gguf_blocks
from .ops import ACCURACY_LEVEL, BLOCK, gather_block_quantized, matmul_nbits

SCHEMES = {"int4": 4, "int8": 8}
HEAD_BITS = 8
# --quant-scheme: where the blocks come from and their form.
#   exact  the source's own blocks where it has them (a GGUF's, of any type, imported
#          unchanged), else round to nearest with a float minimum (Q4_1's form); head int8
#   fast   round to nearest from the float weights with the form ONNX Runtime's kernels run
#          fastest (symmetric: no minimum term, no zero points), the head in the same bits,
#          and at int4 the token embedding in the head's 4-bit blocks (GatherBlockQuantized;
#          tied weights share them)
SCHEME_PLANS = {  # one per core QUANT_SCHEMES name
    "exact": {"source_blocks": True, "zero": "min", "head_bits": HEAD_BITS, "embedding_bits": None},
    "fast": {"source_blocks": False, "zero": "none", "head_bits": None, "embedding_bits": 4},  # None: the linears' bits
}
assert tuple(SCHEME_PLANS) == QUANT_SCHEMES
PROJECTIONS = {  # HF module path within a layer -> GGUF tensor name within blk.N
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
class QuantLinear(nn.Module):
    """A linear layer over `Blocks`: MatMulNBits, plus the block minimum term, plus bias."""

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None, split: list[int] | None = None):
        super().__init__()
        n, k = blocks.shape
        self.split = split  # output widths of the fused projections, or None
        self.in_features, self.out_features, self.bits, self.block = k, n, blocks.bits, blocks.block
        packed, scales, zp = pack(blocks)
        self.register_buffer("packed", torch.from_numpy(packed))
        self.register_buffer("scales", torch.from_numpy(scales))
        symmetric = bool((blocks.zero == 1 << (blocks.bits - 1)).all())  # the op's default: the input left out
        self.register_buffer("zero_points", None if symmetric else torch.from_numpy(zp))
        mins = None if blocks.mins is None else torch.from_numpy(np.ascontiguousarray(blocks.mins.T))  # [K/block, N]
        self.register_buffer("mins", mins)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul_nbits(x, self.packed, self.scales, self.zero_points, self.in_features, self.out_features, self.bits,
                         self.block)
        if self.mins is not None:
            sums = x.reshape(*x.shape[:-1], self.in_features // self.block, self.block).sum(-1)
            y = y + torch.matmul(sums, self.mins.to(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y


class QuantEmbedding(nn.Module):
    """A token embedding over symmetric 4-bit blocks (a lookup of one row per token, dequantized
    on the fly): the tied head's own blocks, or the embedding's."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, n: int, k: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = n, k
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return gather_block_quantized(self.packed, ids, self.scales, self.num_embeddings, self.embedding_dim)

    @classmethod
    def of(cls, weight: torch.Tensor) -> "QuantEmbedding":
        """A float table [n, k] rounded to symmetric 4-bit blocks (round to nearest per block)."""
        table = QuantLinear(quantize_float(weight.detach().float().numpy(), 4, "none"), None)
        return cls(table.packed, table.scales, table.out_features, table.in_features)


def _layer_groups(arch) -> list[tuple[str, str, tuple[tuple[str, str], ...]]]:
    """A layer's projections as (owner, fused name, ((module, GGUF tensor), ...)), one group per
    input they read: packed in the source (Phi-3's qkv_proj, gate_up_proj) or fused here."""
    qkv = (("qkv_proj", "attn_qkv"),) if arch.packed_qkv else \
        (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"))
    gate_up = (("gate_up_proj", "ffn_up"),) if arch.packed_gate_up else (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"))
    groups = [("self_attn", "qkv_proj", qkv), ("mlp", "gate_up_proj", gate_up),
              ("self_attn", "o_proj", (("o_proj", "attn_output"),)), ("mlp", "down_proj", (("down_proj", "ffn_down"),))]
    if arch.linear_attention:  # Qwen3.5's Gated DeltaNet layers: their three wide projections (a and b: a few rows)
        groups += [("linear_attn", name, ((name, tensor),)) for name, tensor in
                   (("in_proj_qkv", "attn_qkv"), ("in_proj_z", "attn_gate"), ("out_proj", "ssm_out"))]
    if arch.layer_configs:  # Gemma 4's experts block beside the MLP (export/experts.py), where a layer has one
        groups += [("experts", "gate_up_proj", (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"))),
                   ("experts", "down_proj", (("down_proj", "ffn_down_exps"),))]
    return groups


def _key(blocks: Blocks) -> str:
    """How the manifest counts a tensor: "<origin>-><storage>", the block size where it is not 32."""
    return f"{blocks.origin}->int{blocks.bits}" + ("" if blocks.block == BLOCK else f"/{blocks.block}")


def quantize_model(model: nn.Module, scheme: str, gguf_path: Path | None = None, num_layers: int | None = None,
                   quant_scheme: str = "exact", **choices) -> dict:
    """Replace the model's projections (scheme; the first `num_layers` layers) and output
    head with QuantLinear, in place, as `quant_scheme` says (QUANT_SCHEMES; `choices`
    override its entries). Returns the record the manifest keeps: what was quantized and how.

    A GGUF source's block-quantized tensors are imported as they are, whatever their type
    (export/gguf_blocks.py), under any --dtype: a Q6_K tensor in an int4 export stays 6-bit,
    never rounded a second time. `scheme` sets the bits of what is quantized here from float
    weights; the record's "not_exact" lists each GGUF tensor that was, and why."""
    if scheme not in SCHEMES:
        raise ExportError(f"quantization {scheme!r}: expected one of {', '.join(SCHEMES)}")
    if quant_scheme not in QUANT_SCHEMES:
        raise ExportError(f"--quant-scheme {quant_scheme!r}: expected one of {', '.join(QUANT_SCHEMES)}")
    plan = {**SCHEME_PLANS[quant_scheme], **choices}
    plan["head_bits"] = plan["head_bits"] or SCHEMES[scheme]
    cfg = model.config
    arch = architecture(cfg)
    source = GgufWeights(gguf_path) if gguf_path is not None and plan["source_blocks"] else None
    counts: dict[str, int] = {}
    not_exact: list[dict] = []

    def blocks_for(linear: nn.Module, gguf_name: str, bits: int, heads: int | None, what: str) -> Blocks:
        weight = linear.weight.detach().float().numpy()
        n, k = weight.shape
        blocks, why = source.blocks(gguf_name, weight, heads) if source is not None else (None, "")
        if blocks is None:
            if k % BLOCK:
                raise ExportError(f"{what}: input dimension {k} is not a multiple of the {BLOCK}-weight block; "
                                  "use --dtype fp32")
            blocks = quantize_float(weight, bits, plan["zero"])
            if source is not None:
                not_exact.append({"tensor": gguf_name, "why": why, "as": _key(blocks)})
        counts[_key(blocks)] = counts.get(_key(blocks), 0) + 1
        return blocks

    bits = SCHEMES[scheme]
    for i, layer in enumerate(list(model.model.layers)[:num_layers]):
        for owner_name, fused_name, names in _layer_groups(arch):
            owner = getattr(layer, owner_name, None)
            if owner is None:  # a layer without an experts block
                continue
            # Gemma 4: a layer that reads another's K/V has no k_proj / v_proj, a k = v layer no v_proj
            names = tuple((attr, tensor) for attr, tensor in names if getattr(owner, attr, None) is not None)
            parts = []
            for attr, tensor in names:
                heads = None  # llama.cpp's converter reorders a llama GGUF's q and k rows
                if cfg.model_type == "llama" and attr in ("q_proj", "k_proj"):
                    heads = cfg.num_attention_heads if attr == "q_proj" else cfg.num_key_value_heads
                linear = getattr(owner, attr)
                parts.append((blocks_for(linear, f"blk.{i}.{tensor}.weight", bits, heads,
                                         f"layer {i} {owner_name}.{attr}"), linear.bias))
            # Projections that read the same input become one MatMulNBits (and one block-minimum
            # term): q/k/v, and gate/up where they carry a minimum term. Fewer, larger nodes: on a
            # CPU at T = 1 the per-node cost is a large part of a step. Parts of different forms
            # (a mixed GGUF's Q4_K beside Q6_K) stay a node each: each keeps its own blocks.
            # Without a minimum term to share, gate and up stay two nodes: fused, their output's
            # Split costs more than the second node (docs/backends.md, "Exact and fused graphs").
            separate = len({b.form for b, _ in parts}) > 1 or (owner_name == "mlp" and parts[0][0].mins is None) \
                or arch.layer_configs  # its projections differ by layer: the graph reads each by name
            if len(parts) == 1 or separate:
                for (attr, _), (blocks, bias) in zip(names, parts):
                    setattr(owner, attr, QuantLinear(blocks, bias))
                continue
            fused = Blocks.concat([b for b, _ in parts])
            biases = [bias if bias is not None else torch.zeros(b.shape[0]) for b, bias in parts]
            bias = None if all(bias is None for _, bias in parts) else torch.cat([x.detach().float() for x in biases])
            setattr(owner, fused_name, QuantLinear(fused, bias, split=[b.shape[0] for b, _ in parts]))
            for attr, _ in names:
                delattr(owner, attr)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    head_name = "token_embd.weight" if tied or (source and "output.weight" not in source.tensors) else "output.weight"
    blocks = blocks_for(model.lm_head, head_name, plan["head_bits"], None, "lm_head")
    model.lm_head = QuantLinear(blocks, model.lm_head.bias)
    embedding = "float32"
    if plan["embedding_bits"] and bits == 4:  # an int8 bundle's embedding stays float: no finer than its linears
        shared = tied and blocks.form == (4, BLOCK, False) and model.lm_head.zero_points is None
        head = model.lm_head
        model.model.embed_tokens = QuantEmbedding(head.packed, head.scales, head.out_features, head.in_features) \
            if shared else QuantEmbedding.of(model.model.embed_tokens.weight)
        embedding = "int4 (the head's blocks)" if shared else "int4"
    per_layer = getattr(model.model, "embed_tokens_per_layer", None)  # Gemma 4's per-layer input table
    per_layer_embedding = None
    if per_layer is not None:
        per_layer_embedding = "float32"
        width = per_layer.weight.shape[1]
        if plan["embedding_bits"] and bits == 4 and width % BLOCK == 0:  # as the main table
            model.model.embed_tokens_per_layer = QuantEmbedding.of(per_layer.weight)
            per_layer_embedding = "int4"
        elif plan["embedding_bits"] and bits == 4:
            per_layer_embedding = f"float32 (its width {width} is not a multiple of the {BLOCK}-value block)"
    from_float = sum(v for key, v in counts.items() if key.startswith("float"))
    return {
        "scheme": scheme,
        "quant_scheme": quant_scheme,
        "zero": plan["zero"] if bits == 4 else "none",
        "method": "weight-only, blocks along the input dimension, MatMulNBits",
        "block_size": BLOCK,  # of the blocks quantized here; a GGUF's own keep theirs ("tensors": "/16")
        "accuracy_level": ACCURACY_LEVEL,
        "linear_bits": bits,
        "head_bits": plan["head_bits"],
        "embedding": embedding,
        **({"per_layer_embedding": per_layer_embedding} if per_layer_embedding else {}),
        "tensors": dict(sorted(counts.items())),  # "<origin>-><int storage bits>[/<block>]": count
        "imported_exactly": sum(counts.values()) - from_float,
        "quantized_from_float": from_float,
        "not_exact": not_exact,  # a GGUF source's tensors quantized here, and why
        "source": str(gguf_path) if gguf_path is not None else None,
    }


__all__ = ["Blocks", "GGUF_TYPES", "QuantEmbedding", "QuantLinear", "SCHEMES", "gather_block_quantized", "gguf_blocks",
           "matmul_nbits", "pack", "quantize_float", "quantize_model"]
