"""What importing Q4_1 exactly costs an int4 step on ONNX Runtime, and why it is not folded.

    python benchmarks/q41_cost.py BUNDLE [--threads 2] [--steps 30] [--rounds 5]

1. The bundle's int4 target graph against a copy with every block-minimum term deleted
   (the MatMulNBits output feeds the rest directly; the Reshape / ReduceSum / MatMul / Add
   that computed x's block sums times the minima are pruned). The copy computes wrong
   logits: it only prices the term. One T = 1 step at context 150, medians of
   --rounds x --steps passes, the two graphs alternating.
2. One 576 x 3072 MatMulNBits (SmolLM2's fused gate/up projection) at T = 1, with the
   4-bit zero points as uint8 against float zero points (zero = -minimum / scale, which
   would absorb Q4_1's minimum into the one node).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from specdeploy.export.quantize import BLOCK, pack, quantize_float
from specdeploy.runtime import load_bundle
from specdeploy.runtime.backends.ort import OrtEngine, session_options


def without_minima(src: Path, dst: Path) -> int:
    """Copy the graph at `src` to `dst` with each `MatMulNBits + MatMul(block sums, minima)`
    add replaced by the MatMulNBits output; returns how many terms it deleted."""
    model = onnx.load(str(src))
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    rename = {}
    for node in graph.node:
        if node.op_type != "Add" or len(node.input) != 2:
            continue
        a, b = (producer.get(i) for i in node.input)
        if a is not None and b is not None and a.op_type == "MatMulNBits" and b.op_type == "MatMul" and "mins" in b.input[1]:
            rename[node.output[0]] = node.input[0]
    keep = [n for n in graph.node if not (n.output and n.output[0] in rename)]
    for node in keep:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    used = {o.name for o in graph.output}
    while True:  # prune what fed only the deleted adds
        consumed = {i for n in keep for i in n.input} | used
        pruned = [n for n in keep if any(o in consumed for o in n.output)]
        if len(pruned) == len(keep):
            break
        keep = pruned
    del graph.node[:]
    graph.node.extend(keep)
    onnx.save(model, str(dst), save_as_external_data=True, location=dst.name + ".data")
    return len(rename)


def step_ms(engines: dict[str, OrtEngine], steps: int, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.forward(np.array([100]), 150)
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def zero_point_us(threads: int, k: int = 576, n: int = 3072, runs: int = 300) -> dict[str, float]:
    rng = np.random.default_rng(0)
    blocks = quantize_float(rng.standard_normal((n, k)).astype(np.float32) * 0.05, 4)  # w = d * q + m
    packed, scales, zero_u8 = pack(blocks)
    zero_f = (-blocks.mins / np.where(blocks.scale > 0, blocks.scale, 1)).astype(np.float32).reshape(-1)
    x = rng.standard_normal((1, 1, k)).astype(np.float32)
    out = {}
    for name, zero in (("uint8 zero points", zero_u8), ("float zero points", zero_f)):
        node = helper.make_node("MatMulNBits", ["x", "B", "s", "z"], ["y"], domain="com.microsoft",
                                K=k, N=n, bits=4, block_size=BLOCK, accuracy_level=4)
        g = helper.make_graph(
            [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, n])],
            [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "s"), numpy_helper.from_array(zero, "z")],
        )
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        sess = ort.InferenceSession(m.SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"])
        ts = []
        for _ in range(runs):
            t0 = time.perf_counter()
            sess.run(None, {"x": x})
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts) * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    bundle = load_bundle(args.bundle)
    spec = bundle.model("target")
    dtype = bundle.model("target").dtype
    if dtype != "int4":
        raise SystemExit(f"{args.bundle}: the target is {dtype}; this measures an int4 graph")
    with tempfile.TemporaryDirectory() as tmp:
        stripped = Path(tmp) / "no_minima.onnx"
        deleted = without_minima(bundle.file(spec.graph), stripped)
        engines = {}
        for name, path in (("exact Q4_1", bundle.file(spec.graph)), ("minima deleted (wrong logits)", stripped)):
            sess = ort.InferenceSession(str(path), session_options(args.threads), providers=["CPUExecutionProvider"])
            engines[name] = OrtEngine(path, spec, bundle.max_seq, session=sess)
        ms = step_ms(engines, args.steps, args.rounds)
    print(f"int4 step at T = 1 ({deleted} block-minimum terms), {args.threads} threads:")
    for name, value in ms.items():
        print(f"  {name:32s} {value:6.2f} ms")
    exact, stripped_ms = ms["exact Q4_1"], ms["minima deleted (wrong logits)"]
    print(f"  the minimum terms: {exact - stripped_ms:.2f} ms, {(exact - stripped_ms) / exact:.0%} of the step")
    print("one 576 x 3072 MatMulNBits at T = 1:")
    for name, value in zero_point_us(args.threads).items():
        print(f"  {name:32s} {value:8.1f} us")


if __name__ == "__main__":
    main()
