"""The prepared GPU check of the torch backend (issue 6): one script, nothing to download.

    python benchmarks/gpu_check.py OUT           # a CUDA machine: ~1B Llama target, ~100M draft
    python benchmarks/gpu_check.py --tiny OUT    # tiny models; runs on a CPU too (checks the script)

Models are random-weight Llamas built in memory from transformers configs (latency does not
depend on the weights' values): a Llama-3.2-1B-shaped target and a ~100M draft with the
same 128k vocabulary. Sections, each timed:

1. replay == eager (fp32): the same passes (a prefill chunk, steps, verify passes across
   window buckets) through a captured engine and an eager one over the same weights:
   logits within 1e-4 of the largest logit and the same argmax in every row.
2. lossless (fp32): greedy plain decoding captured == eager, token for token, and
   speculative decoding at k = 1..8 == plain, with an independent draft (rejections) and
   with the target drafting for itself (acceptances, bonus tokens).
3. host syncs: captured and eager passes run under torch.cuda.set_sync_debug_mode("error"):
   nothing but the one explicit sync per pass.
4. latency (bf16): draft step and verify pass T = 1..9, eager vs captured, at a context of
   256: device time per pass (CUDA events around the launch) and wall time per forward
   (inputs up, logits down, the sync).
5. the loop (bf16): tokens/s, plain and speculative at k = 1..8, captured and eager, with
   two drafts that bound what speculation can do: `random` (independent weights: accepts
   almost nothing) and `agreeing` (both models' attention and MLP outputs scaled down so
   each predicts its input token: accepts everything), with the analytic model's
   predicted speedup from the measured acceptance and cost ratio beside the measurement.

Writes OUT/gpu_check.json and OUT/gpu_check.png, prints markdown tables, exits 1 if a
check fails. Fits in 6 minutes on one H200.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _import_specdeploy():
    """Use the installed package, or map the checkout's folders onto it (a machine where
    the project is not installed: export/ -> specdeploy.export, runtime/ -> specdeploy.runtime)."""
    try:
        import specdeploy.runtime  # noqa: F401
    except ImportError:
        pass
    else:
        return
    shim = Path(tempfile.mkdtemp(prefix="specdeploy-shim-")) / "specdeploy"
    shim.mkdir()
    (shim / "export").symlink_to(ROOT / "export")
    (shim / "runtime").symlink_to(ROOT / "runtime")
    sys.path.insert(0, str(shim.parent))


_import_specdeploy()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from specdeploy.export.graph import SpecGraph  # noqa: E402
from specdeploy.runtime.backends.torch_engine import TorchEngine  # noqa: E402
from specdeploy.runtime.bench import acceptance_estimate, predicted_speedup, tokens_per_pass  # noqa: E402
from specdeploy.runtime.bundle import ModelSpec  # noqa: E402
from specdeploy.runtime.drafters import ModelDrafter  # noqa: E402
from specdeploy.runtime.loop import DraftLength, Stats, decode  # noqa: E402
from specdeploy.runtime.sampling import SamplingParams  # noqa: E402

VOCAB = 128256
SIZES = {
    # Llama-3.2-1B's shape (rope scaling left out: it changes RoPE's angles, not the cost)
    "target": dict(vocab_size=VOCAB, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                   tie_word_embeddings=True),
    # ~100M: 82M of tied embeddings + 4 layers
    "draft": dict(vocab_size=VOCAB, hidden_size=640, intermediate_size=1792, num_hidden_layers=4,
                  num_attention_heads=10, num_key_value_heads=2, head_dim=64, rope_theta=500000.0,
                  tie_word_embeddings=True),
}
TINY = {
    "target": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "draft": dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True),
}
MAX_SEQ = 1024
MAX_DRAFT = 8
PREFILL_CHUNK = 64
DRAFT_LENS = list(range(1, MAX_DRAFT + 1))


class Check:
    """Collects results; a failed check is recorded and the script goes on."""

    def __init__(self):
        self.report: dict = {"checks": {}, "sections": {}}
        self.failed: list[str] = []
        self.t0 = time.perf_counter()

    def check(self, name: str, ok: bool, **detail) -> None:
        self.report["checks"][name] = {"ok": bool(ok), **detail}
        if not ok:
            self.failed.append(name)
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {'ok  ' if ok else 'FAIL'} {name} {json.dumps(detail)}", flush=True)

    def section(self, name: str, seconds: float) -> None:
        self.report["sections"][name] = round(seconds, 2)
        print(f"[{time.perf_counter() - self.t0:6.1f}s] section {name}: {seconds:.1f}s", flush=True)


# -- models and engines -----------------------------------------------------------------------
def build_graph(role: str, sizes: dict, device: str, dtype: torch.dtype, seed: int, agreeing: bool = False,
                tied: bool = True) -> SpecGraph:
    """A random-weight Llama from its config, built on the device, wrapped as the export
    stage's SpecGraph. `agreeing`: attention and MLP outputs scaled by 1e-3, so the residual
    stream stays its input embedding and the tied head predicts the input token.
    `tied=False`: a head of its own (small tied models drift towards copying their input,
    which would make any two of them agree)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = LlamaConfig(max_position_embeddings=MAX_SEQ * 4, initializer_range=0.02, **{**sizes[role], "tie_word_embeddings": tied})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).eval()
    if agreeing:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(1e-3)
                layer.mlp.down_proj.weight.mul_(1e-3)
    graph = SpecGraph(model)  # RoPE's inverse frequencies stay fp32, as the export keeps them
    inv_freq = graph.inv_freq.float().clone()
    graph = graph.to(dtype).eval()
    graph.inv_freq = inv_freq
    return graph


def spec_of(graph: SpecGraph, role: str, dtype: torch.dtype) -> ModelSpec:
    return ModelSpec(role=role, graph="(in memory)", num_layers=graph.num_layers, num_kv_heads=graph.num_kv_heads,
                     head_dim=graph.head_dim, vocab_size=graph.lm_head.out_features,
                     kv_dtype=str(dtype).removeprefix("torch."), sliding_window=None)


def engine(graph, role, dtype, device, captured: bool) -> TorchEngine:
    # On a CPU nothing is captured; the "captured" engine still runs the fixed-window
    # formulation the graphs are captured with.
    return TorchEngine(graph, spec_of(graph, role, dtype), MAX_SEQ, device=device, capture=captured, buckets=captured,
                       capture_max_t=MAX_DRAFT + 1)


def generate(target, drafter, prompt, new_tokens: int, k: int):
    """Greedy decoding through the runtime's own loop; k = 0 is plain decoding."""
    stats = Stats()
    lengths = DraftLength(MAX_DRAFT, fixed=max(k, 1))
    if drafter is not None:
        drafter.min_confidence = 0.0
    rounds, tokens = [], []
    t0 = time.perf_counter()
    for new in decode(target, drafter if k else None, prompt, new_tokens, lengths, [], PREFILL_CHUNK,
                      SamplingParams(), stats):
        tokens += new.tolist()
        rounds.append((stats.last_proposed, stats.last_accepted))
    return tokens, time.perf_counter() - t0, stats, rounds


# -- sections ---------------------------------------------------------------------------------------
def replay_matches_eager(c: Check, graph, role, device, vocab) -> None:
    eager, captured = engine(graph, role, torch.float32, device, False), engine(graph, role, torch.float32, device, True)
    schedule = [(0, 48), (48, 1), (49, 9), (58, 2), (60, 5), (65, 1), (66, 9), (75, 1), (76, 52), (128, 9), (137, 1)]
    ids = np.random.default_rng(0).integers(0, vocab, size=schedule[-1][0] + schedule[-1][1])
    worst, flips, rows = 0.0, 0, 0
    for _ in range(2):  # the second round replays graphs captured in the first
        for start, t in schedule:
            want = eager.forward(ids[start : start + t], start).copy()
            got = captured.forward(ids[start : start + t], start)
            worst = max(worst, float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max())))
            flips += int((got.argmax(-1) != want.argmax(-1)).sum())
            rows += t
    s = captured.stats
    replayed = s.replays > 0 or not device.startswith("cuda")  # a silent fall-back to eager fails
    c.check(f"replay_matches_eager_{role}", worst <= 1e-4 and flips == 0 and s.capture_error is None and replayed,
            max_rel_diff=worst, argmax_flips=flips, rows=rows, graphs=len(s.graphs), replays=s.replays,
            eager_passes=s.eager, capture_error=s.capture_error)


def lossless(c: Check, device: str, sizes: dict, prompts, new_tokens: int) -> None:
    target_graph = build_graph("target", sizes, device, torch.float32, seed=0, tied=False)
    draft_graph = build_graph("draft", sizes, device, torch.float32, seed=1, tied=False)
    vocab = target_graph.lm_head.out_features
    replay_matches_eager(c, target_graph, "target", device, vocab)
    replay_matches_eager(c, draft_graph, "draft", device, vocab)
    target = engine(target_graph, "target", torch.float32, device, True)
    target_eager = engine(target_graph, "target", torch.float32, device, False)
    drafters = {
        "random": ModelDrafter(engine(draft_graph, "draft", torch.float32, device, True)),
        "self": ModelDrafter(engine(target_graph, "draft", torch.float32, device, True)),  # own KV buffers
    }
    kv0 = target.kv_addresses()
    mismatches, eager_mismatches, accepted, drafted, bonus, rejections, distinct = [], 0, {}, {}, 0, 0, set()
    for p, prompt in enumerate(prompts):
        plain, _, _, _ = generate(target, None, prompt, new_tokens, 0)
        plain_eager, _, _, _ = generate(target_eager, None, prompt, new_tokens, 0)
        eager_mismatches += plain != plain_eager
        distinct.update(plain)
        for name, drafter in drafters.items():
            for k in DRAFT_LENS:
                tokens, _, stats, rounds = generate(target, drafter, prompt, new_tokens, k)
                if tokens != plain:
                    i = next((i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b), min(len(tokens), len(plain)))
                    mismatches.append({"prompt": p, "draft": name, "k": k, "first_difference": i,
                                       "target_margin": top2_margin(target_eager, prompt, plain[:i])})
                accepted[name] = accepted.get(name, 0) + stats.accepted
                drafted[name] = drafted.get(name, 0) + stats.drafted
                bonus += sum(1 for prop, acc in rounds if prop and acc == prop)
                rejections += sum(1 for prop, acc in rounds if acc < prop)
    replayed = target.stats.replays > 0 or not device.startswith("cuda")
    c.check("lossless_replay_equals_eager", eager_mismatches == 0 and replayed, prompts=len(prompts),
            tokens=new_tokens, mismatching_prompts=eager_mismatches, target_engine=target.stats.as_dict())
    # Both paths must have run: rounds accepting every draft (bonus token) and rejections.
    c.check("lossless_speculative_equals_plain", not mismatches and bonus > 0 and rejections > 0,
            runs=len(prompts) * len(DRAFT_LENS) * len(drafters), mismatches=mismatches[:5],
            acceptance={n: round(accepted[n] / max(1, drafted[n]), 4) for n in drafters}, full_accept_rounds=bonus,
            rejections=rejections, distinct_tokens=len(distinct))
    c.check("kv_buffers_keep_addresses", target.kv_addresses() == kv0)
    sync_check(c, target, target_eager, vocab, device)
    round_sync_check(c, target, drafters["self"], prompts[0], new_tokens, device)


def round_sync_check(c: Check, target, drafter, prompt, new_tokens: int, device) -> None:
    """At most one host sync per greedy round: the draft chains its k steps on the device
    and the verify pass reads them there. Counted twice: the engines' own count, and on a
    GPU the synchronising calls PyTorch's sync debug mode reports during the rounds."""
    assert drafter.fused_with(target)
    generate(target, drafter, prompt, new_tokens, 4)  # captures happen here, outside the count
    t0, d0 = target.stats.host_syncs, drafter.engine.stats.host_syncs
    caught = []
    if device.startswith("cuda"):
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _, _, stats, rounds = generate(target, drafter, prompt, new_tokens, 4)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    else:
        _, _, stats, rounds = generate(target, drafter, prompt, new_tokens, 4)
    prefill = -(-(len(prompt) - 1) // PREFILL_CHUNK)
    counted = target.stats.host_syncs - t0 + drafter.engine.stats.host_syncs - d0
    reported = sum(1 for w in caught if "synchroniz" in str(w.message))
    c.check("at_most_one_sync_per_round", counted == prefill + len(rounds) and reported <= prefill + len(rounds),
            rounds=len(rounds), prefill_passes=prefill, engine_syncs=counted,
            debug_mode_syncs=reported if device.startswith("cuda") else "n/a (no CUDA)")


def top2_margin(eager, prompt, committed) -> float:
    """(top-1 - top-2) / max |logit| of the target where the outputs part: a bug parts them
    at any margin, rounding (a verify pass and a step are different matrix shapes, so
    different kernels) only at a near tie. Reported beside a mismatch, never used to pass it."""
    seq = np.concatenate([prompt, np.asarray(committed, dtype=np.int64)])
    for start in range(0, len(seq), PREFILL_CHUNK):
        logits = eager.forward(seq[start : start + PREFILL_CHUNK], start)
    row = logits[-1]
    top = np.sort(row)[-2:]
    return float((top[1] - top[0]) / max(1.0, np.abs(row).max()))


def sync_check(c: Check, captured, eager, vocab, device) -> None:
    """At most one host sync per pass: the logits read. Runs passes under the sync debug
    mode "warn" and counts the synchronising calls it reports (whether the explicit
    stream sync is among them depends on the PyTorch build, hence "at most")."""
    if not device.startswith("cuda"):
        c.check("at_most_one_sync_per_pass", True, skipped="no CUDA: the sync debug mode needs a GPU")
        return
    import warnings

    ids = np.random.default_rng(3).integers(0, vocab, size=9)
    lengths = (1, 5, 9, 1, 2)
    for e in (captured, eager):
        for t in lengths:
            e.forward(ids[:t], 100)  # captures happen here, outside the debug mode
    per_pass = {}
    for name, e in (("captured", captured), ("eager", eager)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for t in lengths:
                    e.forward(ids[:t], 100)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
        per_pass[name] = len(syncs) / len(lengths)
    c.check("at_most_one_sync_per_pass", all(v <= 1 for v in per_pass.values()), syncs_per_pass=per_pass,
            replays=captured.stats.replays)


def latency(c: Check, device: str, sizes: dict, dtype, iters: int) -> dict:
    target_graph = build_graph("target", sizes, device, dtype, seed=0)
    draft_graph = build_graph("draft", sizes, device, dtype, seed=1)
    vocab = target_graph.lm_head.out_features
    table = {}
    context = 256
    ids = np.random.default_rng(4).integers(0, vocab, size=context + MAX_DRAFT + 1)
    outputs, agreement = {}, {}
    for role, graph, ts in (("draft", draft_graph, [1, 2]), ("target", target_graph, list(range(1, MAX_DRAFT + 2)))):
        for mode in ("eager", "captured"):
            e = engine(graph, role, dtype, device, mode == "captured")
            e.forward(ids[:context], 0)  # a context to attend over
            for t in ts:
                for _ in range(3):
                    e.forward(ids[context : context + t], context)  # warm-up (and capture)
                e.time_device = device.startswith("cuda")
                d0 = e.stats.device_seconds
                walls = []
                for _ in range(iters):
                    w0 = time.perf_counter()
                    e.forward(ids[context : context + t], context)
                    walls.append(time.perf_counter() - w0)
                e.time_device = False
                outputs[mode, role, t] = e.forward(ids[context : context + t], context).copy()
                row = table.setdefault(f"{role} T={t}", {})
                row[f"{mode}_forward_us"] = round(1e6 * statistics.median(walls), 1)
                if device.startswith("cuda"):
                    row[f"{mode}_device_us"] = round(1e6 * (e.stats.device_seconds - d0) / iters, 1)
            del e
        for t in ts:  # bf16 replay vs eager: reported, not judged (fp32 above is the exact check)
            want, got = outputs["eager", role, t], outputs["captured", role, t]
            agreement[f"{role} T={t}"] = {
                "max_rel_diff": float(np.abs(got - want).max() / max(1.0, np.abs(want).max())),
                "argmax_flips": int((got.argmax(-1) != want.argmax(-1)).sum()),
            }
    c.report["replay_vs_eager_latency_dtype"] = agreement
    for row in table.values():
        if "captured_forward_us" in row:
            row["forward_speedup"] = round(row["eager_forward_us"] / row["captured_forward_us"], 2)
    c.check("latency_measured", True, context=context, iters=iters)
    return table


def loop(c: Check, device: str, sizes: dict, dtype, prompts, new_tokens: int, repeats: int) -> dict:
    result = {}
    for condition in ("random", "agreeing"):
        agreeing = condition == "agreeing"
        target_graph = build_graph("target", sizes, device, dtype, seed=0, agreeing=agreeing, tied=agreeing)
        draft_graph = build_graph("draft", sizes, device, dtype, seed=1, agreeing=agreeing, tied=agreeing)
        rows = {}
        for mode in ("captured", "eager"):
            target = engine(target_graph, "target", dtype, device, mode == "captured")
            drafter = ModelDrafter(engine(draft_graph, "draft", dtype, device, mode == "captured"))
            lens = DRAFT_LENS if mode == "captured" else [4]  # eager: plain and one k, for the graphs' effect
            for k in [0] + lens:  # warm-up: every shape captured before timing
                generate(target, drafter, prompts[0], min(16, new_tokens), k)
            runs = {k: [] for k in [0] + lens}
            for _ in range(repeats):
                for prompt in prompts:
                    plain = generate(target, drafter, prompt, new_tokens, 0)
                    runs[0].append(plain)
                    for k in lens:  # alternating with plain decoding
                        runs[k].append(generate(target, drafter, prompt, new_tokens, k))
            plain_tps = _tps(runs[0])
            plain_step = sum(r[2].verify_seconds for r in runs[0]) / sum(r[2].target_passes for r in runs[0])
            rows[f"{mode} plain"] = {"tokens_per_second": round(plain_tps, 1), "step_ms": round(1e3 * plain_step, 3)}
            for k in lens:
                rs = runs[k]
                tps = _tps(rs)
                rounds = [rd for r in rs for rd in r[3]]
                a = acceptance_estimate(rounds)
                g = statistics.mean([p for p, _ in rounds] or [0])
                draft_passes = sum(r[2].draft_passes for r in rs)
                cost = (sum(r[2].draft_seconds for r in rs) / draft_passes) / plain_step if draft_passes else 0.0
                rows[f"{mode} k={k}"] = {
                    "tokens_per_second": round(tps, 1),
                    "speedup": round(tps / plain_tps, 3),
                    "predicted_speedup": round(predicted_speedup(a, g, cost), 3),
                    "acceptance": round(a, 4),
                    "tokens_per_pass": round(sum(len(r[0]) for r in rs) / sum(r[2].target_passes for r in rs), 3),
                    "predicted_tokens_per_pass": round(tokens_per_pass(a, g), 3),
                    "cost_ratio": round(cost, 4),
                    "identical": all(r[0] == p[0] for r, p in zip(rs, runs[0])),
                }
            del target, drafter
        result[condition] = rows
        del target_graph, draft_graph
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    c.check("loop_measured", True, new_tokens=new_tokens, repeats=repeats, prompts=len(prompts))
    return result


def _tps(runs) -> float:
    return sum(len(r[0]) for r in runs) / sum(r[1] for r in runs)


# -- output -------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    lines = ["| pass | eager forward us | captured forward us | speedup | eager device us | captured device us |",
             "|---|---|---|---|---|---|"]
    for name, row in report["latency"].items():
        lines.append(f"| {name} | {row.get('eager_forward_us', '')} | {row.get('captured_forward_us', '')} | "
                     f"{row.get('forward_speedup', '')} | {row.get('eager_device_us', '-')} | {row.get('captured_device_us', '-')} |")
    lines += ["", "| draft | run | tok/s | speedup | predicted | acceptance | tok/pass | c | identical |",
              "|---|---|---|---|---|---|---|---|---|"]
    for condition, rows in report["loop"].items():
        for name, row in rows.items():
            lines.append(f"| {condition} | {name} | {row['tokens_per_second']} | {row.get('speedup', 1.0)} | "
                         f"{row.get('predicted_speedup', '')} | {row.get('acceptance', '')} | "
                         f"{row.get('tokens_per_pass', 1.0)} | {row.get('cost_ratio', '')} | {row.get('identical', '')} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [n for n in report["latency"] if n.startswith("target")]
    x = np.arange(len(names))
    for offset, mode in ((-0.2, "eager"), (0.2, "captured")):
        left.bar(x + offset, [report["latency"][n][f"{mode}_forward_us"] / 1000 for n in names], 0.4, label=mode)
    left.set(xticks=x, xticklabels=[n.split()[-1] for n in names], ylabel="ms per forward",
             title="Target pass (T=1: step, T=k+1: verify)")
    left.legend()
    for condition, marker, color in (("random", "o", "tab:red"), ("agreeing", "s", "tab:green")):
        rows = report["loop"][condition]
        ks = [k for k in DRAFT_LENS if f"captured k={k}" in rows]
        right.plot(ks, [rows[f"captured k={k}"]["speedup"] for k in ks], marker + "-", color=color,
                   label=f"{condition} draft: measured")
        right.plot(ks, [rows[f"captured k={k}"]["predicted_speedup"] for k in ks], marker + ":", color=color,
                   alpha=0.6, label=f"{condition} draft: predicted (a, c measured)")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set(xlabel="draft length k", ylabel="speedup over plain (captured)", title="Speculative loop")
    right.legend(fontsize=8)
    fig.suptitle(f"{report['env']['device_name']}: {report['env']['models']}, {report['env']['latency_dtype']}; "
                 f"captured = {report['env']['captured_means']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny models (runs on a CPU): checks the script itself")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("error: no CUDA device; run with --tiny to check the script on a CPU", file=sys.stderr)
        return 2
    device = "cuda" if cuda else "cpu"
    if not cuda:
        torch.set_num_threads(1)  # tiny models: more threads only contend
    sizes = TINY if args.tiny else SIZES
    rng = np.random.default_rng(7)
    vocab = sizes["target"]["vocab_size"]
    n_prompts, new_tokens, loop_tokens, iters, repeats = (2, 24, 16, 5, 1) if args.tiny else (4, 64, 128, 50, 2)
    prompts = [rng.integers(0, vocab, size=int(n)) for n in rng.integers(20, 200, size=n_prompts)]
    c = Check()
    c.report["env"] = {
        "torch": torch.__version__, "python": platform.python_version(), "device": device,
        "device_name": torch.cuda.get_device_name() if cuda else f"{platform.machine()} CPU",
        "models": ("tiny " if args.tiny else "")
        + "Llama target {hidden_size}x{num_hidden_layers}".format(**sizes["target"])
        + ", draft {hidden_size}x{num_hidden_layers}".format(**sizes["draft"]) + f", vocab {vocab}",
        "max_seq": MAX_SEQ, "draft_lens": DRAFT_LENS,
        "captured_means": "CUDA graph replay" if cuda else "no CUDA: the fixed-window formulation, run eager",
    }
    with torch.no_grad():
        t = time.perf_counter()
        lossless(c, device, sizes, prompts, new_tokens)
        c.section("replay_and_lossless_fp32", time.perf_counter() - t)
        dtype = torch.bfloat16 if cuda else torch.float32
        c.report["env"]["latency_dtype"] = str(dtype)
        t = time.perf_counter()
        c.report["latency"] = latency(c, device, sizes, dtype, iters)
        c.section("latency", time.perf_counter() - t)
        t = time.perf_counter()
        c.report["loop"] = loop(c, device, sizes, dtype, prompts[:2], loop_tokens, repeats)
        c.section("loop", time.perf_counter() - t)
    c.report["failed"] = c.failed
    c.report["seconds"] = round(time.perf_counter() - c.t0, 1)
    (args.out / "gpu_check.json").write_text(json.dumps(c.report, indent=2) + "\n")
    plot(c.report, args.out / "gpu_check.png")
    print(markdown(c.report))
    print(f"{'FAILED: ' + ', '.join(c.failed) if c.failed else 'all checks passed'} in {c.report['seconds']}s")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
