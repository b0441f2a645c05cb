"""What a Gemma 4 assistant's draft step costs against its target's step, on this CPU.

    python benchmarks/assistant_cost.py [--work DIR] [--context 256] [--steps 40] [--rounds 5]

No Gemma 4 checkpoint can be fetched here, so both models are random, in the published layouts,
at a shape stated in the output: a target with Gemma 4 E2B's layer shapes (hidden 1536, 8
query heads and 1 K/V head, heads 256 wide on sliding layers and 512 on full ones, MLP 6144,
per-layer inputs 256 wide, the last 2 layers reading earlier K/V) but 6 layers, sliding:full 2:1,
and a 16k vocabulary (E2B: 35 layers, 4:1, 262k: a graph past 2 GiB, which export does not write
yet), exported int4 (the CPU default) with the
assistant (fp32); and an assistant of 4 layers, hidden 256, centroid-masked head (2048
centroids, top 32). Medians of --rounds x --steps passes at position --context: a target T = 1
step (plain decoding's pass), a target T = 4 verify pass, and one assistant step, alternating.
Random weights cost what trained ones do: the work is the shapes'. (They also fail the export's
parity bound on their own rounding at this width, so this script lifts it for its export.)
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


def make_models(work: Path) -> tuple[Path, Path]:
    import tiny

    target, assistant = work / "target", work / "assistant"
    if not (target / "config.json").is_file():
        layers = 6
        kinds = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(layers)]
        tiny.make_model(target, "gemma4_text", layers=layers, vocab_size=16384, hidden_size=1536,
                        intermediate_size=6144, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                        global_head_dim=512, num_global_key_value_heads=1, attention_k_eq_v=False,
                        hidden_size_per_layer_input=256, vocab_size_per_layer_input=16384, enable_moe_block=False,
                        sliding_window=512, layer_types=kinds, num_kv_shared_layers=2, initializer_range=0.02,
                        max_position_embeddings=2048)
    if not (assistant / "config.json").is_file():
        tiny.make_gemma4_assistant(assistant, target, layers=4, hidden_size=256, sliding_window=512,
                                   num_centroids=2048, centroid_intermediate_top_k=32)
    return target, assistant


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=None, help="folder for the models and the bundle (kept)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="assistant-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    target, assistant = make_models(work)
    bundle = work / "bundle"
    if not (bundle / "manifest.json").is_file():
        from specdeploy.export import build_bundle, onnx_export

        # Random Gemma 4 weights at this width (unit-normed q and k, unscaled scores over 256-512
        # wide heads) fail the export's parity bound on their own rounding (measured: fp32 7.1e-4
        # against 1e-4, int4 0.80 against 0.25): lifted for this run, which times shapes only
        for dtype in onnx_export.PARITY_RTOL:
            onnx_export.PARITY_RTOL[dtype] = 10.0
        print("note: the export's parity bound is lifted for these random weights (a timing run)")
        build_bundle(target, f"assistant:{assistant}", bundle, max_seq=1024, max_draft=8, dtype="int4", log=print)
    from benchmarks.provenance import provenance
    from specdeploy.runtime import Session
    from specdeploy.runtime.decoding.sampling import SamplingParams

    session = Session(bundle, prompt_cache=False)
    rng = np.random.default_rng(0)
    n = args.context
    ids = rng.integers(3, 16384, size=n + 8)
    session.target.forward(ids[: n - 1], 0)  # the context's K/V and states
    times = {"target step (T=1)": [], "target verify (T=4)": [], "assistant step": []}
    for _ in range(args.rounds):
        for _ in range(args.steps):
            t0 = time.perf_counter()
            session.target.forward(ids[n - 1 : n], n - 1)
            times["target step (T=1)"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            session.target.forward(ids[n - 1 : n + 3], n - 1)
            times["target verify (T=4)"].append(time.perf_counter() - t0)
            proposal = session.drafter.propose(ids[: n], 1, SamplingParams(), rng)
            times["assistant step"].append(proposal.seconds)
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    step = medians["target step (T=1)"]
    print(f"\nposition {n}, medians of {args.rounds} x {args.steps} (ms; ratio to a target step):")
    for name, ms in medians.items():
        print(f"  {name:<22} {ms:8.2f} ms  {ms / step:5.3f}")
    sizes = {role: (bundle / session.bundle.model(role).graph).stat().st_size / 2**20 for role in ("target", "draft")}
    print(f"  graph files: target {sizes['target']:.0f} MiB, assistant {sizes['draft']:.0f} MiB")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"provenance": provenance(), "position": n, "steps": args.steps,
                                        "rounds": args.rounds, "median_ms": medians, "graph_mib": sizes}, indent=1))


if __name__ == "__main__":
    main()
