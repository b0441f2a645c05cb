"""benchmarks/ortgenai.py --graph-ops: a graph's nodes by op as ONNX Runtime runs it (its
optimizer's output), on a bundle the tests build; no onnxruntime-genai needed."""
import subprocess
import sys
from pathlib import Path

import onnx

ROOT = Path(__file__).parents[1]
from benchmarks import ortgenai


def test_optimized_ops_counts_the_nodes_onnx_runtime_runs(bundles):
    graph = bundles("llama-ngram") / "target.onnx"
    ops = ortgenai.optimized_ops(graph)
    exported = [node.op_type for node in onnx.load(graph, load_external_data=False).graph.node]
    assert ops["MatMul"] + ops.get("FusedMatMul", 0) > 0
    assert sum(ops.values()) < len(exported)  # the optimizer fused
    assert "SimplifiedLayerNormalization" in ops and "SimplifiedLayerNormalization" not in exported


def test_graph_ops_command_prints_a_line_per_graph_and_names_a_missing_one(bundles, tmp_path):
    bundle = bundles("llama-ngram")
    out = subprocess.run([sys.executable, "-m", "benchmarks.ortgenai", str(bundle), "--graph-ops"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.startswith(f"{bundle.name}: ") and " nodes " in out and out.count("\n") == 1
    bad = subprocess.run([sys.executable, "-m", "benchmarks.ortgenai", str(bundle), "--graph-ops",
                          "--genai", f"g={tmp_path}"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 1 and f"g: no graph at {tmp_path / 'model.onnx'}" in bad.stderr
