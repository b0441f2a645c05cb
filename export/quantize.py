"""Weight-only block quantization of a graph's linear layers, as ONNX Runtime `MatMulNBits`.

Two schemes, both in blocks of 32 weights along the input dimension (one block: one
scale, and a zero point or a minimum):

    int4   4-bit, asymmetric: w = d * q + m, q in 0..15 (GGUF's Q4_1; Q4_0 is d * (q - 8))
    int8   8-bit, symmetric:  w = d * (q - 128), q in 0..255 (GGUF's Q8_0)

Under the exact scheme (QUANT_SCHEMES) the output head is int8: it is a fifth of a small
model's compute and the logits decide every token, so it keeps the finer grid, and the
token embedding stays float. The fast scheme puts both in 4 bits, the embedding in the
tied head's own blocks (a lookup reads one row per token: mostly a smaller file). The KV
cache stays float.

Where the source is a GGUF file whose tensors already hold the scheme's blocks, they are
imported exactly: each block's scale, minimum and 4-/8-bit values are repacked, never
re-quantized, and the import is checked by dequantizing it and comparing with the float
weights transformers read from the same file (they must be equal). Any other source is
quantized from its float weights (round to nearest per block).

In the graph a quantized linear is one `com.microsoft::MatMulNBits` node (B packed, one
scale per block, uint8 zero points) with `accuracy_level` 4: activations are quantized
to int8 per block of each row, so rows never share a scale and a verify pass's rows equal
single steps bit for bit (tests/test_quant.py checks it). Q4_1's minimum is one extra
term: x @ M^T over blocks is (per-block sums of x) @ mins, an fp32 MatMul 1/32 the size.
In PyTorch eager (the parity reference and the torch backend) the same op dequantizes the
blocks and multiplies in float32.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specdeploy.core.errors import ExportError
from specdeploy.core.choices import QUANT_SCHEMES

from .ops import ACCURACY_LEVEL, BLOCK, gather_block_quantized, matmul_nbits

SCHEMES = {"int4": 4, "int8": 8}
HEAD_BITS = 8
# --quant-scheme: where the blocks come from and their form.
#   exact  the source's own blocks where it has them (a GGUF's Q4_0/Q4_1/Q8_0, imported
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
# GGUF block types imported as they are: bytes per block, and which scheme holds them exactly.
GGUF_BLOCKS = {"Q4_0": (18, 4), "Q4_1": (20, 4), "Q8_0": (34, 8)}


@dataclass
class Blocks:
    """One weight [N, K] as blocks along K: w = (q - zero) * scale (+ mins)."""

    bits: int
    q: np.ndarray  # uint8 [N, K]
    scale: np.ndarray  # float32 [N, K/32]
    zero: np.ndarray  # uint8 [N, K/32]
    mins: np.ndarray | None  # float32 [N, K/32], or None
    origin: str  # "float" (quantized here) or the GGUF block type imported exactly

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dequantize(self) -> np.ndarray:
        n, k = self.q.shape
        q = self.q.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
        w = (q - self.zero[..., None].astype(np.float32)) * self.scale[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(n, k)

    @staticmethod
    def concat(parts: list["Blocks"]) -> "Blocks":
        """Blocks of several weights stacked along N (one node for projections of one input)."""
        if len({(p.bits, p.mins is None) for p in parts}) != 1:
            raise ExportError("cannot fuse projections quantized in different formats")
        cat = lambda f: np.concatenate([f(p) for p in parts])  # noqa: E731
        mins = None if parts[0].mins is None else cat(lambda p: p.mins)
        origins = sorted({p.origin for p in parts})
        return Blocks(parts[0].bits, cat(lambda p: p.q), cat(lambda p: p.scale), cat(lambda p: p.zero), mins, "+".join(origins))

    def take_rows(self, rows: np.ndarray) -> "Blocks":
        pick = lambda a: None if a is None else a[rows]  # noqa: E731
        return Blocks(self.bits, self.q[rows], self.scale[rows], self.zero[rows], pick(self.mins), self.origin)


def quantize_float(w: np.ndarray, bits: int, zero: str = "min") -> Blocks:
    """Round-to-nearest block quantization of float weights [N, K] (K a multiple of 32).

    4-bit `zero`: "min" (w = d q + m, a float minimum per block: GGUF's Q4_1), "int" (w = d (q - z),
    an integer zero point per block: MatMulNBits needs no extra term) or "none" (symmetric,
    w = d (q - 8): the extreme value of each block lands on -8, the full range used)."""
    n, k = w.shape
    b = w.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    if bits == 4 and zero == "none":
        extreme = np.take_along_axis(b, np.abs(b).argmax(-1)[..., None], -1)[..., 0]
        d = (extreme / -8).astype(np.float32)
        safe = np.where(d != 0, d, 1)
        q = np.clip(np.rint(b / safe[..., None]), -8, 7) + 8
        return Blocks(4, q.astype(np.uint8).reshape(n, k), d, np.full(d.shape, 8, dtype=np.uint8), None, "float")
    if bits == 4:  # asymmetric: a step that spans the block's minimum to its maximum
        lo, hi = np.minimum(b.min(-1), 0) if zero == "int" else b.min(-1), b.max(-1)
        if zero == "int":  # the zero point is an integer: the grid must hold 0 exactly
            hi = np.maximum(hi, 0)
        d = ((hi - lo) / 15).astype(np.float32)
        safe = np.where(d > 0, d, 1)
        if zero == "int":
            z = np.clip(np.rint(-lo / safe), 0, 15)
            q = np.clip(np.rint(b / safe[..., None]) + z[..., None], 0, 15)
            return Blocks(4, q.astype(np.uint8).reshape(n, k), d, z.astype(np.uint8), None, "float")
        q = np.clip(np.rint((b - lo[..., None]) / safe[..., None]), 0, 15)
        return Blocks(4, q.astype(np.uint8).reshape(n, k), d, np.zeros_like(d, dtype=np.uint8), lo.astype(np.float32), "float")
    d = (np.abs(b).max(-1) / 127).astype(np.float32)
    safe = np.where(d > 0, d, 1)
    q = np.clip(np.rint(b / safe[..., None]), -127, 127) + 128
    return Blocks(8, q.astype(np.uint8).reshape(n, k), d, np.full(d.shape, 128, dtype=np.uint8), None, "float")


def gguf_blocks(kind: str, raw: np.ndarray, n: int, k: int) -> Blocks:
    """Decode a GGUF tensor's raw blocks (ggml's layout) into `Blocks`, values unchanged.

    Q4_0/Q4_1 hold a block's 32 values as 16 bytes: byte j has value j in its low nibble
    and value j + 16 in its high nibble. d and m are float16 (exact in float32)."""
    size, _ = GGUF_BLOCKS[kind]
    blocks = np.ascontiguousarray(raw).reshape(n, k // BLOCK, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 128
        return Blocks(8, q.astype(np.uint8).reshape(n, k), d, np.full(d.shape, 128, dtype=np.uint8), None, kind)
    qs = blocks[..., -16:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return Blocks(4, q, d, np.zeros(d.shape, dtype=np.uint8), m, kind)
    return Blocks(4, q, d, np.full(d.shape, 8, dtype=np.uint8), None, kind)


def pack(blocks: Blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' initializers: B uint8 [N, K/32, 32*bits/8], scales float32 [N*K/32],
    zero points uint8 (4-bit: two per byte along K, each row padded to whole bytes)."""
    n, k = blocks.q.shape
    nb = k // BLOCK
    if blocks.bits == 4:
        pairs = blocks.q.reshape(n, nb, BLOCK // 2, 2)
        packed = pairs[..., 0] | (pairs[..., 1] << 4)
        zero = blocks.zero
        if nb % 2:
            zero = np.concatenate([zero, np.zeros((n, 1), dtype=np.uint8)], axis=1)
        zp = (zero[:, 0::2] | (zero[:, 1::2] << 4)).reshape(-1)
    else:
        packed = blocks.q.reshape(n, nb, BLOCK)
        zp = blocks.zero.reshape(-1)
    return np.ascontiguousarray(packed, dtype=np.uint8), blocks.scale.reshape(-1).astype(np.float32), zp.astype(np.uint8)


class QuantLinear(nn.Module):
    """A linear layer over `Blocks`: MatMulNBits, plus the block minimum term, plus bias."""

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None, split: list[int] | None = None):
        super().__init__()
        n, k = blocks.shape
        self.split = split  # output widths of the fused projections, or None
        self.in_features, self.out_features, self.bits = k, n, blocks.bits
        packed, scales, zp = pack(blocks)
        self.register_buffer("packed", torch.from_numpy(packed))
        self.register_buffer("scales", torch.from_numpy(scales))
        symmetric = bool((blocks.zero == 1 << (blocks.bits - 1)).all())  # the op's default: the input left out
        self.register_buffer("zero_points", None if symmetric else torch.from_numpy(zp))
        mins = None if blocks.mins is None else torch.from_numpy(np.ascontiguousarray(blocks.mins.T))  # [K/32, N]
        self.register_buffer("mins", mins)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul_nbits(x, self.packed, self.scales, self.zero_points, self.in_features, self.out_features, self.bits)
        if self.mins is not None:
            sums = x.reshape(*x.shape[:-1], self.in_features // BLOCK, BLOCK).sum(-1)
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


def _llama_rows(n: int, heads: int) -> np.ndarray:
    """The row order transformers restores for a llama GGUF's attn_q / attn_k (llama.cpp's
    converter interleaves each head's rotary halves)."""
    dim = n // heads // 2
    return np.arange(n).reshape(heads, dim, 2).swapaxes(2, 1).reshape(n)


class GgufWeights:
    """A GGUF file's block-quantized tensors, by name, decoded on demand."""

    def __init__(self, path: Path):
        import gguf

        self.path = path
        self.tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}

    def blocks(self, name: str, bits: int, want: np.ndarray, heads: int | None) -> Blocks | None:
        """The tensor's own blocks when they are of `bits` and dequantize exactly to `want`
        (the float weight transformers loaded); None when the file cannot give that."""
        tensor = self.tensors.get(name)
        kind = None if tensor is None else tensor.tensor_type.name
        if kind not in GGUF_BLOCKS or GGUF_BLOCKS[kind][1] != bits:
            return None
        n, k = want.shape
        if int(tensor.n_elements) != n * k:
            return None
        blocks = gguf_blocks(kind, tensor.data, n, k)
        orders = [None] + ([_llama_rows(n, heads)] if heads else [])
        for rows in orders:
            candidate = blocks if rows is None else blocks.take_rows(rows)
            if np.array_equal(candidate.dequantize(), want):
                return candidate
        return None


def quantize_model(model: nn.Module, scheme: str, gguf_path: Path | None = None, num_layers: int | None = None,
                   quant_scheme: str = "exact", **choices) -> dict:
    """Replace the model's projections (scheme; the first `num_layers` layers) and output
    head with QuantLinear, in place, as `quant_scheme` says (QUANT_SCHEMES; `choices`
    override its entries). Returns the record the manifest keeps: what was quantized and how."""
    if scheme not in SCHEMES:
        raise ExportError(f"quantization {scheme!r}: expected one of {', '.join(SCHEMES)}")
    if quant_scheme not in QUANT_SCHEMES:
        raise ExportError(f"--quant-scheme {quant_scheme!r}: expected one of {', '.join(QUANT_SCHEMES)}")
    plan = {**SCHEME_PLANS[quant_scheme], **choices}
    plan["head_bits"] = plan["head_bits"] or SCHEMES[scheme]
    cfg = model.config
    source = GgufWeights(gguf_path) if gguf_path is not None and plan["source_blocks"] else None
    counts: dict[str, int] = {}

    def blocks_for(linear: nn.Module, gguf_name: str, bits: int, heads: int | None, what: str):
        weight = linear.weight.detach().float().numpy()
        n, k = weight.shape
        if k % BLOCK:
            raise ExportError(f"{what}: input dimension {k} is not a multiple of the {BLOCK}-weight block; use --dtype fp32")
        blocks = source.blocks(gguf_name, bits, weight, heads) if source is not None else None
        if blocks is None:
            blocks = quantize_float(weight, bits, plan["zero"])
        key = f"{blocks.origin}->int{bits}"
        counts[key] = counts.get(key, 0) + 1
        return blocks, linear.bias

    bits = SCHEMES[scheme]
    for i, layer in enumerate(list(model.model.layers)[:num_layers]):
        # Projections that read the same input become one MatMulNBits (and one block-minimum
        # term): q/k/v, and gate/up where they carry a minimum term. Fewer, larger nodes: on
        # a CPU at T = 1 the per-node cost is a large part of a step.
        for owner_name, fused_name, names in (
            ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
        ):
            owner = getattr(layer, owner_name)
            parts = []
            for attr in names:
                heads = None
                if cfg.model_type == "llama" and attr in ("q_proj", "k_proj"):
                    heads = cfg.num_attention_heads if attr == "q_proj" else cfg.num_key_value_heads
                gguf_name = f"blk.{i}.{PROJECTIONS[f'{owner_name}.{attr}']}.weight"
                parts.append(blocks_for(getattr(owner, attr), gguf_name, bits, heads, f"layer {i} {owner_name}.{attr}"))
            if owner_name == "mlp" and parts[0][0].mins is None:
                # Without a minimum term to share, gate and up stay two nodes: fused, their
                # output's Split costs more than the second node (measured: docs/backends.md, "Exact and fused graphs").
                for attr, (blocks, bias) in zip(names, parts):
                    setattr(owner, attr, QuantLinear(blocks, bias))
                continue
            fused = Blocks.concat([b for b, _ in parts])
            biases = [bias if bias is not None else torch.zeros(b.shape[0]) for b, bias in parts]
            bias = None if all(bias is None for _, bias in parts) else torch.cat([x.detach().float() for x in biases])
            setattr(owner, fused_name, QuantLinear(fused, bias, split=[b.shape[0] for b, _ in parts]))
            for attr in names:
                delattr(owner, attr)
        for owner_name, attr in (("self_attn", "o_proj"), ("mlp", "down_proj")):
            owner = getattr(layer, owner_name)
            gguf_name = f"blk.{i}.{PROJECTIONS[f'{owner_name}.{attr}']}.weight"
            blocks, bias = blocks_for(getattr(owner, attr), gguf_name, bits, None, f"layer {i} {owner_name}.{attr}")
            setattr(owner, attr, QuantLinear(blocks, bias))
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    head_name = "token_embd.weight" if tied or (source and "output.weight" not in source.tensors) else "output.weight"
    blocks, bias = blocks_for(model.lm_head, head_name, plan["head_bits"], None, "lm_head")
    model.lm_head = QuantLinear(blocks, bias)
    embedding = "float32"
    if plan["embedding_bits"] and bits == 4:  # an int8 bundle's embedding stays float: no finer than its linears
        table = model.lm_head if tied and blocks.bits == 4 and model.lm_head.zero_points is None and blocks.mins is None \
            else QuantLinear(quantize_float(model.model.embed_tokens.weight.detach().float().numpy(), 4, "none"), None)
        n, k = table.out_features, table.in_features
        model.model.embed_tokens = QuantEmbedding(table.packed, table.scales, n, k)
        embedding = "int4 (the head's blocks)" if table is model.lm_head else "int4"
    imported = sum(v for key, v in counts.items() if not key.startswith("float"))
    return {
        "scheme": scheme,
        "quant_scheme": quant_scheme,
        "zero": plan["zero"] if bits == 4 else "none",
        "method": "weight-only, blocks of 32 along the input dimension, MatMulNBits",
        "block_size": BLOCK,
        "accuracy_level": ACCURACY_LEVEL,
        "linear_bits": bits,
        "head_bits": plan["head_bits"],
        "embedding": embedding,
        "tensors": dict(sorted(counts.items())),  # "<origin>-><int bits>": count
        "imported_exactly": imported,
        "quantized_from_float": sum(counts.values()) - imported,
        "source": str(gguf_path) if gguf_path is not None else None,
    }


__all__ = ["Blocks", "QuantEmbedding", "QuantLinear", "SCHEMES", "gather_block_quantized", "gguf_blocks", "matmul_nbits",
           "quantize_float", "quantize_model"]
