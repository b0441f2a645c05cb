"""What gpt-oss's experts cost as export computes them (densely: every expert for every row), on this CPU.

    python benchmarks/experts_cost.py [--work DIR] [--context 256] [--steps 30] [--rounds 5]

No gpt-oss checkpoint can be fetched here, so the model is random, at a shape stated in the
output: gpt-oss-20b's expert counts (32 experts, 4 a token) and its attention (64-wide heads,
8 query heads per K/V head, sinks, sliding and full layers) at a smaller width (hidden 1024,
expert MLPs 512 wide, 4 layers, 16k vocabulary). Exported int4 (the CPU default). Printed: the
graph file, the parameters and what one token's K/V takes; medians of --rounds x --steps
passes at position --context for T = 1 (a plain step) and verify passes of T = 4 and 9, each
beside T = 1. Dense experts make a pass read every expert's weights whatever T is (a sparse
kernel would read the chosen ones: at T = 1, 4 of 32), and compute E / k = 8 times a sparse
kernel's expert arithmetic per row.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

SHAPE = dict(layers=4, vocab_size=16384, hidden_size=1024, intermediate_size=512, num_local_experts=32,
             num_experts_per_tok=4, num_attention_heads=16, num_key_value_heads=2, head_dim=64, sliding_window=128,
             max_position_embeddings=2048, initializer_range=0.02)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=None, help="folder for the model and the bundle (kept)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args()
    import tiny
    from benchmarks.provenance import provenance
    from specdeploy.export import build_bundle
    from specdeploy.runtime import Session

    work = args.work or Path(tempfile.mkdtemp(prefix="experts-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    model, bundle = work / "gpt-oss", work / "bundle"
    if not (model / "config.json").is_file():
        tiny.make_model(model, "gpt_oss", **SHAPE)
    if not (bundle / "manifest.json").is_file():
        build_bundle(model, "none", bundle, max_seq=1024, max_draft=8, dtype="int4", log=print)
    session = Session(bundle, prompt_cache=False)
    spec = session.bundle.model("target")
    n = args.context
    ids = np.random.default_rng(0).integers(3, SHAPE["vocab_size"], size=n + 9)
    session.target.forward(ids[: n - 1], 0)
    times: dict[int, list[float]] = {1: [], 4: [], 9: []}
    for _ in range(args.rounds):
        for _ in range(args.steps):
            for t in times:
                t0 = time.perf_counter()
                session.target.forward(ids[n - 1 : n - 1 + t], n - 1)
                times[t].append(time.perf_counter() - t0)
    medians = {t: statistics.median(v) * 1e3 for t, v in times.items()}
    graph_mib = (bundle / spec.graph).stat().st_size / 2**20
    kv_per_token = spec.kv_bytes(1)
    print(f"\nshape {SHAPE}\ngraph {graph_mib:.0f} MiB (int4), {spec.parameters / 1e6:.0f}M parameters, K/V "
          f"{kv_per_token / 1024:.1f} KiB per token ({spec.kv_dtype})")
    print(f"position {n}, medians of {args.rounds} x {args.steps} (ms; ratio to T = 1):")
    for t, ms in medians.items():
        print(f"  T = {t}: {ms:8.2f} ms  {ms / medians[1]:5.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"provenance": provenance(), "shape": SHAPE, "position": n,
                                        "graph_mib": graph_mib, "parameters": spec.parameters,
                                        "kv_bytes_per_token": kv_per_token,
                                        "median_ms": {f"T={t}": ms for t, ms in medians.items()}}, indent=1))


if __name__ == "__main__":
    main()
