"""The TensorRT checks, for a person on a machine with TensorRT (>= 10.15) and an NVIDIA GPU.

    python -m proofs.trt_check engines/NAME [--workspace-gb 4] [--rebuild] [--context 256]
        [--repeats 50] [--prompts FILE] [--limit 4] [--max-new-tokens 48] [--json OUT]

1. static: `check_bundle` (the parser's operator table) must list nothing.
2. build: `build_engines` writes `<role>.plan` for every model (skipped when the manifest
   already records engines from this TensorRT and GPU, unless --rebuild).
3. parity: the same passes (a prefill chunk, single steps, verify passes at several write
   positions) through TrtEngine and OrtEngine: the largest logit difference relative to the
   largest logit, and the rows whose argmax differs.
4. tokens: greedy plain decoding on TensorRT == on ONNX Runtime (strict for fp32 bundles,
   reported for fp16), and speculative decoding on TensorRT == plain on TensorRT, token for
   token (lossless: strict).
5. syncs (model drafts): a greedy speculative decode over engines built with the argmax output
   synchronises the host once per prefill pass and once per round (plus one per leading chunk
   of the draft's first catch-up on a prompt longer than every profile), counted by the engines.
6. latency: wall time per forward (inputs up, pass, logits down, the one sync), T = 1 and
   T = k+1 at a context of --context tokens, eager enqueue vs CUDA graph replay, per model.

Prints markdown tables and exits 1 if a check fails.
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--workspace-gb", type=float, default=4.0)
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--context", type=int, default=256, help="write position of the timed passes")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--prompts", default=str(PROMPTS / "prompts.txt"))
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--parity-bound", type=float, help="largest relative logit difference allowed "
                    "(default 1e-3 for fp32, built without TF32; 5e-2 for fp16)")
    ap.add_argument("--json")
    args = ap.parse_args()

    from specdeploy.export.trt_build import build_engines
    from specdeploy.export.trt_ops import check_bundle
    from specdeploy.runtime import load_bundle
    from specdeploy.runtime.backends.cuda import Cuda, import_modules

    report: dict = {"bundle": args.bundle, "checks": {}}
    failures: list[str] = []

    problems = check_bundle(args.bundle)
    report["checks"]["static"] = [str(p) for p in problems]
    print(f"## static op check: {len(problems)} problem(s)")
    for p in problems:
        print(f"- {p}")
    if problems:
        return _finish(report, ["static op check"], args)

    trt, cudart = import_modules()
    gpu, cc = Cuda(cudart).device()
    report.update(tensorrt=trt.__version__, gpu=gpu, compute_capability=cc)
    print(f"\nTensorRT {trt.__version__} on {gpu} (compute capability {cc})")
    bundle = load_bundle(args.bundle, verify=False)  # plans may be missing: then they are built
    entries = [m.trt for m in bundle.manifest.models.values()]
    current = all(e and (e["tensorrt_version"], e["gpu_name"], e["compute_capability"]) == (trt.__version__, gpu, cc)
                  and bundle.file(e["plan"]).is_file() for e in entries)
    if args.rebuild or not current:
        t0 = time.perf_counter()
        build_engines(args.bundle, workspace_gb=args.workspace_gb, log=print)
        report["build_seconds"] = round(time.perf_counter() - t0, 1)
    bundle = load_bundle(args.bundle)  # every sha256, the plans' included

    roles = list(bundle.manifest.models)
    report["checks"]["parity"] = {}
    print("\n## parity against ONNX Runtime (same passes, same inputs)\n")
    print("| model | dtype | passes | max rel. logit diff | bound | argmax rows differing |")
    print("|---|---|---|---|---|---|")
    for role in roles:
        row = _parity(bundle, role, args)
        report["checks"]["parity"][role] = row
        print(f"| {role} | {row['dtype']} | {row['passes']} | {row['max_rel_diff']:.2e} | {row['bound']:.0e} | "
              f"{row['argmax_differ']}/{row['rows']} |")
        if row["max_rel_diff"] > row["bound"]:
            failures.append(f"{role} parity")

    print("\n## greedy tokens\n")
    tokens = _tokens(bundle, args)
    report["checks"]["tokens"] = tokens
    for name, result in tokens.items():
        print(f"- {name}: {result['equal']}/{result['prompts']} prompts equal"
              + (f" (first difference: {result['first_difference']})" if result["first_difference"] else ""))
        if result["equal"] < result["prompts"] and result["strict"]:
            failures.append(name)

    if bundle.draft_kind in ("model", "self"):
        syncs = _round_syncs(bundle, args)
        report["checks"]["round_syncs"] = syncs
        print(f"\n## host synchronisations over a greedy speculative decode (k={syncs['k']})\n")
        print(f"- fused rounds offered: {syncs['fused']}; counted {syncs['counted']}, expected {syncs['expected']} "
              f"= {syncs['prefill_passes']} prefill + {syncs['rounds']} rounds + {syncs['catch_up_chunks']} catch-up chunks")
        if not syncs["fused"] or syncs["counted"] != syncs["expected"]:
            failures.append("one sync per round")

    print(f"\n## latency per forward at context {args.context} (ms, median of {args.repeats}; wall: inputs up, pass, "
          "logits down, sync)\n")
    print("| model | T | eager enqueue | graph replay | replay / eager |")
    print("|---|---|---|---|---|")
    report["latency"] = []
    for role in roles:
        for t in (1, bundle.max_draft + 1):
            row = _latency(bundle, role, t, args)
            report["latency"].append(row)
            print(f"| {role} | {t} | {row['eager_ms']:.3f} | {row['graph_ms']:.3f} | {row['graph_ms'] / row['eager_ms']:.2f} |"
                  + ("" if row["graph_mode"] == "replay" else f" (graph path ran {row['graph_mode']}: {row['graph_status']})"))
    return _finish(report, failures, args)


def _engines(bundle, role, **kwargs):
    from specdeploy.runtime.backends.ort import OrtEngine
    from specdeploy.runtime.backends.trt import TrtEngine

    spec = bundle.model(role)
    return TrtEngine.from_bundle(bundle, spec, **kwargs), OrtEngine(bundle.file(spec.graph), spec, bundle.max_seq)


def _parity(bundle, role, args) -> dict:
    from specdeploy.export.onnx_export import parity_schedule

    trt_engine, ort_engine = _engines(bundle, role)
    dtype = bundle.model(role).dtype
    bound = args.parity_bound or (1e-3 if dtype == "fp32" else 5e-2)
    schedule = parity_schedule(bundle.max_seq, bundle.max_draft, bundle.prefill_chunk)
    total = sum(t for _, t in schedule)
    ids = np.random.default_rng(0).integers(0, trt_engine.vocab_size, size=total)
    compared = compare_passes(trt_engine, ort_engine, ids, schedule)
    trt_engine.close()
    return {"dtype": dtype, **compared, "bound": bound, "graphs": trt_engine.stats}


def _decode(target, drafter, ids, k, args, bundle, stats=None):
    from specdeploy.runtime.decoding.loop import DecodeSettings, decode
    from specdeploy.runtime.decoding.policy import DraftLength
    from specdeploy.runtime.decoding.sampling import SamplingParams
    from specdeploy.runtime.decoding.stats import Stats

    settings = DecodeSettings(args.max_new_tokens, (), bundle.prefill_chunk, SamplingParams(),
                              DraftLength(bundle.max_draft, fixed=k))
    out = decode(target, drafter, ids, settings, Stats() if stats is None else stats)
    return np.concatenate(list(out))


def _round_syncs(bundle, args) -> dict:
    from specdeploy.runtime.decoding.drafters import ModelDrafter
    from specdeploy.runtime.decoding.stats import Stats
    from specdeploy.runtime.decoding.tokenizer import Tokenizer

    tok = Tokenizer(bundle.file(bundle.tokenizer.file), bundle.tokenizer)
    prompt = next(p for p in Path(args.prompts).read_text().splitlines() if p.strip())
    ids = np.asarray(tok.encode_chat(prompt), dtype=np.int64)
    target, drafter, k = _engines(bundle, "target")[0], ModelDrafter(_engines(bundle, "draft")[0]), min(4, bundle.max_draft)
    _decode(target, drafter, ids, k, args, bundle)  # CUDA graphs are captured here, outside the count
    before, stats = target.host_syncs + drafter.engine.host_syncs, Stats()
    _decode(target, drafter, ids, k, args, bundle, stats)
    row = {
        "k": k, "fused": drafter.fused_with(target), "counted": target.host_syncs + drafter.engine.host_syncs - before,
        "prefill_passes": -(-(ids.shape[0] - 1) // bundle.prefill_chunk), "rounds": stats.target_passes,
        "catch_up_chunks": (ids.shape[0] - 1) // drafter.engine.t_max,  # the first round's pending text is the prompt
    }
    row["expected"] = row["prefill_passes"] + row["rounds"] + row["catch_up_chunks"]
    return row


def _tokens(bundle, args) -> dict:
    from specdeploy.runtime.decoding.drafters import ModelDrafter, drafter_class
    from specdeploy.runtime.decoding.tokenizer import Tokenizer

    tok = Tokenizer(bundle.file(bundle.tokenizer.file), bundle.tokenizer)
    prompts = [p for p in Path(args.prompts).read_text().splitlines() if p.strip()][: args.limit]
    target, ort_target = _engines(bundle, "target")
    k = min(4, bundle.max_draft)
    if bundle.model("draft") is not None:
        drafter = ModelDrafter(_engines(bundle, "draft")[0])
    else:  # model-free (or none): no engine to build
        drafter = drafter_class(bundle.draft_kind).from_bundle(bundle, "ort", None)
    # Across backends the kernels differ, so equal tokens are expected at fp32 (built without
    # TF32) and only reported at fp16; within TensorRT, speculation is lossless: strict.
    checks = {"TensorRT plain == ONNX Runtime plain": bundle.model("target").dtype == "fp32"}
    if drafter is not None:
        checks[f"TensorRT speculative (k={k}) == TensorRT plain"] = True
    results = {name: {"strict": strict, "equal": 0, "prompts": len(prompts), "first_difference": None}
               for name, strict in checks.items()}
    for prompt in prompts:
        ids = np.asarray(tok.encode_chat(prompt), dtype=np.int64)
        plain = _decode(target, None, ids, 0, args, bundle)
        others = [_decode(ort_target, None, ids, 0, args, bundle)]
        if drafter is not None:
            others.append(_decode(target, drafter, ids, k, args, bundle))
        for result, other in zip(results.values(), others):
            if np.array_equal(plain, other):
                result["equal"] += 1
            elif result["first_difference"] is None:
                n = min(len(plain), len(other))
                differ = np.flatnonzero(plain[:n] != other[:n])
                result["first_difference"] = f"prompt {prompt[:30]!r}, token {int(differ[0]) if differ.size else n}"
    return results


def _latency(bundle, role, t, args) -> dict:
    from specdeploy.runtime.backends.trt import TrtEngine

    spec = bundle.model(role)
    start = min(args.context, bundle.max_seq - t)
    ids = np.arange(t) % spec.vocab_size
    row = {"model": role, "T": t, "context": start}
    for name, graphs in (("eager", False), ("graph", True)):
        engine = TrtEngine.from_bundle(bundle, spec, cuda_graphs=graphs)
        for _ in range(3):  # the first pass of a shape captures its graph
            engine.forward(ids, start)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.forward(ids, start)
            times.append(time.perf_counter() - t0)
        row[f"{name}_ms"] = statistics.median(times) * 1e3
        row[f"{name}_mode"] = engine.last_mode
        row[f"{name}_status"] = next(iter(engine.graph_status.values()), "")
        engine.close()
    return row


def _finish(report, failures, args) -> int:
    report["failures"] = failures
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    print("\n" + ("all checks passed" if not failures else f"FAILED: {', '.join(failures)}"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
