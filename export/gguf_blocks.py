"""A GGUF file's quantized tensors read as `Blocks`, values unchanged (docs/quantization.md, "GGUF import").

Every block type the common files hold (llama.cpp's Q4_0 ... Q8_0, and the K-quants its
Q2_K ... Q6_K and mixed _S/_M files use) has an exact MatMulNBits form:

    type   ggml's formula (per weight)          Blocks: storage, block, zero, minimum
    Q4_0   d (q - 8)                             4-bit, 32, 8
    Q4_1   d q + m                               4-bit, 32, 0, m
    Q5_0   d (q - 16)                            8-bit, 32, 16
    Q5_1   d q + m                               8-bit, 32, 0, m
    Q8_0   d q, q signed                         8-bit, 32, 128
    Q2_K   (d sc) q - (dmin m)                   4-bit, 16, 0, -(dmin m)
    Q3_K   (d (sc - 32)) (q - 4)                 4-bit, 16, 4
    Q4_K   (d sc) q - (dmin m)                   4-bit, 32, 0, -(dmin m)
    Q5_K   (d sc) q - (dmin m)                   8-bit, 32, 0, -(dmin m)
    Q6_K   (d sc) (q - 32)                       8-bit, 16, 32
    IQ4_NL d L[q], L sixteen int8 levels         8-bit, 32, 128 (q stored as L[q] + 128)
    IQ4_XS (d (sc - 32)) L[q]                    8-bit, 32, 128 (likewise)

d and dmin are float16 and a K-quant's sub-block scale sc and minimum m are integers of at
most 8 bits, so d sc and dmin m are exact in float32: one float32 scale (and minimum) per
block of 16 or 32 holds the super-block's two levels with nothing rounded. 5- and 6-bit
values sit in 8-bit storage with their offset as the zero point, and IQ4's non-uniform levels,
being int8 values, sit there too. `Blocks.dequantize` computes (q - zero) * scale + min, the
same operations in the same order as gguf-py's dequantizer, and the tests hold the two equal
bit for bit.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specdeploy.core.errors import ExportError

from .blocks import Blocks

QK_K = 256  # weights in a K-quant super-block
# type -> (bytes per super-block, weights per super-block, storage bits, weights per block)
GGUF_TYPES = {
    "Q4_0": (18, 32, 4, 32),
    "Q4_1": (20, 32, 4, 32),
    "Q5_0": (22, 32, 8, 32),
    "Q5_1": (24, 32, 8, 32),
    "Q8_0": (34, 32, 8, 32),
    "Q2_K": (84, QK_K, 4, 16),
    "Q3_K": (110, QK_K, 4, 16),
    "Q4_K": (144, QK_K, 4, 32),
    "Q5_K": (176, QK_K, 8, 32),
    "Q6_K": (210, QK_K, 8, 16),
    "IQ4_NL": (18, 32, 8, 32),
    "IQ4_XS": (136, QK_K, 8, 32),
}
# IQ4's sixteen levels: a 4-bit index picks one of these int8 values.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int16)
FLOAT_TYPES = ("F32", "F16", "BF16")  # held as floats: quantized here, or kept float


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32 (exact) [..., 1]."""
    return raw[..., at:at + 2].copy().view(np.float16).astype(np.float32)


def _bits(raw: np.ndarray, shifts: tuple[int, ...], mask: int, width: int) -> np.ndarray:
    """Fields of `raw` [..., groups * width] bytes: for each group of `width` bytes, the field
    at each shift in turn -> [..., groups * len(shifts) * width], ggml's order."""
    groups = raw.reshape(*raw.shape[:-1], -1, 1, width)
    fields = (groups >> np.array(shifts, dtype=np.uint8).reshape(-1, 1)) & np.uint8(mask)
    return fields.reshape(*raw.shape[:-1], -1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's twelve bytes -> eight 6-bit scales and eight 6-bit minimums [..., 8]:
    bytes 0-3 hold scales 0-3 (and the top bits of 4-7), 4-7 the minimums 0-3 (likewise),
    8-11 the low four bits of scale and minimum 4-7."""
    lo, mid, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _decode(kind: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, np.ndarray | None]:
    """One row set of super-blocks b [..., bytes] -> (q uint8 [..., weights], scale float32
    [..., blocks], zero point, minimum float32 [..., blocks] or None)."""
    if kind == "Q8_0":
        return (b[..., 2:].copy().view(np.int8).astype(np.int16) + 128).astype(np.uint8), _f16(b, 0), 128, None
    if kind in ("Q4_0", "Q4_1"):
        q = _bits(b[..., -16:], (0, 4), 0x0F, 16)  # byte j: value j (low nibble), j + 16 (high)
        return (q, _f16(b, 0), 8, None) if kind == "Q4_0" else (q, _f16(b, 0), 0, _f16(b, 2))
    if kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4
        high = b[..., at:at + 4].copy().view("<u4")  # bit j: value j's fifth bit
        high = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = _bits(b[..., at + 4:], (0, 4), 0x0F, 16) | (high << 4)
        return (q, _f16(b, 0), 16, None) if kind == "Q5_0" else (q, _f16(b, 0), 0, _f16(b, 2))
    if kind == "Q2_K":  # scales[16] (low nibble scale, high nibble min), qs[64], d, dmin
        q = _bits(b[..., 16:80], (0, 2, 4, 6), 0x03, 32)
        scales = b[..., 0:16]
        return (q, _f16(b, 80) * (scales & 0x0F).astype(np.float32), 0,
                -(_f16(b, 82) * (scales >> 4).astype(np.float32)))
    if kind == "Q3_K":  # hmask[32], qs[64], scales[12] (sixteen 6-bit, offset 32), d
        low = _bits(b[..., 32:96], (0, 2, 4, 6), 0x03, 32)
        high = _bits(b[..., 0:32], tuple(range(8)), 0x01, 32)  # set: the value is low; clear: low - 4
        sc = _bits(b[..., 96:104], (0, 4), 0x0F, 8) | (_bits(b[..., 104:108], (0, 2, 4, 6), 0x03, 4) << 4)
        return low | (high << 2), _f16(b, 108) * (sc.astype(np.float32) - 32), 4, None
    if kind in ("Q4_K", "Q5_K"):  # d, dmin, scales[12], (qh[32],) qs[128]
        sc, m = _k_scales(b[..., 4:16])
        q = _bits(b[..., -128:], (0, 4), 0x0F, 32)
        if kind == "Q5_K":
            q = q | (_bits(b[..., 16:48], tuple(range(8)), 0x01, 32) << 4)
        return q, _f16(b, 0) * sc, 0, -(_f16(b, 2) * m)
    if kind == "Q6_K":  # ql[128], qh[64], scales[16] int8, d
        q = _bits(b[..., 0:128], (0, 4), 0x0F, 64) | (_bits(b[..., 128:192], (0, 2, 4, 6), 0x03, 32) << 4)
        return q, _f16(b, 208) * b[..., 192:208].copy().view(np.int8).astype(np.float32), 32, None
    if kind == "IQ4_NL":  # d, qs[16]
        return _levels(_bits(b[..., 2:], (0, 4), 0x0F, 16)), _f16(b, 0), 128, None
    if kind == "IQ4_XS":  # d, scales_h (uint16: two high bits a block), scales_l[4] (a nibble a block), qs[128]
        low = b[..., 4:8]
        low = np.stack([low & 0x0F, low >> 4], axis=-1).reshape(*b.shape[:-1], 8)
        high = (b[..., 2:4].copy().view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & 0x03
        sc = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32
        return _levels(_bits(b[..., 8:], (0, 4), 0x0F, 16)), _f16(b, 0) * sc, 128, None
    raise ValueError(kind)


def _levels(index: np.ndarray) -> np.ndarray:
    """IQ4 indices -> their int8 levels + 128, in 0..255."""
    return (IQ4_LEVELS[index] + 128).astype(np.uint8)


def gguf_blocks(kind: str, raw: np.ndarray, n: int, k: int) -> Blocks:
    """A GGUF tensor's raw bytes (ggml's layout; [N, K] weights) as `Blocks`, values unchanged."""
    size, per, bits, block = GGUF_TYPES[kind]
    supers = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // per, size)
    q, scale, zero, mins = _decode(kind, supers)
    scale = scale.reshape(n, k // block).astype(np.float32)
    mins = None if mins is None else mins.reshape(n, k // block).astype(np.float32)
    zeros = np.full(scale.shape, zero, dtype=np.uint8)
    return Blocks(bits, q.reshape(n, k).astype(np.uint8), scale, zeros, mins, kind, block)


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

    def kind(self, name: str) -> str | None:
        tensor = self.tensors.get(name)
        return None if tensor is None else tensor.tensor_type.name

    def blocks(self, name: str, want: np.ndarray, heads: int | None) -> tuple[Blocks | None, str]:
        """(the tensor's own blocks, which dequantize exactly to `want`, the float weight
        transformers loaded from the file; "") or (None, why the file cannot give them)."""
        kind = self.kind(name)
        if kind is None:  # never quantized here from values the file does not hold
            raise ExportError(f"{self.path}: tensor {name} is missing from the file; refusing a model that is not "
                              "the file's")
        if kind in FLOAT_TYPES:
            return None, f"{kind} in the file"
        if kind not in GGUF_TYPES:
            return None, f"{kind} has no exact MatMulNBits form"
        n, k = want.shape
        if int(self.tensors[name].n_elements) != n * k:
            return None, f"{kind} of another shape than the model's weight"
        blocks = gguf_blocks(kind, self.tensors[name].data, n, k)
        for rows in [None] + ([_llama_rows(n, heads)] if heads else []):
            candidate = blocks if rows is None else blocks.take_rows(rows)
            if np.array_equal(candidate.dequantize(), want):
                return candidate, ""
        return None, f"{kind} blocks that do not dequantize to the weight transformers read"


__all__ = ["FLOAT_TYPES", "GGUF_TYPES", "GgufWeights", "gguf_blocks"]
