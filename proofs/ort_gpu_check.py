"""The ONNX Runtime GPU check, for a machine with onnxruntime-gpu and an NVIDIA GPU.

    python -m proofs.ort_gpu_check engines/NAME [--device cuda:0] [--trt-ep] [--prompts FILE] [--limit 4]
        [--max-new-tokens 48] [--lens 1,2,4,8] [--context 256] [--repeats 50] [--threads N] [--skip-cpu] [--json OUT]
    python -m proofs.ort_gpu_check engines/NAME --device cpu ...   # the rehearsal, on the CPU provider

Every step runs the runtime's own code; nothing here imports torch. With `--device cpu` the
"device" engines are CPU engines with the CUDA-graph bookkeeping on (`Placement(capture=True)`:
per-shape bindings, graph ids, bucketed windows; nothing is captured), the reference the
plain CPU engine: the script runs end to end where no GPU is.

1. placement: onnxruntime's version and providers, the GPU's name (from the driver), the
   providers each graph of the session really runs on (`session.get_providers()`), CUDA graphs
   on or off.
2. parity: the same passes (prefill chunks, single steps and verify passes at write positions
   across window buckets) through the session's engine on the device and a CPU engine: largest
   logit difference relative to the largest logit, argmax rows differing. Bounds: fp32 1e-3
   (TF32 off), fp16 5e-2, int8/int4 0.25 (the CPU rounds activations to int8 per block, the
   CUDA MatMulNBits does not). And captured against uncaptured passes on the device.
3. lossless: greedy speculative decoding == greedy plain decoding on the device, token for
   token, for every prompt and draft length (strict: the product's contract); plain on the
   device == plain on the CPU (reported: kernels differ across providers).
4. buffers: KV addresses unchanged through every generation; each captured pass shape gets one
   graph, and a repeated generation captures nothing new.
5. latency: ms per forward at a context of --context tokens, T = 1 and T = k+1, per model:
   uncaptured, captured (graph replay), TensorRT EP (with --trt-ep); then decoding tok/s,
   plain and speculative at each draft length (median over prompts, after a warm-up).

Prints markdown; exits 1 if a check fails, 2 if the device or its provider is not there (the
runtime's one-line error).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from proofs.parity import compare_passes

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks"
BOUNDS = {"fp32": 1e-3, "fp16": 5e-2, "int8": 0.25, "int4": 0.25}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--device", default="cuda:0", help="cuda[:N]; cpu rehearses the script on the CPU provider")
    ap.add_argument("--trt-ep", action="store_true", help="the session on ONNX Runtime's TensorRT execution provider")
    ap.add_argument("--prompts", default=str(PROMPTS / "prompts.txt"))
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--lens", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=256, help="write position of the timed passes")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--skip-cpu", action="store_true", help="no CPU reference (parity, plain tokens): for models too "
                    "large to run on this machine's CPU")
    ap.add_argument("--json")
    args = ap.parse_args()

    import onnxruntime as ort

    from specdeploy.core.errors import SpecdeployError
    from specdeploy.runtime import Session, load_bundle
    from specdeploy.runtime.backends.devices import Device, device_name

    bundle = load_bundle(args.bundle)
    device = Device.parse(args.device)
    rehearsal = device.kind == "cpu"
    report: dict = {"bundle": args.bundle, "device": str(device), "rehearsal": rehearsal, "onnxruntime": ort.__version__,
                    "available_providers": ort.get_available_providers(), "checks": {}}
    try:
        session = Session(bundle, threads=args.threads, device=device, trt_ep=args.trt_ep, prompt_cache=False)
    except SpecdeployError as e:
        print(f"error: {e}")
        report["error"] = str(e)
        _write(report, args)
        return 2
    if rehearsal:  # the CUDA-graph bookkeeping on the CPU provider
        _swap_engines(session, lambda spec: _engine(bundle, spec, device, capture=True, threads=args.threads))
    engines = _engines(session)
    report["gpu"] = device_name(device)
    report["placement"] = {role: {"providers": e.providers, "placement": str(e.placement), "capture": e.placement.capture}
                           for role, e in engines.items()}
    print(f"# ONNX Runtime {ort.__version__} on {report['gpu']} ({device})" + (" — rehearsal on the CPU provider" if rehearsal else ""))
    print(f"available providers: {', '.join(report['available_providers'])}")
    for role, row in report["placement"].items():
        print(f"- {role}: {row['placement']}; session providers {row['providers']}"
              + ("; capture bookkeeping only (nothing to capture on the CPU)" if rehearsal and row["capture"] else ""))
    failures: list[str] = []

    print("\n## parity (same passes, same inputs)\n")
    print("| model | dtype | compared | passes | max rel. logit diff | bound | argmax rows differing |")
    print("|---|---|---|---|---|---|---|")
    report["checks"]["parity"] = []
    for role, engine in engines.items():
        spec = bundle.model(role)
        pairs = [] if args.skip_cpu else [(f"the session's ({engine.placement}) vs the CPU engine", engine,
                                           _engine(bundle, spec, Device("cpu"), threads=args.threads))]
        if engine.placement.capture:
            pairs.append(("captured vs uncaptured", engine, _engine(bundle, spec, device, capture=False, threads=args.threads)))
        for name, got, want in pairs:
            row = {"model": role, "dtype": spec.dtype, "compared": name, **_parity(got, want, bundle), "bound": BOUNDS[spec.dtype]}
            report["checks"]["parity"].append(row)
            print(f"| {role} | {spec.dtype} | {name} | {row['passes']} | {row['max_rel_diff']:.2e} | {row['bound']:.2g} | "
                  f"{row['argmax_differ']}/{row['rows']} |")
            if row["max_rel_diff"] > row["bound"]:
                failures.append(f"{role} parity ({name})")

    prompts = _prompts(session, args)
    lens = [int(k) for k in args.lens.split(",") if int(k) <= bundle.max_draft] if session.drafter is not None else []
    print(f"\n## lossless: greedy speculative == greedy plain on {device} ({len(prompts)} prompts, "
          f"{args.max_new_tokens} new tokens)\n")
    kv0 = {role: e.kv_addresses() for role, e in engines.items()}
    for ids in prompts[:1]:  # warm-up: first passes of each shape allocate (and, on CUDA, capture)
        for k in [0] + lens:
            session.generate(prompt_ids=ids, max_new_tokens=min(8, args.max_new_tokens), draft_len=k, speculate=k > 0)
    graphs0 = {role: e.graph_shapes for role, e in engines.items()}
    cpu = Session(bundle, threads=args.threads, prompt_cache=False) if not (rehearsal or args.skip_cpu) else None
    lossless, runs = _lossless(session, cpu, prompts, lens, args)
    report["checks"]["lossless"] = lossless
    for name, row in lossless.items():
        print(f"- {name}: {row['equal']}/{row['prompts']} prompts equal"
              + (f" (first difference: {row['first_difference']})" if row["first_difference"] else "")
              + ("" if row["strict"] else " (reported, not judged)"))
        if row["strict"] and row["equal"] < row["prompts"]:
            failures.append(name)

    print("\n## buffers and graphs\n")
    kv_same = all(e.kv_addresses() == kv0[role] for role, e in engines.items())
    report["checks"]["kv_addresses_unchanged"] = kv_same
    print(f"- KV buffers kept their {'device ' if not rehearsal else ''}addresses through every generation: {kv_same}")
    if not kv_same:
        failures.append("KV addresses")
    report["checks"]["graphs"] = {}
    for role, e in engines.items():
        shapes = e.graph_shapes
        row = {"captured_shapes": shapes, "after_warmup": len(graphs0[role]), "unique": len(set(shapes)) == len(shapes),
               "t_within": all(t <= e.placement.capture_max_t for t, _ in shapes),
               "captured_runs": e.captured_runs, "uncaptured_runs": e.uncaptured_runs}
        report["checks"]["graphs"][role] = row
        if e.placement.capture:
            print(f"- {role}: {len(shapes)} pass shapes (T, L) with a graph of their own ({len(graphs0[role])} after the "
                  f"warm-up); {e.captured_runs} passes replayed, {e.uncaptured_runs} uncaptured (longer passes)")
            if not (row["unique"] and row["t_within"]):
                failures.append(f"{role} graph bookkeeping")
        else:
            print(f"- {role}: no CUDA graphs ({e.placement})")
    repeat = {role: e.graph_shapes for role, e in engines.items()}
    for k in [0] + lens:  # the same generations again: every shape has its graph already
        session.generate(prompt_ids=prompts[0], max_new_tokens=args.max_new_tokens, draft_len=k, speculate=k > 0)
    nothing_new = all(e.graph_shapes == repeat[role] for role, e in engines.items())
    report["checks"]["repeat_captures_nothing"] = nothing_new
    print(f"- a repeated generation added no graph: {nothing_new}")
    if not nothing_new:
        failures.append("repeat captured a new graph")

    print(f"\n## latency per forward at context {args.context} (ms, median of {args.repeats}; inputs up, pass, logits down)\n")
    kinds = [("uncaptured", dict(capture=False)), ("captured", dict(capture=True))]
    if args.trt_ep:
        kinds.append(("TensorRT EP", dict(trt_ep=True)))
    print("| model | T | " + " | ".join(name for name, _ in kinds) + " | captured / uncaptured |")
    print("|---|---|" + "---|" * len(kinds) + "---|")
    report["latency"] = []
    for role in engines:
        spec = bundle.model(role)
        timed = {name: _engine(bundle, spec, device, threads=args.threads, **kw) for name, kw in kinds}
        for t in sorted({1, max(lens, default=0) + 1}):
            row = {"model": role, "T": t, **{f"{name}_ms": _latency(e, t, args) for name, e in timed.items()}}
            report["latency"].append(row)
            print(f"| {role} | {t} | " + " | ".join(f"{row[f'{name}_ms']:.3f}" for name, _ in kinds)
                  + f" | {row['captured_ms'] / row['uncaptured_ms']:.2f} |")

    print(f"\n## decoding on {device} (tok/s, median over prompts, after the warm-up)\n")
    print("| run | tok/s | speedup over plain | acceptance | tokens per target pass |")
    print("|---|---|---|---|---|")
    report["decoding"] = {}
    plain_tps = statistics.median(r.tokens_per_second for r in runs["plain"])
    for name, rows in runs.items():
        tps = statistics.median(r.tokens_per_second for r in rows)
        row = {"tokens_per_second": tps, "speedup": tps / plain_tps if plain_tps else 0.0,
               "acceptance": statistics.median(r.acceptance_rate for r in rows),
               "tokens_per_pass": statistics.median(r.mean_accepted for r in rows)}
        report["decoding"][name] = row
        print(f"| {name} | {tps:.1f} | {row['speedup']:.2f} | {row['acceptance']:.2f} | {row['tokens_per_pass']:.2f} |")
    report["failures"] = failures
    _write(report, args)
    print("\n" + ("all checks passed" if not failures else f"FAILED: {', '.join(failures)}"))
    return 1 if failures else 0


def _engine(bundle, spec, device, capture=None, trt_ep=False, threads=None):
    from specdeploy.runtime.backends.ort import OrtEngine

    return OrtEngine.from_bundle(bundle, spec, threads, device=device, trt_ep=trt_ep, capture=capture)


def _engines(session) -> dict:
    engines = {"target": session.target}
    if session.drafter is not None and session.drafter.engine is not None:
        engines["draft"] = session.drafter.engine
    return engines


def _swap_engines(session, make) -> None:
    """The session's engines replaced by `make(spec)`'s (a model drafter keeps its kind and cost)."""
    session.target = make(session.bundle.model("target"))
    if session.drafter is not None and session.drafter.engine is not None:
        session.drafter = type(session.drafter)(make(session.bundle.model("draft")), session.drafter.cost_ratio)


def _schedule(max_seq: int, max_draft: int, chunk: int) -> list[tuple[int, int]]:
    """(write position, T) of the parity passes, in order: prefill chunks, single steps and
    verify passes (each verify pass then moves on by one, as a round that accepted nothing),
    over the whole buffer, so the windows cross every bucket."""
    cycle, passes, start = [chunk, 1, max_draft + 1, 1, 2], [], 0
    while start + max_draft + 1 <= max_seq and len(passes) < 60:
        t = cycle[len(passes) % len(cycle)]
        passes.append((start, t))
        start += 1 if t == max_draft + 1 else t
    return passes


def _parity(got_engine, want_engine, bundle) -> dict:
    schedule = _schedule(bundle.max_seq, bundle.max_draft, bundle.prefill_chunk)
    ids = np.random.default_rng(0).integers(0, want_engine.vocab_size, size=bundle.max_seq)
    return compare_passes(got_engine, want_engine, ids, schedule)


def _prompts(session, args) -> list[np.ndarray]:
    from specdeploy.runtime.tools.bench import read_prompts

    chat = bool(session.tokenizer.chat_template)
    room = session.bundle.max_seq - args.max_new_tokens
    out = []
    for text in read_prompts(Path(args.prompts)):
        ids = np.asarray(session.encode(text, chat=chat), dtype=np.int64)
        if 1 <= ids.shape[0] <= room:
            out.append(ids)
        if len(out) == args.limit:
            break
    return out


def _lossless(session, cpu, prompts, lens, args) -> tuple[dict, dict]:
    checks = {f"speculative k={k} == plain": True for k in lens}
    if cpu is not None:
        checks["plain on the device == plain on the CPU"] = False
    results = {name: {"strict": strict, "equal": 0, "prompts": len(prompts), "first_difference": None}
               for name, strict in checks.items()}
    runs: dict = {"plain": [], **{f"k={k}": [] for k in lens}}
    for ids in prompts:
        plain = session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, speculate=False)
        runs["plain"].append(plain.stats)
        others = []
        for k in lens:
            spec = session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, draft_len=k)
            runs[f"k={k}"].append(spec.stats)
            others.append(spec.token_ids)
        if cpu is not None:
            others.append(cpu.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, speculate=False).token_ids)
        for row, other in zip(results.values(), others):
            if other == plain.token_ids:
                row["equal"] += 1
            elif row["first_difference"] is None:
                n = min(len(other), len(plain.token_ids))
                at = next((i for i in range(n) if other[i] != plain.token_ids[i]), n)
                row["first_difference"] = f"prompt of {ids.shape[0]} tokens, token {at}"
    return results, runs


def _latency(engine, t: int, args) -> float:
    """Median ms of a pass of T tokens at the context (the buffer filled up to it first)."""
    start = min(args.context, engine.max_seq - t)
    ids = np.arange(engine.max_seq) % engine.vocab_size
    for at in range(0, start, 64):
        engine.forward(ids[at : min(at + 64, start)], at)
    tokens = ids[start : start + t]
    for _ in range(3):  # the first pass of a shape allocates (and captures its graph)
        engine.forward(tokens, start)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        engine.forward(tokens, start)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _write(report: dict, args) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
