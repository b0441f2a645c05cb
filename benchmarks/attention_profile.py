"""Where a decoding step's time goes as the context grows: ONNX Runtime's profiler, per operator.

    python benchmarks/attention_profile.py BUNDLE [BUNDLE ...] [--lengths 256,1024,3072,6144]
        [--steps N] [--rounds N] [--rows T] [--threads N] [--json OUT]

The bundle's target graph runs bare T = 1 steps (a single sequence, the runtime's session
options, every KV buffer bound in place as the runtime binds it) with the write position at
L - 1 for each context length L. Per length: the wall time of a step (median, profiler off),
then, profiler on, each operator type's time per step and the bytes its nodes move (inputs
read plus outputs written, from the shapes the profiler records; an in-place KV write counts
the rows it writes, not the buffer it is handed; a Slice the prefix it copies, read and
written; a fused graph's GroupQueryAttention is counted with its whole KV buffers, of which it
reads the live prefix in place: its figure overstates). Beside them, the floor: the bytes a step
must read (every weight once, an embedding row, the live K/V: 2 x layers x L slots).

With several bundles, the step times are measured side by side: per length, `--rounds`
rounds in which each bundle runs `--steps` steps in turn (all loaded at once), the median of
each bundle's steps, and its ratio to the first bundle's; then each bundle's profile. Last,
per bundle and length, whether a verify pass's `--rows` rows equal single steps bit for bit.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from specdeploy.core.graph_io import attention_mask
from specdeploy.runtime.backends.ort import kv_capacity, session_options

try:
    from benchmarks.provenance import provenance
except ModuleNotFoundError:  # run as a file
    from provenance import provenance

SIZES = {"float": 4, "float16": 2, "int64": 8, "int32": 4, "uint8": 1, "int8": 1, "bool": 1}
IN_PLACE = {"TensorScatter": 1}  # op -> index of the input whose rows it writes (the update)
COPIES_OUTPUT = ("Slice",)  # ops that read only what they write out (a prefix of a KV buffer)
PER_ROW = ("embed_tokens.weight", "cos_cache", "sin_cache")  # tables a step reads one row of


def _bytes(shapes: list[dict]) -> int:
    total = 0
    for entry in shapes:
        for dtype, dims in entry.items():
            total += int(np.prod(dims, dtype=np.int64)) * SIZES.get(dtype, 4)
    return total


def weight_bytes(graph: Path) -> int:
    """Bytes of the initializers a step reads whole (tables read a row at a time excluded)."""
    model = onnx.load(str(graph), load_external_data=False)
    total = 0
    for t in model.graph.initializer:
        if t.name in PER_ROW:
            continue
        n = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
        total += n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return total


class Stepper:
    """A target graph's T = 1 step, inputs and KV buffers bound once."""

    def __init__(self, graph: Path, so: ort.SessionOptions, max_seq: int | None = None):
        """`max_seq`: the buffers' slots where the graph reads its K/V as bound ([1, Hkv, L, D]:
        then bound at the runtime's capacity for the window, kv_capacity); else the graph's own."""
        self.session = ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
        self.kv = {}
        past = [v for v in self.session.get_inputs() if v.name.startswith("past_")]
        self.windowed = isinstance(past[0].shape[2], str)
        self.max_seq = max_seq or (8192 if self.windowed else past[0].shape[2])
        for value in past:
            shape = [1, value.shape[1], self.max_seq, value.shape[3]]
            dtype = np.float16 if "float16" in value.type else np.float32
            rng = np.random.default_rng(len(self.kv))
            self.kv[value.name] = (rng.standard_normal(shape) * 0.1).astype(dtype).reshape(-1)
        self.names = {v.name for v in self.session.get_inputs()}
        self.kv_shapes = {v.name: (v.shape[1], v.shape[3]) for v in past}  # (Hkv, D) of each buffer

    def bind(self, token_ids: np.ndarray, start: int) -> ort.IOBinding:
        """A pass of `token_ids` written at `start`, every row's logits asked for (the first
        output bound: copy_outputs_to_cpu()[0]), every KV buffer bound in place."""
        t = len(token_ids)
        b = self.session.io_binding()
        mask = attention_mask(start, t)
        slots = self.max_seq
        if self.windowed:  # the buffers laid out at the capacity the runtime gives this window
            slots = kv_capacity(start + t, self.max_seq)
            mask = np.concatenate([mask, np.full((1, 1, t, slots - start - t), -np.inf, np.float32)], axis=-1)
        feeds = {"input_ids": token_ids[None], "position_ids": np.arange(start, start + t, dtype=np.int64)[None],
                 "write_indices": np.array([start], np.int64), "attention_mask": mask,
                 "logits_rows": np.arange(t, dtype=np.int64)}
        for name, value in feeds.items():
            if name in self.names:
                b.bind_cpu_input(name, value)
        b.bind_output("logits")
        for name, flat in self.kv.items():
            heads, dim = self.kv_shapes[name]
            shape = [1, heads, slots, dim]
            b.bind_input(name, "cpu", 0, flat.dtype, shape, flat.ctypes.data)
            b.bind_output(name.replace("past_", "present_"), "cpu", 0, flat.dtype, shape, flat.ctypes.data)
        return b

    def binding(self, length: int) -> ort.IOBinding:
        """A single step at slot length - 1: attention over L = `length` slots."""
        return self.bind(np.array([1], np.int64), length - 1)

    def pass_logits(self, token_ids: np.ndarray, start: int) -> np.ndarray:
        """Every row's logits [T, V] of one pass of `token_ids` written at `start`."""
        b = self.bind(token_ids, start)
        self.session.run_with_iobinding(b)
        return b.copy_outputs_to_cpu()[0][0]

    def rows_against_steps(self, length: int, t: int) -> tuple[float, bool]:
        """A verify pass of `t` rows ending at slot length - 1, then the same tokens as single
        steps over the same slots: the largest difference relative to the largest logit, and
        whether every row is bit-identical (what speculation's exactness rests on)."""
        tokens = np.arange(1, t + 1, dtype=np.int64)
        start = length - t
        whole = self.pass_logits(tokens, start)
        single = np.concatenate([self.pass_logits(tokens[i:i + 1], start + i) for i in range(t)])
        return float(np.abs(whole - single).max() / np.abs(single).max()), bool(np.array_equal(whole, single))

    def run(self, binding: ort.IOBinding, steps: int) -> list[float]:
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.session.run_with_iobinding(binding)
            out.append(time.perf_counter() - t0)
        return out


def side_by_side(graphs: list[Path], lengths: list[int], steps: int, rounds: int, threads: int
                 ) -> dict[Path, dict[int, float]]:
    """Median step seconds per graph and length, the graphs taking turns (`rounds` x `steps` each)."""
    timers = {g: Stepper(g, session_options(threads)) for g in graphs}
    wall: dict[Path, dict[int, float]] = {g: {} for g in graphs}
    for length in lengths:
        bindings = {g: t.binding(length) for g, t in timers.items()}
        times: dict[Path, list[float]] = {g: [] for g in graphs}
        for g, t in timers.items():
            t.run(bindings[g], 3)
        for _ in range(rounds):
            for g, t in timers.items():
                times[g] += t.run(bindings[g], steps)
        for g in graphs:
            wall[g][length] = statistics.median(times[g])
    return wall


def profile(graph: Path, lengths: list[int], steps: int, threads: int, wall: dict[int, float]) -> dict:
    """Per length: `wall` (the step's median seconds) and, profiler on, each operator type's
    time and bytes per step."""
    floor_weights = weight_bytes(graph)
    model = onnx.load(str(graph), load_external_data=False)
    kv_per_slot = 0
    for value in model.graph.input:
        if value.name.startswith("past_"):
            dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).itemsize
            kv_per_slot += dims[1] * dims[3] * itemsize  # Hkv x D a slot (dim 2: max_seq, or the window L)
    del model

    so = session_options(threads)
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "step")
    prof = Stepper(graph, so)
    marks = []
    for length in lengths:
        b = prof.binding(length)
        prof.run(b, 3)
        marks.append((length, time.perf_counter()))
        prof.run(b, steps)
    trace = json.loads(Path(prof.session.end_profiling()).read_text())

    runs = [e for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run"]
    nodes = [e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    per_length = []
    # The profiler's runs in order: per length, 3 warm-ups then `steps` measured.
    order = [length for length in lengths for _ in range(3 + steps)]
    assert len(runs) == len(order), (len(runs), len(order))
    spans = [(r["ts"], r["ts"] + r["dur"], length, i % (3 + steps) >= 3) for i, (r, length) in enumerate(zip(runs, order))]
    ops: dict[int, dict[str, list[float]]] = {n: defaultdict(lambda: [0.0, 0.0]) for n in lengths}
    span = 0
    for e in sorted(nodes, key=lambda e: e["ts"]):
        while span < len(spans) and e["ts"] > spans[span][1]:
            span += 1
        if span == len(spans) or not spans[span][3]:
            continue
        op = e["args"]["op_name"]
        inputs = e["args"].get("input_type_shape", [])
        if op in IN_PLACE:
            moved = 2 * _bytes(inputs[IN_PLACE[op]:IN_PLACE[op] + 1])
        elif op in COPIES_OUTPUT:
            moved = 2 * _bytes(e["args"].get("output_type_shape", []))
        else:
            moved = _bytes(inputs) + _bytes(e["args"].get("output_type_shape", []))
        entry = ops[spans[span][2]][op]
        entry[0] += e["dur"] / 1e6 / steps
        entry[1] += moved / steps
    for length in lengths:
        floor = floor_weights + kv_per_slot * length
        table = sorted(ops[length].items(), key=lambda kv: -kv[1][0])
        per_length.append({
            "length": length, "step_ms": wall[length] * 1e3, "floor_bytes": floor, "kv_bytes": kv_per_slot * length,
            "moved_bytes": sum(v[1] for v in ops[length].values()),
            "ops": [{"op": op, "ms": s * 1e3, "bytes": int(m)} for op, (s, m) in table],
        })
    return {"graph": str(graph), "weights_bytes": floor_weights, "kv_bytes_per_slot": kv_per_slot,
            "steps": steps, "threads": threads, "lengths": per_length}


def render(report: dict, top: int = 8) -> str:
    lines = [f"{report['graph']}: weights read per step {report['weights_bytes'] / 1e6:.1f} MB, "
             f"K/V {report['kv_bytes_per_slot']} bytes per slot; {report['threads']} threads, "
             f"{report['steps']} steps per length"]
    for row in report["lengths"]:
        kernel_ms = sum(o["ms"] for o in row["ops"])
        lines.append(f"\nL = {row['length']}: step {row['step_ms']:.2f} ms (kernels {kernel_ms:.2f} ms); must read "
                     f"{row['floor_bytes'] / 1e6:.1f} MB (K/V {row['kv_bytes'] / 1e6:.1f}), nodes move "
                     f"{row['moved_bytes'] / 1e6:.1f} MB ({row['moved_bytes'] / row['floor_bytes']:.2f}x the floor)")
        for o in row["ops"][:top]:
            lines.append(f"  {o['op']:<34} {o['ms']:8.3f} ms {o['bytes'] / 1e6:9.1f} MB")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", type=Path, nargs="+")
    parser.add_argument("--lengths", default="256,1024,3072,6144")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=5, help="rows of the verify pass checked against single steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    graphs = [b / "target.onnx" for b in args.bundles]
    wall = side_by_side(graphs, lengths, args.steps, args.rounds, args.threads)
    print(f"step time, median of {args.rounds} x {args.steps} steps each, the bundles taking turns:")
    for length in lengths:
        first = wall[graphs[0]][length]
        print(f"  L = {length:>5}: " + "; ".join(
            f"{b} {wall[g][length] * 1e3:.2f} ms ({wall[g][length] / first:.2f}x)" for b, g in zip(args.bundles, graphs)))
    reports = [profile(g, lengths, args.steps, args.threads, wall[g]) for g in graphs]
    print(f"\na verify pass of {args.rows} rows against {args.rows} single steps over the same slots:")
    for b, g, report in zip(args.bundles, graphs, reports):
        checker = Stepper(g, session_options(args.threads))
        for row in report["lengths"]:
            diff, same = checker.rows_against_steps(row["length"], args.rows)
            row["verify_rows_bit_identical"], row["verify_rows_max_rel_diff"] = same, diff
            print(f"  {b} L = {row['length']}: " + ("bit-identical" if same else f"differ, by up to {diff:.1e} of the largest logit"))
    for report in reports:
        print("\n" + render(report))
    if args.json:
        out = {"rounds": args.rounds, "bundles": reports, "provenance": provenance()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
