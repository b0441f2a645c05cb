"""A quantized graph in standard ONNX: each MatMulNBits as a blocked DequantizeLinear feeding a
MatMul (docs/quantization.md, "Standard ONNX for TensorRT").

    MatMulNBits(x, B, scales[, zero_points])  ->  MatMul(x, DequantizeLinear(W, S, axis=0, block_size))
        W [K, N] int4 (or int8): each weight's (q - zero), signed, the zero point dropped
        S [K/block, N] float32: the same scales

The values are the same numbers: (q - zero) * scale, nothing rounded, so the rewrite is exact
whatever the blocks came from. TensorRT reads this form as weight-only quantization, which it
takes symmetric (zero point 0, signed values): blocks whose q - zero fits -8..7 (symmetric
int4, Q4_0, Q3_K) are INT4; the rest (a minimum-carrying Q4_1/Q4_K's 0..15, 5- to 8-bit
types) are INT8, still exact, twice the bytes. ONNX Runtime's CPU provider fuses the INT4
pair back into MatMulNBits at load (accuracy level 4, as ours); INT8 pairs run as a float
MatMul over the dequantized weights. The block minimum term is standard ops already.
"""
from __future__ import annotations

import numpy as np
import torch

from specdeploy.core.errors import ExportError

from .ops import DOMAIN, unpack_nbits


def _signed(b: np.ndarray, zero_points: np.ndarray | None, n: int, k: int, bits: int, block: int) -> np.ndarray:
    """MatMulNBits' B (and zero points) -> the signed values q - zero, int16 [N, K]."""
    tensor = lambda a: torch.from_numpy(a.copy())  # noqa: E731 (an initializer's array is read-only)
    q, zp = unpack_nbits(tensor(b), None if zero_points is None else tensor(zero_points), k, n, bits, block)
    return (q.to(torch.int16) - zp.to(torch.int16)[..., None]).reshape(n, k).numpy()


def to_dequantize_linear(model) -> dict[str, int]:
    """Rewrite `model`'s MatMulNBits nodes in place as DequantizeLinear + MatMul; returns how many
    weights became INT4 and INT8."""
    import ml_dtypes
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    counts = {"int4": 0, "int8": 0}
    nodes = []
    for node in graph.node:
        if node.op_type != "MatMulNBits" or node.domain != DOMAIN:
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        n, k, bits, block = attrs["N"], attrs["K"], attrs["bits"], attrs["block_size"]
        names = list(node.input) + [""] * (4 - len(node.input))
        x, b_name, s_name, z_name = names[:4]
        if b_name not in inits or s_name not in inits or (z_name and z_name not in inits):
            raise ExportError(f"MatMulNBits {node.name}: its weights are not initializers; cannot rewrite it")
        b = numpy_helper.to_array(inits[b_name])
        zero = numpy_helper.to_array(inits[z_name]) if z_name else None
        values = _signed(b, zero, n, k, bits, block)
        scales = numpy_helper.to_array(inits[s_name]).reshape(n, k // block)
        if values.min() >= -8 and values.max() <= 7:
            kind, weight = "int4", values.T.astype(ml_dtypes.int4)
        elif values.min() >= -128 and values.max() <= 127:
            kind, weight = "int8", values.T.astype(np.int8)
        else:
            raise ExportError(f"MatMulNBits {node.name}: values outside int8 after the zero point; cannot rewrite it")
        counts[kind] += 1
        base = node.output[0]
        w_name, ws_name, wf_name = f"{base}.dq_weight", f"{base}.dq_scale", f"{base}.dq_float"
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight), w_name))
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(scales.T), ws_name))
        nodes.append(helper.make_node("DequantizeLinear", [w_name, ws_name], [wf_name], name=f"{node.name}.dq",
                                      axis=0, block_size=block))
        nodes.append(helper.make_node("MatMul", [x, wf_name], [base], name=f"{node.name}.matmul"))
    del graph.node[:]
    graph.node.extend(nodes)
    read = {name for node in graph.node for name in node.input}
    keep = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    if not any(node.domain == DOMAIN for node in graph.node):
        kept = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return counts


__all__ = ["to_dequantize_linear"]
