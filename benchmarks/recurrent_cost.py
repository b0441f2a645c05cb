"""What returning a linear-attention layer's states after every row costs a verify pass, on this CPU.

    python -m benchmarks.recurrent_cost [--work DIR] [--context 256] [--steps 20] [--rounds 5] [--batch 4] [--json OUT]

No Qwen3.5 checkpoint can be fetched here, so the model is random, in the published layout, at a
shape stated in the output: Qwen3.5-0.8B's layer shapes as its config gives them (hidden 1024,
linear layers with 16 key and 16 value heads of 128, attention with 8 heads of 256 and 2 K/V
heads, MLP 3584) but 8 layers (6 linear, 2 full) and a 16k vocabulary, exported int4 (the CPU
default). Medians of --rounds x --steps passes at position --context, taking turns (and of a
prefill of the --context prompt tokens in 64-token chunks, once a round): a T = 1
step (plain decoding's pass: one state out), a T = 9 verify pass returning every row (9 states
out: what the runtime asks of a verify pass), and the same 9 tokens returning their last row
only (1 state out, as a prefill chunk). The difference between the last two is the price of
the per-row states (and of 8 rows of logits, 2% of the head's weights here). Beside it, the
same shapes with every layer full attention (no states), its step and 9-token pass in the same
rounds: what a verify pass costs a model without recurrences. Random weights cost what trained
ones do: the work is the shapes'.

With --batch B (> 1), the same rounds also time a batched verify pass of B sequences (each in its
KV slot at position --context, T = 9, every row's state out: runtime/backends/ort.py's forward_batch stages
each slot's state in and copies its B x 9 states back into its ring), beside B single-sequence
verify passes one after another and a batched pass of the all-attention model; and a batched step
(T = 1) of B sequences beside B single steps.
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

SHAPE = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4, vocab_size=16384, initializer_range=0.02, max_position_embeddings=4096,
             layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import tiny
    from specdeploy.core.manifest import load_bundle
    from specdeploy.export import build_bundle
    from specdeploy.runtime.backends.ort import OrtEngine

    work = args.work or Path(tempfile.mkdtemp(prefix="recurrent-cost-"))
    engines = {}
    for name, kinds in (("model", SHAPE["layer_types"]), ("attention", ["full_attention"] * len(SHAPE["layer_types"]))):
        model, bundle_dir = work / name, work / f"{name}-bundle"
        if not (model / "config.json").is_file():
            tiny.make_model(model, "qwen3_5_text", layers=len(kinds), **{**SHAPE, "layer_types": kinds})
        if not (bundle_dir / "manifest.json").is_file():
            build_bundle(model, "ngram", bundle_dir, dtype="int4", max_seq=1024, max_draft=8)
        bundle = load_bundle(bundle_dir)
        engines[name] = (OrtEngine.from_bundle(bundle, bundle.model("target")), bundle_dir)
    (engine, bundle_dir), (attention, _) = engines["model"], engines["attention"]
    spec = engine.spec
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, spec.vocab_size, size=args.context + 9)
    engine.forward(prompt[: args.context], 0, last=True)
    attention.forward(prompt[: args.context], 0, last=True)
    at = args.context  # every pass starts here: the state kept at `context` is read each time
    passes = {
        "step (T=1, 1 state out)": lambda: engine.forward(prompt[at : at + 1], at),
        "verify (T=9, 9 states out)": lambda: engine.forward(prompt[at : at + 9], at),
        "verify tokens, last row only (T=9, 1 state out)": lambda: engine.forward(prompt[at : at + 9], at, last=True),
        "all-attention model: step (T=1)": lambda: attention.forward(prompt[at : at + 1], at),
        "all-attention model: verify (T=9)": lambda: attention.forward(prompt[at : at + 9], at),
    }
    if args.batch > 1:
        from specdeploy.runtime.backends import make_batch_engine

        b = args.batch
        batched = {}
        for name, (_, folder) in engines.items():
            bundle = load_bundle(folder)
            batched[name] = make_batch_engine("ort", bundle, b)
            for slot in range(b):
                batched[name].forward_batch(prompt[None, : args.context], np.array([0]), first=slot, last=True)
        rows = np.repeat(prompt[None, at : at + 9], b, axis=0)
        starts = np.full(b, at, dtype=np.int64)
        passes[f"batched verify, {b} sequences (T=9, {b}x9 states out)"] = lambda: batched["model"].forward_batch(rows, starts)
        passes[f"{b} single verify passes (T=9)"] = lambda: [engine.forward(prompt[at : at + 9], at) for _ in range(b)]
        passes[f"all-attention model: batched verify, {b} sequences"] = lambda: batched["attention"].forward_batch(rows, starts)
        passes[f"batched step, {b} sequences (T=1)"] = lambda: batched["model"].forward_batch(rows[:, :1], starts)
        passes[f"{b} single steps (T=1)"] = lambda: [engine.forward(prompt[at : at + 1], at) for _ in range(b)]
    times = {name: [] for name in passes}
    prefills = {"model": [], "attention": []}
    for _ in range(args.rounds):
        for name, e in (("model", engine), ("attention", attention)):  # the prompt again, 64-token chunks
            t0 = time.perf_counter()
            for s in range(0, args.context, 64):
                e.forward(prompt[s : min(s + 64, args.context)], s, last=True)
            prefills[name].append(time.perf_counter() - t0)
        for name, run in passes.items():
            run()  # the first pass of a round settles the caches
            for _ in range(args.steps):
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    step = medians["step (T=1, 1 state out)"]
    per_position = spec.state_bytes
    result = {
        "shape": {**{k: v for k, v in SHAPE.items() if k != "layer_types"}, "layers": len(SHAPE["layer_types"]),
                  "linear_layers": SHAPE["layer_types"].count("linear_attention"), "dtype": "int4"},
        "context": args.context,
        "state_bytes_per_position": per_position,
        "weights_bytes": sum(p.stat().st_size for p in bundle_dir.glob("target.onnx*")),
        "median_ms": medians,
        "over_a_step": {name: ms / step for name, ms in medians.items()},
        "samples": args.rounds * args.steps,
    }
    try:
        from benchmarks.provenance import provenance
    except ModuleNotFoundError:  # run as a file
        from provenance import provenance
    result["provenance"] = provenance()
    print(f"states: {per_position / 2**20:.2f} MiB a position; weights {result['weights_bytes'] / 2**20:.0f} MiB")
    result["prefill_ms"] = {name: statistics.median(t) * 1e3 for name, t in prefills.items()}
    own = medians["all-attention model: step (T=1)"]
    result["all_attention_verify_over_its_step"] = medians["all-attention model: verify (T=9)"] / own
    for name, ms in medians.items():
        print(f"{name:<50} {ms:8.2f} ms  {ms / step:5.2f}x a step")
    print(f"all-attention model: a 9-token pass is {result['all_attention_verify_over_its_step']:.2f}x its own step")
    print(f"prefill of {args.context} tokens (64-token chunks): {result['prefill_ms']['model']:.0f} ms, "
          f"all-attention model {result['prefill_ms']['attention']:.0f} ms")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
