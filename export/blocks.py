"""A weight as blocks along its input dimension, the form MatMulNBits holds: w = (q - zero) * scale (+ min).

One record serves every source: blocks quantized here from float weights (round to
nearest) and a GGUF file's own blocks, legacy or K-quant, read unchanged
(export/gguf_blocks.py). A block is 16 or 32 weights; q is held in 4 or 8 bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdeploy.core.errors import ExportError

from .ops import BLOCK


@dataclass
class Blocks:
    """One weight [N, K] as blocks of `block` along K: w = (q - zero) * scale (+ mins)."""

    bits: int  # the storage: 4 (values 0..15) or 8 (0..255)
    q: np.ndarray  # uint8 [N, K]
    scale: np.ndarray  # float32 [N, K/block]
    zero: np.ndarray  # uint8 [N, K/block]
    mins: np.ndarray | None  # float32 [N, K/block], or None
    origin: str  # "float" (quantized here) or the GGUF block type imported exactly
    block: int = BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def form(self) -> tuple[int, int, bool]:
        """What one MatMulNBits node needs all its rows to share: bits, block, a minimum term."""
        return self.bits, self.block, self.mins is not None

    def dequantize(self) -> np.ndarray:
        """The float32 weights: (q - zero) * scale, then + min, the operations gguf-py's
        dequantizers do in the same order (so an imported GGUF tensor compares equal bit for bit)."""
        n, k = self.q.shape
        q = self.q.reshape(n, k // self.block, self.block).astype(np.float32)
        w = (q - self.zero[..., None].astype(np.float32)) * self.scale[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(n, k)

    @staticmethod
    def concat(parts: list["Blocks"]) -> "Blocks":
        """Blocks of several weights stacked along N (one node for projections of one input)."""
        if len({p.form for p in parts}) != 1:
            raise ExportError("cannot fuse projections quantized in different formats")
        cat = lambda f: np.concatenate([f(p) for p in parts])  # noqa: E731
        mins = None if parts[0].mins is None else cat(lambda p: p.mins)
        origins = sorted({p.origin for p in parts})
        return Blocks(parts[0].bits, cat(lambda p: p.q), cat(lambda p: p.scale), cat(lambda p: p.zero), mins,
                      "+".join(origins), parts[0].block)

    def take_rows(self, rows: np.ndarray) -> "Blocks":
        pick = lambda a: None if a is None else a[rows]  # noqa: E731
        return Blocks(self.bits, self.q[rows], self.scale[rows], self.zero[rows], pick(self.mins), self.origin, self.block)


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


def pack(blocks: Blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' initializers: B uint8 [N, K/block, block*bits/8], scales float32 [N*K/block],
    zero points uint8 (4-bit: two per byte along K, each row padded to whole bytes)."""
    n, k = blocks.q.shape
    size = blocks.block
    nb = k // size
    if blocks.bits == 4:
        pairs = blocks.q.reshape(n, nb, size // 2, 2)
        packed = pairs[..., 0] | (pairs[..., 1] << 4)
        zero = blocks.zero
        if nb % 2:
            zero = np.concatenate([zero, np.zeros((n, 1), dtype=np.uint8)], axis=1)
        zp = (zero[:, 0::2] | (zero[:, 1::2] << 4)).reshape(-1)
    else:
        packed = blocks.q.reshape(n, nb, size)
        zp = blocks.zero.reshape(-1)
    return np.ascontiguousarray(packed, dtype=np.uint8), blocks.scale.reshape(-1).astype(np.float32), zp.astype(np.uint8)


__all__ = ["Blocks", "pack", "quantize_float"]
