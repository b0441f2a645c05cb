"""The GPU proof of the torch backend (issues 6 and 17): one script, one device call, nothing
to download.

    python proofs/gpu_check.py OUT            # a CUDA machine: every section, ~5 min on an H200
    python proofs/gpu_check.py --quick OUT    # draft lengths 1,2,4,8 and 64 tokens: ~3 min
    python proofs/gpu_check.py --tiny OUT     # tiny models, runs on a CPU (rehearses the script, ~25 s)
    python proofs/gpu_check.py --max-layers 1 --quick --pairs 8b+1b OUT
                                                  # real widths and vocabularies cut to one layer: on a
                                                  # CPU, checks that the real shapes build and run

Models are random-weight Llamas built on the device from configs (latency does not depend on
the weights' values; acceptance does, so it is pinned at both ends and real acceptance comes
from CPU measurements, below). Built with transformers when it imports, else with a minimal
module of the same attribute names (`--builder`). Heads are never tied in the build (two tied
random models both copy their input token and would agree); a tied head costs the same.

| model | shape (layers, hidden, heads/kv heads, intermediate, vocab) | role |
|---|---|---|
| smollm2-135m | SmolLM2-135M: 30, 576, 9/3, 1536, 49152 | target (pair 135m+distilled1), draft (1.7b+135m) |
| smollm2-1.7b | SmolLM2-1.7B: 24, 2048, 32/32, 8192, 49152 | target |
| llama3-8b | Llama-3-8B: 32, 4096, 32/8, 14336, 128256 | target |
| llama3.2-1b | Llama-3.2-1B: 16, 2048, 32/8, 8192, 128256 | draft |
| smollm2-135m@128k | SmolLM2-135M's shape with Llama-3's vocabulary | draft |
| distilled-1layer | SmolLM2-135M's first layer, 4096-token head (the shape of `specdeploy distill --layers 1 --draft-vocab 4096`) | draft |

Pairs (target + draft): 8b+1b, 8b+135m, 1.7b+135m, 135m+distilled1.

Sections, in this order, each timed; the JSON is rewritten after each:

1. correctness (fp32, pair 135m+distilled1 at real size, CUDA graphs): replay == eager for both
   graphs (a prefill chunk, steps and verify passes across window buckets: within 1e-4 of the
   largest logit, the same argmax in every row; a capture that falls back to eager fails);
   greedy plain decoding captured == eager; speculative == plain, token for token, at k = 1..8
   with a random draft (rejections) and the target drafting for itself (full accepts, bonus
   tokens); the prompt cache (a follow-up prompt reusing the K/V of the previous prompt and
   answer decodes as a fresh one); a sampled run replays from its seed; KV buffers keep
   their device addresses through the generations; host syncs: at most one per pass and one
   per round, counted by the engines and by torch.cuda.set_sync_debug_mode.
2. latency (--dtype, bf16 by default), per model at a context of 320 (attention window 512):
   target step T=1 and verify T=2..9, captured and eager: device time (CUDA events around the
   pass) and wall time per forward (inputs up, logits down, the sync); the draft chain (k steps
   replayed back to back, no host sync): device time per step, its overhead over the graph's
   own replay time (goal: under 10 us per replayed step) and the host's issue time per step.
3. predictions (arithmetic on section 2): per pair and k, the analytic model with the measured
   costs, c = draft step / target step and v(k) = verify T=k+1 / step (device times):
   speedup = (1 - a^(k+1)) / (1 - a) / (k*c + v(k)); the acceptance needed to break even and
   for 1.5x; and the speedup at the acceptance rates measured on the CPU with real SmolLM2
   drafts (MEASURED_ACCEPTANCE, or --acceptance NAME=A).
4. loops (--dtype), per pair: tokens/s end to end (prefill included) and decoding only, plain
   and speculative at k = 1..8 with a random draft (a ~ 0) and the target as its own draft
   (a ~ 1): measured speedup beside the prediction from section 2's device costs and the
   measured acceptance (goal: measured >= 0.9 of predicted); where the time went per round
   (draft chain, verify and its sync, the loop on the host, against the model's device
   times); host syncs per round (must be 1) and KV addresses (unchanged) checked on every run;
   then the prediction at the CPU-measured acceptance calibrated with the measured round times.
5. restricted head as exported (fp32, last): a distilled draft's graph as export/build.py
   makes it (SpecGraph keeps the head's token index on the CPU; `.to(device)` leaves it
   there), replay == eager. Likely to fail on a GPU (not yet seen: no GPU here): the forward
   copies the index up from pageable memory, which CUDA graph capture refuses, and the engine
   falls back to eager. The sections above move the index to the device first.

Time on one H200 (estimated, not yet measured): start and imports ~20 s, builds ~20 s,
correctness ~40 s, latency ~40 s, loops ~150 s (8b+1b ~45 s, 8b+135m ~40 s, 1.7b+135m ~45 s,
135m+distilled1 ~20 s): about 5 minutes. Loops are skipped, with their estimate recorded, when
they would end past --budget-s (default 480 s from the start).

Options for a shorter run: --sections correctness,latency,loops (any subset), --pairs NAME,..,
--lens 1,2,4,8, --loop-tokens N, --iters N, --budget-s S; --dtype fp16; --acceptance NAME=A.

Writes OUT/gpu_check.json (every figure and the raw timings), OUT/summary.md (the markdown
printed at the end) and OUT/gpu_check.png (matplotlib permitting); exits 1 if a check fails
(goals are reported, not judged), 2 without CUDA unless --tiny or --max-layers.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _import_specdeploy():
    """Use the installed package; else (a machine where the project is not installed, such as
    the GPU device) map the checkout's folders onto `specdeploy.*` without running the
    top-level packages' __init__ files: `specdeploy.runtime`'s imports the session and its
    tokenizer (tokenizers, jinja2), which this script does not use and the device may lack.
    SPECDEPLOY_SHIM=1 forces the mapping (to rehearse it)."""
    if os.environ.get("SPECDEPLOY_SHIM") != "1":
        try:
            import specdeploy.runtime.backends.torch_engine  # noqa: F401
            import specdeploy.runtime.decoding.loop  # noqa: F401
        except ImportError:
            pass
        else:
            return
    import types

    for name in [n for n in sys.modules if n == "specdeploy" or n.startswith("specdeploy.")]:
        del sys.modules[name]
    root = types.ModuleType("specdeploy")
    root.__path__ = []
    sys.modules["specdeploy"] = root
    for sub in ("core", "export", "runtime"):
        module = types.ModuleType(f"specdeploy.{sub}")
        module.__path__ = [str(ROOT / sub)]
        sys.modules[f"specdeploy.{sub}"] = module
        setattr(root, sub, module)


_import_specdeploy()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from specdeploy.export.graph import SpecGraph  # noqa: E402
from specdeploy.runtime.backends.torch_engine import TorchEngine  # noqa: E402
from specdeploy.core.analytic import acceptance_estimate, predicted_speedup, tokens_per_pass  # noqa: E402
from specdeploy.core.manifest import ModelSpec  # noqa: E402
from specdeploy.runtime.decoding.drafters import ModelDrafter  # noqa: E402
from specdeploy.runtime.decoding.loop import DecodeSettings, decode  # noqa: E402
from specdeploy.runtime.decoding.policy import DraftLength  # noqa: E402
from specdeploy.runtime.decoding.stats import Stats  # noqa: E402
from specdeploy.runtime.decoding.sampling import SamplingParams  # noqa: E402

# -- models and pairs -----------------------------------------------------------------------------
_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0, tied=True)
CONFIGS = {
    "smollm2-135m": _135M,
    "smollm2-1.7b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                         num_attention_heads=32, num_key_value_heads=32, head_dim=64, rope_theta=130000.0, tied=True),
    # Llama-3's rope scaling is left out: it changes RoPE's angles, not the cost.
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0, tied=False),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0, tied=True),
    "smollm2-135m@128k": {**_135M, "vocab_size": 128256},
    "distilled-1layer": {**_135M, "num_hidden_layers": 1, "head_vocab": 4096},
}
# (name, target, draft), in the order they run: most wanted first (the loops can be cut by the budget).
PAIRS = [
    ("8b+1b", "llama3-8b", "llama3.2-1b"),
    ("8b+135m", "llama3-8b", "smollm2-135m@128k"),
    ("1.7b+135m", "smollm2-1.7b", "smollm2-135m"),
    ("135m+distilled1", "smollm2-135m", "distilled-1layer"),
]
CORRECTNESS_PAIR = ("smollm2-135m", "distilled-1layer")

_TINY_T = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rope_theta=10000.0, tied=True)
TINY_CONFIGS = {
    "tiny-target": _TINY_T,
    "tiny-target-b": {**_TINY_T, "vocab_size": 384, "num_hidden_layers": 2, "num_key_value_heads": 4},
    "tiny-draft": dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, rope_theta=10000.0, tied=True),
    "tiny-draft-b": dict(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=16, rope_theta=10000.0, tied=True),
    "tiny-distilled": {**_TINY_T, "num_hidden_layers": 1, "head_vocab": 128},
}
TINY_PAIRS = [  # two pairs share a target, as the 8B pairs do
    ("tiny+draft", "tiny-target", "tiny-draft"),
    ("tiny+distilled", "tiny-target", "tiny-distilled"),
    ("tiny-b+draft-b", "tiny-target-b", "tiny-draft-b"),
]
TINY_CORRECTNESS_PAIR = ("tiny-target", "tiny-distilled")

# Per-token acceptance (the geometric model's estimate, core.analytic.acceptance_estimate)
# measured on this project's 2-core CPU, real SmolLM2-135M-Instruct target (int4), greedy,
# real drafts; the figures are the files' `configs[].acceptance` at pinned k.
MEASURED_ACCEPTANCE = {
    "distilled-1L": (0.19, "results/distilled_vs_ngram/distilled_1layer.json: 0.185 (k=1), 0.190 (k=2), "
                           "0.193 (k=3); distilled draft, 1 layer, 4096-token head, int8; 20 varied prompts"),
    "distilled-2L": (0.21, "results/distilled_vs_ngram/distilled_2layer.json: 0.214 (k=1), 0.212 (k=2), "
                           "0.217 (k=3); 2 layers, 8192-token head, int8; 20 varied prompts, 3 repeats"),
    "ngram-varied": (0.70, "results/distilled_vs_ngram/ngram_varied.json: 0.68 (k=4), 0.70 (k=8); prompt lookup 4..2, of the "
                           "lookups that found a match; 20 varied prompts"),
    "ngram-grounded": (0.80, "results/distilled_vs_ngram/ngram_grounded.json: 0.79 (k=4), 0.80 (k=8); prompt lookup 4..2, "
                             "12 input-grounded prompts"),
}
# n-gram drafts cost no device time: their prediction takes c = 0.
NO_DRAFT_COST_PREFIX = "ngram"

MAX_SEQ = 1024
MAX_DRAFT = 8
PREFILL_CHUNK = 64
CONTEXT = 320  # latency context: window 512, as every pass of the loops' prompts (256..370 + 128 + 9)
LOOP_PROMPT_LEN = (256, 371)
OVERHEAD_GOAL_US = 10.0
RATIO_GOAL = 0.9


@dataclass
class Plan:
    configs: dict
    pairs: list
    correctness_pair: tuple
    lens: list = field(default_factory=lambda: list(range(1, MAX_DRAFT + 1)))
    check_prompts: int = 3
    check_tokens: int = 48
    loop_prompts: int = 2
    loop_tokens: int = 128
    warm_tokens: int = 16
    repeats: int = 1
    latency_iters: int = 30
    chain_iters: int = 20
    max_layers: int | None = None


def make_plan(args) -> Plan:
    if args.tiny:
        plan = Plan(TINY_CONFIGS, TINY_PAIRS, TINY_CORRECTNESS_PAIR, check_prompts=2, check_tokens=24, loop_tokens=16,
                    warm_tokens=4, latency_iters=5, chain_iters=3)
    else:
        plan = Plan(CONFIGS, PAIRS, CORRECTNESS_PAIR)
    if args.quick:
        plan = replace(plan, lens=[1, 2, 4, 8], check_prompts=2, check_tokens=min(plan.check_tokens, 32),
                       loop_tokens=min(plan.loop_tokens, 64), latency_iters=min(plan.latency_iters, 15),
                       chain_iters=min(plan.chain_iters, 10))
    if args.lens:
        plan.lens = sorted({int(k) for k in args.lens.split(",")})
        if not all(1 <= k <= MAX_DRAFT for k in plan.lens):
            raise SystemExit(f"--lens: each in 1..{MAX_DRAFT}")
    if args.loop_tokens:
        plan.loop_tokens = args.loop_tokens
    if args.iters:
        plan.latency_iters = plan.chain_iters = args.iters
    if args.pairs:
        wanted = args.pairs.split(",")
        unknown = [p for p in wanted if p not in {name for name, _, _ in plan.pairs}]
        if unknown:
            raise SystemExit(f"--pairs: unknown {unknown}; known: {[name for name, _, _ in plan.pairs]}")
        plan.pairs = [p for p in plan.pairs if p[0] in wanted]
    plan.max_layers = args.max_layers
    return plan


class Check:
    """Collects results; a failed check is recorded and the script goes on."""

    def __init__(self):
        self.report: dict = {"checks": {}, "sections": {}, "goals": {}, "notes": []}
        self.failed: list[str] = []
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {text}", flush=True)

    def check(self, name: str, ok: bool, **detail) -> None:
        self.report["checks"][name] = {"ok": bool(ok), **detail}
        if not ok:
            self.failed.append(name)
        self.log(f"{'ok  ' if ok else 'FAIL'} {name} {json.dumps(detail, default=str)[:600]}")

    def goal(self, name: str, met: bool | None, **detail) -> None:
        self.report["goals"][name] = {"met": met, **detail}

    def note(self, text: str) -> None:
        self.report["notes"].append(text)
        self.log(f"note: {text}")

    def section(self, name: str, seconds: float) -> None:
        self.report["sections"][name] = round(seconds, 2)
        self.log(f"section {name}: {seconds:.1f}s")


# -- building models --------------------------------------------------------------------------------
class _Norm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)


class _Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = _Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.mlp = _MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)


class _Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = 1.0


class _Base(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = _Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = _Rotary(cfg.head_dim, cfg.rope_theta)


class MiniLlama(nn.Module):
    """The attributes SpecGraph borrows from a transformers Llama, for a device without
    transformers: config, model.{embed_tokens, layers, norm, rotary_emb}, lm_head."""

    def __init__(self, **cfg):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, layer_types=None,
                                      rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]}, **cfg)
        self.model = _Base(self.config)
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.normal_(0.0, 0.02)


def builder_name(choice: str) -> tuple[str, str]:
    """(builder, why): `auto` takes transformers if a tiny Llama builds with it and wraps as a
    SpecGraph (on the CPU, in a moment), else the minimal module."""
    if choice != "auto":
        return choice, "chosen"
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=10000.0,
                             tie_word_embeddings=False)
        SpecGraph(AutoModelForCausalLM.from_config(config))
    except Exception as e:  # noqa: BLE001 - any failure means: do not rely on it on the device
        return "minimal", f"transformers unusable: {type(e).__name__}: {str(e)[:200]}"
    return "transformers", "auto"


def build_graph(name: str, plan: Plan, device: str, dtype: torch.dtype, seed: int, builder: str,
                head_vocab_on_device: bool = True) -> SpecGraph:
    """A random-weight Llama of the named shape, built on the device in `dtype`, wrapped as the
    export stage's SpecGraph (RoPE's inverse frequencies stay fp32, as the export keeps them).
    A `head_vocab` shape gets a head over that many tokens (a distilled draft's), and
    `head_vocab_on_device=False` leaves its token index on the CPU, as SpecGraph makes it."""
    cfg = dict(plan.configs[name])
    head_vocab = cfg.pop("head_vocab", None)
    cfg.pop("tied", None)
    if plan.max_layers:
        cfg["num_hidden_layers"] = min(cfg["num_hidden_layers"], plan.max_layers)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in dtype: no fp32 copy of an 8B model
    try:
        with torch.device(device):
            if builder == "transformers":
                from transformers import AutoModelForCausalLM, LlamaConfig
                from transformers.utils import logging

                logging.set_verbosity_error()
                config = LlamaConfig(max_position_embeddings=MAX_SEQ * 4, initializer_range=0.02,
                                     tie_word_embeddings=False, **cfg)
                model = AutoModelForCausalLM.from_config(config)
            else:
                model = MiniLlama(**cfg)
    finally:
        torch.set_default_dtype(default)
    model.eval()
    kwargs = {}
    if head_vocab:
        vocab = np.sort(np.random.default_rng(seed).choice(cfg["vocab_size"], head_vocab, replace=False)).tolist()
        old = model.lm_head
        with torch.no_grad():
            head = nn.Linear(old.in_features, head_vocab, bias=False, device=old.weight.device, dtype=old.weight.dtype)
            head.weight.copy_(old.weight[torch.tensor(vocab, device=old.weight.device)])
        model.lm_head = head
        kwargs["head_vocab"] = vocab
    graph = SpecGraph(model, **kwargs)
    inv_freq = graph.inv_freq.float().clone()
    graph = graph.to(device=device, dtype=dtype).eval()
    graph.inv_freq = inv_freq
    if head_vocab and head_vocab_on_device:
        graph.head_vocab = graph.head_vocab.to(device)
    return graph


def parameters(graph) -> int:
    return sum(p.numel() for p in graph.parameters())


def vocab_of(graph) -> int:
    return int(getattr(graph, "vocab_size", None) or graph.lm_head.out_features)


def spec_of(graph: SpecGraph, role: str, dtype: torch.dtype) -> ModelSpec:
    return ModelSpec(role=role, graph="(in memory)", num_layers=graph.num_layers, num_kv_heads=graph.num_kv_heads,
                     head_dim=graph.head_dim, vocab_size=vocab_of(graph),
                     kv_dtype=str(dtype).removeprefix("torch."), sliding_window=None)


def engine(graph, role, dtype, device, captured: bool) -> TorchEngine:
    # On a CPU nothing is captured; the "captured" engine still runs the fixed-window
    # formulation the graphs are captured with.
    return TorchEngine(graph, spec_of(graph, role, dtype), MAX_SEQ, device=device, capture=captured, buckets=captured,
                       capture_max_t=MAX_DRAFT + 1)


def generate(target, drafter, prompt, new_tokens: int, k: int, params: SamplingParams | None = None, cache=None,
             marks: list | None = None):
    """Decoding through the runtime's own loop (greedy unless `params`); k = 0 is plain decoding.
    `marks` gets (seconds since the call, draft seconds, verify seconds, tokens) after each round."""
    stats = Stats()
    lengths = DraftLength(MAX_DRAFT, fixed=max(k, 1))
    if drafter is not None:
        drafter.min_confidence = 0.0
    rounds, tokens = [], []
    settings = DecodeSettings(new_tokens, (), PREFILL_CHUNK, params or SamplingParams(), lengths, cache=cache)
    t0 = time.perf_counter()
    for new in decode(target, drafter if k else None, prompt, settings, stats):
        tokens += new.tolist()
        rounds.append((stats.last_proposed, stats.last_accepted))
        if marks is not None:
            marks.append((time.perf_counter() - t0, stats.draft_seconds, stats.verify_seconds, len(tokens)))
    return tokens, time.perf_counter() - t0, stats, rounds


def prefill_passes(prompt) -> int:
    return -(-(len(prompt) - 1) // PREFILL_CHUNK)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# -- 1. correctness (fp32) --------------------------------------------------------------------------------
def replay_matches_eager(c: Check, graph, role, device, vocab, name: str | None = None, **extra) -> None:
    eager, captured = engine(graph, role, torch.float32, device, False), engine(graph, role, torch.float32, device, True)
    schedule = [(0, 48), (48, 1), (49, 9), (58, 2), (60, 5), (65, 1), (66, 9), (75, 1), (76, 52), (128, 9), (137, 1),
                (138, 130), (268, 9), (277, 1)]
    ids = np.random.default_rng(0).integers(0, vocab, size=schedule[-1][0] + schedule[-1][1])
    worst, flips, rows = 0.0, 0, 0
    for _ in range(2):  # the second round replays graphs captured in the first
        for start, t in schedule:
            want = eager.forward(ids[start : start + t], start).copy()
            got = captured.forward(ids[start : start + t], start)
            finite = np.isfinite(want)  # a restricted head's -inf columns
            same_inf = bool((np.isfinite(got) == finite).all())
            diff = float(np.abs(got[finite] - want[finite]).max()) if finite.any() else 0.0
            worst = max(worst, diff / max(1.0, float(np.abs(want[finite]).max())), 0.0 if same_inf else math.inf)
            flips += int((got.argmax(-1) != want.argmax(-1)).sum())
            rows += t
    s = captured.stats
    replayed = s.replays > 0 or not device.startswith("cuda")  # a silent fall-back to eager fails
    c.check(name or f"replay_matches_eager_{role}", worst <= 1e-4 and flips == 0 and s.capture_error is None and replayed,
            max_rel_diff=worst, argmax_flips=flips, rows=rows, graphs=len(s.graphs), replays=s.replays,
            eager_passes=s.eager, capture_error=s.capture_error, **extra)


def correctness(c: Check, plan: Plan, device: str, builder: str, prompts, new_tokens: int) -> None:
    tname, dname = plan.correctness_pair
    target_graph = build_graph(tname, plan, device, torch.float32, seed=0, builder=builder)
    draft_graph = build_graph(dname, plan, device, torch.float32, seed=1, builder=builder)
    c.report["correctness_models"] = {"target": tname, "draft": dname, "dtype": "float32",
                                      "parameters": {"target": parameters(target_graph), "draft": parameters(draft_graph)}}
    vocab = vocab_of(target_graph)
    replay_matches_eager(c, target_graph, "target", device, vocab)
    replay_matches_eager(c, draft_graph, "draft", device, vocab)
    target = engine(target_graph, "target", torch.float32, device, True)
    target_eager = engine(target_graph, "target", torch.float32, device, False)
    drafters = {
        "random": ModelDrafter(engine(draft_graph, "draft", torch.float32, device, True)),
        "self": ModelDrafter(engine(target_graph, "draft", torch.float32, device, True)),  # own KV buffers
    }
    kv0 = {"target": target.kv_addresses(), **{n: d.engine.kv_addresses() for n, d in drafters.items()}}
    mismatches, eager_mismatches, accepted, drafted, bonus, rejections, distinct = [], 0, {}, {}, 0, 0, set()
    for p, prompt in enumerate(prompts):
        plain, _, _, _ = generate(target, None, prompt, new_tokens, 0)
        plain_eager, _, _, _ = generate(target_eager, None, prompt, new_tokens, 0)
        eager_mismatches += plain != plain_eager
        distinct.update(plain)
        for name, drafter in drafters.items():
            for k in plan.lens:
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
            runs=len(prompts) * len(plan.lens) * len(drafters), mismatches=mismatches[:5],
            acceptance={n: round(accepted[n] / max(1, drafted[n]), 4) for n in drafters}, full_accept_rounds=bonus,
            rejections=rejections, distinct_tokens=len(distinct),
            draft_engines={n: {"replays": d.engine.stats.replays, "capture_error": d.engine.stats.capture_error}
                           for n, d in drafters.items()})
    prompt_cache_check(c, target, drafters, prompts[0], new_tokens, vocab)
    sampled_check(c, target, drafters["self"], prompts[0], new_tokens)
    now = {"target": target.kv_addresses(), **{n: d.engine.kv_addresses() for n, d in drafters.items()}}
    c.check("kv_buffers_keep_addresses", now == kv0, engines=list(kv0))
    sync_check(c, target, target_eager, vocab, device)
    round_sync_check(c, target, drafters["self"], prompts[0], new_tokens, device)
    batched_check(c, target_graph, device, prompts, new_tokens)
    del target, target_eager, drafters, target_graph, draft_graph
    free(device)


def restricted_head_as_exported(c: Check, plan: Plan, device: str, builder: str) -> None:
    """A draft with a restricted head (a distilled draft) as export/build.py makes it: SpecGraph
    keeps the head's token index as a plain CPU tensor, which `.to(device)` does not move, so
    on a GPU each pass copies it up inside the forward: a pageable copy, which CUDA graph
    capture refuses. The rest of this script moves the index to the device first; this check,
    run last (a failed capture must not disturb the figures), uses the graph as exported."""
    names = [n for n in dict.fromkeys([*plan.correctness_pair, *(d for _, _, d in plan.pairs)])
             if plan.configs[n].get("head_vocab")]
    if not names:
        return
    graph = build_graph(names[0], plan, device, torch.float32, seed=1, builder=builder, head_vocab_on_device=False)
    replay_matches_eager(c, graph, "draft", device, vocab_of(graph), name="restricted_head_captures_as_exported",
                         model=names[0], head_vocab_device=str(graph.head_vocab.device))
    del graph
    free(device)


def batched_check(c: Check, graph, device: str, prompts, new_tokens: int) -> None:
    """Batched passes (runtime/backends/torch_engine.py, `forward_batch`): up to 4 sequences decode greedily in one
    pass each step, joining one by one (batch buckets 1, 2, 4, padding lanes included), with
    verify-wide passes (T = 3) between; the captured engine's logits against the eager one's
    (replay == eager, as for single passes), and each sequence's tokens against the same prompt
    decoded alone. On a GPU the kernels chosen for B rows may sum in another order than for one,
    so agreement with decoding alone is reported (a near-tie may flip), not required."""
    spec = spec_of(graph, "target", torch.float32)
    engines = {mode: TorchEngine(graph, spec, MAX_SEQ, device=device, capture=mode == "captured", max_batch=4,
                                 buckets=mode == "captured", capture_max_t=MAX_DRAFT + 1) for mode in ("eager", "captured")}
    alone = engine(graph, "target", torch.float32, device, False)
    lanes = [np.asarray(p[: 40 + 9 * i], dtype=np.int64) for i, p in enumerate((list(prompts) * 4)[:4])]
    worst, flips, steps = 0.0, 0, 0
    tokens = {mode: [list(lane) for lane in lanes] for mode in engines}
    for mode, e in engines.items():
        seqs = tokens[mode]
        for i, lane in enumerate(lanes):  # lane i joins after i * 4 steps of the others
            for at in range(0, lane.shape[0] - 1, PREFILL_CHUNK):
                e.forward_batch(lane[None, at : min(at + PREFILL_CHUNK, lane.shape[0] - 1)], np.array([at]), first=i, last=True)
        for step in range(new_tokens):
            live = [i for i in range(len(lanes)) if step >= 4 * i]
            wide = step % 5 == 4  # a verify-wide pass: the last token and two repeats of it
            rows = np.array([[seqs[i][-1]] * (3 if wide else 1) for i in live], dtype=np.int64)
            starts = np.array([len(seqs[i]) - 1 for i in live], dtype=np.int64)
            out = e.forward_batch(rows, starts).copy()
            for j, i in enumerate(live):
                seqs[i].append(int(out[j, 0].argmax()))
            if mode == "captured":
                steps += 1
    # replay against eager: the same sequences, pass by pass, are compared through their tokens and a last pass
    for i in range(len(lanes)):
        flips += int(tokens["captured"][i] != tokens["eager"][i])
    probe = np.array([[tokens["eager"][i][-1]] for i in range(len(lanes))], dtype=np.int64)
    starts = np.array([len(tokens["eager"][i]) - 1 for i in range(len(lanes))], dtype=np.int64)
    want, got = engines["eager"].forward_batch(probe, starts).copy(), engines["captured"].forward_batch(probe, starts).copy()
    worst = float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))
    agree = 0
    for i, lane in enumerate(lanes):  # each lane decoded alone
        solo, _, _, _ = generate(alone, None, lane, len(tokens["eager"][i]) - lane.shape[0], 0)
        agree += solo == tokens["eager"][i][lane.shape[0]:]
    s = engines["captured"].stats
    replayed = s.replays > 0 or not device.startswith("cuda")
    c.check("batched_replay_equals_eager", worst <= 1e-4 and flips == 0 and s.capture_error is None and replayed,
            max_rel_diff=worst, sequences_differing=flips, steps=steps, graphs=[list(g) for g in s.graphs],
            replays=s.replays, capture_error=s.capture_error, sequences_equal_to_alone=f"{agree}/{len(lanes)}")
    del engines, alone
    free(device)


def prompt_cache_check(c: Check, target, drafters, prompt, new_tokens: int, vocab: int) -> None:
    """A follow-up prompt (the previous prompt, its answer and a new turn) decodes the same
    with the prompt cache (K/V of the shared prefix reused, only the new turn prefilled) as
    from scratch; plain and with each drafter."""
    from specdeploy.runtime.decoding.loop import PromptCache

    turn = np.random.default_rng(11).integers(0, vocab, size=9)
    results, ok = {}, True
    for name, drafter, k in (("plain", None, 0), *((n, d, 4) for n, d in drafters.items())):
        cache = PromptCache(MAX_SEQ)
        first, _, _, _ = generate(target, drafter, prompt, new_tokens, k, cache=cache)
        follow = np.concatenate([prompt, np.asarray(first, dtype=np.int64), turn])
        cached, _, stats, _ = generate(target, drafter, follow, new_tokens, k, cache=cache)
        fresh, _, _, _ = generate(target, drafter, follow, new_tokens, k)
        results[name] = {"cached_tokens": stats.cached_tokens, "identical": cached == fresh}
        ok &= cached == fresh and stats.cached_tokens >= len(prompt) + len(first) - 1
    c.check("prompt_cache_equals_fresh", ok, runs=results, follow_up_prompt=len(prompt) + new_tokens + len(turn))


def sampled_check(c: Check, target, drafter, prompt, new_tokens: int) -> None:
    """Sampled rounds (draws on the device from a seeded generator) run and replay from the seed."""
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    a, _, sa, _ = generate(target, drafter, prompt, new_tokens, 4, params=params)
    b, _, _, _ = generate(target, drafter, prompt, new_tokens, 4, params=params)
    c.check("sampled_replays_from_seed", a == b and len(a) == new_tokens, tokens=len(a), acceptance=round(sa.acceptance_rate, 4),
            capture_error=drafter.engine.stats.capture_error)


def round_sync_check(c: Check, target, drafter, prompt, new_tokens: int, device) -> None:
    """At most one host sync per greedy round: the draft chains its k steps on the device
    and the verify pass reads them there. Counted twice: the engines' own count, and on a
    GPU the synchronising calls PyTorch's sync debug mode reports during the rounds."""
    fused = drafter.fused_with(target)
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
    prefill = prefill_passes(prompt)
    counted = target.stats.host_syncs - t0 + drafter.engine.stats.host_syncs - d0
    reported = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    c.check("at_most_one_sync_per_round", fused and counted == prefill + len(rounds) and len(reported) <= prefill + len(rounds),
            fused=fused, rounds=len(rounds), prefill_passes=prefill, engine_syncs=counted,
            debug_mode_syncs=len(reported) if device.startswith("cuda") else "n/a (no CUDA)",
            debug_mode_first=reported[:3])


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
    per_pass, first = {}, {}
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
        first[name] = syncs[:3]
    c.check("at_most_one_sync_per_pass", all(v <= 1 for v in per_pass.values()), syncs_per_pass=per_pass,
            replays=captured.stats.replays, debug_mode_first=first)


# -- 2. latency ------------------------------------------------------------------------------------------------
def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 4)


def time_passes(e: TorchEngine, ids, t: int, iters: int, cuda: bool) -> dict:
    for _ in range(3):
        e.forward(ids[CONTEXT : CONTEXT + t], CONTEXT)  # warm-up (and capture)
    walls, devices = [], []
    e.time_device = cuda
    for _ in range(iters):
        d0 = e.stats.device_seconds
        w0 = time.perf_counter()
        e.forward(ids[CONTEXT : CONTEXT + t], CONTEXT)
        walls.append(time.perf_counter() - w0)
        devices.append(e.stats.device_seconds - d0)
    e.time_device = False
    row = {"wall_ms": _ms(statistics.median(walls)), "raw_wall_s": walls}
    if cuda:
        row["device_ms"] = _ms(statistics.median(devices))
        row["raw_device_s"] = devices
        row["host_overhead_us"] = round(1e6 * (statistics.median(walls) - statistics.median(devices)), 1)
    return row


def time_chain(e: TorchEngine, ids, k: int, iters: int, cuda: bool) -> dict:
    """k draft steps chained on the device (no host sync inside): host issue time and device time."""
    pending = ids[CONTEXT : CONTEXT + 1]
    for _ in range(2):
        e.draft_chain(pending, CONTEXT, k)
        sync("cuda" if cuda else "cpu")
    hosts, devices = [], []
    for _ in range(iters):
        w0 = time.perf_counter()
        e.draft_chain(pending, CONTEXT, k)
        hosts.append(time.perf_counter() - w0)
        sync("cuda" if cuda else "cpu")
        devices.append(e.chain_seconds())
    return {"k": k, "host_issue_us_per_step": round(1e6 * statistics.median(hosts) / k, 2),
            "chain_us_per_step": round(1e6 * statistics.median(devices) / k, 2), "raw_host_s": hosts, "raw_chain_s": devices}


def latency_model(c: Check, plan: Plan, name: str, graph, is_target: bool, device: str, dtype) -> dict:
    cuda = device.startswith("cuda")
    ids = np.random.default_rng(4).integers(0, vocab_of(graph), size=CONTEXT + MAX_DRAFT + 1)
    ts = list(range(1, MAX_DRAFT + 2)) if is_target else [1, 2]
    out = {"parameters": parameters(graph), "layers": graph.num_layers, "role": "target" if is_target else "draft",
           "passes": {}, "agreement": {}}
    logits = {}
    for mode in ("captured", "eager"):
        e = engine(graph, "target" if is_target else "draft", dtype, device, mode == "captured")
        e.forward(ids[:CONTEXT], 0)  # a context to attend over
        for t in ts:
            out["passes"].setdefault(f"T={t}", {})[mode] = time_passes(e, ids, t, plan.latency_iters, cuda)
            logits[mode, t] = e.forward(ids[CONTEXT : CONTEXT + t], CONTEXT).copy()
        if mode == "captured":
            chains = [time_chain(e, ids, k, plan.chain_iters, cuda) for k in sorted({1, max(plan.lens)})]
            out["chain"] = chains
            out["captured_engine"] = e.stats.as_dict()
        del e
        free(device)
    for t in ts:  # replay vs eager in this dtype: reported, not judged (fp32 in section 1 is the exact check)
        want, got = logits["eager", t], logits["captured", t]
        finite = np.isfinite(want)
        out["agreement"][f"T={t}"] = {
            "max_rel_diff": float(np.abs(got[finite] - want[finite]).max() / max(1.0, np.abs(want[finite]).max())),
            "argmax_flips": int((got.argmax(-1) != want.argmax(-1)).sum()),
        }
    step = _clock(out, 1)
    long_chain = out["chain"][-1]
    replay_us = 1e3 * step if cuda else None
    out["draft_step"] = {
        "replay_us": round(replay_us, 2) if replay_us is not None else None,
        "chain_us_per_step": long_chain["chain_us_per_step"],
        "overhead_us_per_step": round(long_chain["chain_us_per_step"] - replay_us, 2) if replay_us is not None else None,
        "host_issue_us_per_step": long_chain["host_issue_us_per_step"],
        "k": long_chain["k"],
    }
    if cuda:
        out["draft_step"]["glue_us_per_step"] = glue_us(vocab_of(graph), device)
    err = out["captured_engine"]["capture_error"]
    if cuda and (err or not out["captured_engine"]["replays"]):
        c.check(f"captured_{name}", False, capture_error=err, replays=out["captured_engine"]["replays"])
    return out


def glue_us(vocab: int, device: str, iters: int = 200) -> float:
    """Device time of what a draft chain runs between two replays (the argmax over the
    vocabulary, the token written into the next step's input, the write position advanced),
    alone: the part of the chain's overhead per step that is kernels, not gaps."""
    logits = torch.randn(1, 1, vocab, device=device)
    out = torch.zeros(MAX_DRAFT, dtype=torch.int64, device=device)
    io = torch.zeros(MAX_DRAFT + 2, dtype=torch.int64, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for timed in (False, True):
        if timed:
            start.record()
        for _ in range(iters):
            out[0:1].copy_(logits[0, -1].argmax(-1, keepdim=True))
            io[:1].add_(1)
            io[1:2].copy_(out[0:1])
        if timed:
            end.record()
    torch.cuda.synchronize()
    return round(1e3 * start.elapsed_time(end) / iters, 2)


def _clock(lat: dict, t: int, mode: str = "captured") -> float:
    """A pass's time in ms: device time on a GPU, wall time per forward on a CPU."""
    row = lat["passes"][f"T={t}"][mode]
    return row.get("device_ms") or row["wall_ms"]


def latency(c: Check, plan: Plan, graphs, device, dtype) -> dict:
    targets = {t for _, t, _ in plan.pairs}
    models = []
    for _, t, d in plan.pairs:
        models += [m for m in (t, d) if m not in models]
    table = {}
    for name in models:
        table[name] = latency_model(c, plan, name, graphs[name], name in targets, device, dtype)
        step = table[name]["draft_step"]
        c.log(f"latency {name}: T=1 {_clock(table[name], 1):.3f} ms, chain {step['chain_us_per_step']} us/step, "
              f"overhead {step['overhead_us_per_step']} us/step, host issue {step['host_issue_us_per_step']} us/step")
        if device.startswith("cuda") and step["overhead_us_per_step"] is not None:
            c.goal(f"draft_step_overhead_{name}", step["overhead_us_per_step"] < OVERHEAD_GOAL_US,
                   overhead_us_per_step=step["overhead_us_per_step"], goal_us=OVERHEAD_GOAL_US)
    c.check("latency_measured", True, context=CONTEXT, iters=plan.latency_iters, models=models)
    return table


# -- 3. predictions ---------------------------------------------------------------------------------------
def pair_costs(lat: dict, target: str, draft: str) -> dict:
    step = _clock(lat[target], 1)
    return {"step_ms": step, "draft_step_ms": _clock(lat[draft], 1), "c": _clock(lat[draft], 1) / step,
            "v": {k: _clock(lat[target], k + 1) / step for k in range(1, MAX_DRAFT + 1)}}


def model_speedup(a: float, k: int, c: float, v: float) -> float:
    """The analytic model with the verify pass's own cost: tokens per pass / (k*c + v(k));
    with v = 1 it is core.analytic.predicted_speedup (Leviathan et al.)."""
    return tokens_per_pass(a, k) / (k * c + v)


def acceptance_for(speedup: float, k: int, c: float, v: float) -> float | None:
    """The per-token acceptance at which the model gives `speedup` at draft length k (None: never)."""
    need = speedup * (k * c + v)
    if need <= 1.0:
        return 0.0
    if need > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_pass(mid, k) < need else (lo, mid)
    return round(hi, 4)


def predictions(plan: Plan, lat: dict, acceptance: dict) -> dict:
    out = {}
    for pair, target, draft in plan.pairs:
        costs = pair_costs(lat, target, draft)
        rows = {"costs": {"step_ms": round(costs["step_ms"], 4), "draft_step_ms": round(costs["draft_step_ms"], 4),
                          "c": round(costs["c"], 4), "v": {k: round(v, 4) for k, v in costs["v"].items()}},
                "break_even": {}, "at_measured_acceptance": {}}
        for k in plan.lens:
            v = costs["v"][k]
            rows["break_even"][k] = {"acceptance_for_1x": acceptance_for(1.0, k, costs["c"], v),
                                     "acceptance_for_1.5x": acceptance_for(1.5, k, costs["c"], v),
                                     "acceptance_for_2x": acceptance_for(2.0, k, costs["c"], v)}
        for name, (a, source) in acceptance.items():
            c = 0.0 if name.startswith(NO_DRAFT_COST_PREFIX) else costs["c"]
            by_k = {k: round(model_speedup(a, k, c, costs["v"][k]), 4) for k in plan.lens}
            best = max(by_k, key=by_k.get)
            rows["at_measured_acceptance"][name] = {"acceptance": a, "source": source, "c": round(c, 4),
                                                    "predicted": by_k, "best_k": best, "best": by_k[best]}
        out[pair] = rows
    return out


# -- 4. loops -----------------------------------------------------------------------------------------------
def one_run(target, drafter, prompt, new_tokens: int, k: int) -> dict:
    t0 = target.stats.host_syncs
    d0 = drafter.engine.stats.host_syncs if drafter is not None else 0
    marks: list = []
    tokens, seconds, stats, rounds = generate(target, drafter, prompt, new_tokens, k, marks=marks)
    syncs = target.stats.host_syncs - t0 + (drafter.engine.stats.host_syncs - d0 if drafter is not None else 0)
    # Steady state: the rounds after the first. The first carries the prefill and, with a model
    # draft, the draft's own pass over the whole prompt; it is reported as time to first token.
    first, last = marks[0], marks[-1]
    steady = len(marks) > 1
    return {"tokens": tokens, "seconds": seconds, "prefill_s": stats.prefill_seconds, "ttft_s": first[0],
            "draft_s": stats.draft_seconds, "verify_s": stats.verify_seconds, "rounds": rounds, "syncs": syncs,
            "expected_syncs": prefill_passes(prompt) + len(rounds), "target_passes": stats.target_passes,
            "steady": {"seconds": last[0] - first[0], "draft_s": last[1] - first[1], "verify_s": last[2] - first[2],
                       "tokens": last[3] - first[3], "rounds": len(marks) - 1} if steady else
                      {"seconds": seconds - stats.prefill_seconds, "draft_s": stats.draft_seconds,
                       "verify_s": stats.verify_seconds, "tokens": len(tokens), "rounds": len(marks)}}


def estimate_loop_seconds(plan: Plan, costs: dict, with_self: bool, cuda: bool) -> float:
    """From the latency profile: plain tokens, random-draft rounds (one token each) and
    self-draft rounds (k+1 tokens each), plus a host allowance per round."""
    host = 0.4e-3 if cuda else 1e-3
    step, draft = costs["step_ms"] / 1e3, costs["draft_step_ms"] / 1e3
    n = plan.loop_tokens
    total = n * (step + host)
    draft = max(draft, 40e-6)  # the host issues a chained step in some tens of microseconds
    for k in plan.lens:
        verify = costs["v"][k] * step
        total += n * (k * draft + verify + host)
        if with_self:
            total += n / (k + 1) * (k * step + verify + host)
    per_prompt = total * plan.loop_prompts * plan.repeats
    return per_prompt * (1 + plan.warm_tokens / n / plan.loop_prompts) + 2.0


def loop_pair(c: Check, plan: Plan, pair: tuple, graphs, lat: dict, device: str, dtype, prompts, with_self: bool) -> dict:
    name, tname, dname = pair
    cuda = device.startswith("cuda")
    target = engine(graphs[tname], "target", dtype, device, True)
    drafters = {"random": ModelDrafter(engine(graphs[dname], "draft", dtype, device, True))}
    if with_self:
        drafters["self"] = ModelDrafter(engine(graphs[tname], "draft", dtype, device, True))
    kv0 = {"target": target.kv_addresses(), **{n: d.engine.kv_addresses() for n, d in drafters.items()}}
    for k in [0] + plan.lens:  # warm-up: every shape captured before timing
        for d in drafters.values():
            generate(target, d, prompts[0], plan.warm_tokens, k)
    runs: dict = {("plain", 0): []}
    for _ in range(plan.repeats):
        for prompt in prompts:
            runs["plain", 0].append(one_run(target, None, prompt, plan.loop_tokens, 0))
            for dn, d in drafters.items():
                for k in plan.lens:
                    runs.setdefault((dn, k), []).append(one_run(target, d, prompt, plan.loop_tokens, k))
    kv_now = {"target": target.kv_addresses(), **{n: d.engine.kv_addresses() for n, d in drafters.items()}}
    bad_syncs = [(dn, k) for (dn, k), rs in runs.items() for r in rs if r["syncs"] != r["expected_syncs"]]
    c.check(f"loop_one_sync_per_round_{name}", not bad_syncs, runs=sum(len(rs) for rs in runs.values()),
            off=[f"{dn} k={k}" for dn, k in bad_syncs][:8])
    c.check(f"loop_kv_addresses_{name}", kv_now == kv0)
    engines = {"target": target.stats.as_dict(), **{n: d.engine.stats.as_dict() for n, d in drafters.items()}}
    for role, s in engines.items():
        if cuda and (s["capture_error"] or not s["replays"]):
            c.check(f"loop_captured_{name}_{role}", False, capture_error=s["capture_error"], replays=s["replays"])
    costs = pair_costs(lat, tname, dname)
    plain_runs = runs["plain", 0]
    rows = {"plain": summarise(plain_runs, None, 0, costs, None)}
    for (dn, k), rs in runs.items():
        if dn == "plain":
            continue
        rows[f"{dn} k={k}"] = summarise(rs, plain_runs, k, costs, 1.0 if dn == "self" else costs["c"])
    for key, row in rows.items():
        if "ratio" in row:
            c.goal(f"measured_vs_predicted_{name}_{key.replace(' ', '_')}", row["ratio"] >= RATIO_GOAL,
                   ratio=row["ratio"], goal=RATIO_GOAL)
    raw = {f"{dn} k={k}" if dn != "plain" else "plain": [
        {**{x: r[x] for x in ("seconds", "prefill_s", "draft_s", "verify_s", "syncs", "expected_syncs", "target_passes")},
         "new_tokens": len(r["tokens"]), "ttft_s": r["ttft_s"], "steady": r["steady"], "rounds": r["rounds"]}
        for r in rs] for (dn, k), rs in runs.items()}
    del target, drafters
    free(device)
    return {"target": tname, "draft": dname, "rows": rows, "engines": engines, "raw_runs": raw}


def summarise(rs, plain_runs, k: int, costs: dict, c_ratio: float | None) -> dict:
    """Tokens/s end to end (prefill and first round included) and in the steady state (the rounds
    after the first), the speedup over plain decoding in the steady state, the prediction,
    and per steady round where the time went."""
    tokens = sum(len(r["tokens"]) for r in rs)
    seconds = sum(r["seconds"] for r in rs)
    steady = {key: sum(r["steady"][key] for r in rs) for key in ("seconds", "draft_s", "verify_s", "tokens", "rounds")}
    rounds = sum(len(r["rounds"]) for r in rs)
    row = {"tokens_per_second": round(tokens / seconds, 2),
           "decode_tokens_per_second": round(steady["tokens"] / steady["seconds"], 2),
           "ttft_ms": round(1e3 * statistics.mean(r["ttft_s"] for r in rs), 3),
           "tokens": tokens, "rounds": rounds, "syncs_per_round": round(sum(r["syncs"] - (r["expected_syncs"] - len(r["rounds"]))
                                                                             for r in rs) / max(1, rounds), 3)}
    step = costs["step_ms"]
    if plain_runs is None:
        row["ms_per_token"] = round(1e3 * steady["seconds"] / steady["tokens"], 4)
        row["model_ms_per_token"] = round(step, 4)
        return row
    plain_tokens = sum(r["steady"]["tokens"] for r in plain_runs)
    plain_decode = sum(r["steady"]["seconds"] for r in plain_runs)
    plain_tps = plain_tokens / plain_decode
    a = acceptance_estimate([rd for r in rs for rd in r["rounds"]])
    v = costs["v"][k]
    predicted = model_speedup(a, k, c_ratio, v)
    speedup = row["decode_tokens_per_second"] / plain_tps
    draft_ms = 1e3 * steady["draft_s"] / steady["rounds"]
    verify_ms = 1e3 * steady["verify_s"] / steady["rounds"]
    wall_ms = 1e3 * steady["seconds"] / steady["rounds"]
    model_draft, model_verify = k * c_ratio * step, v * step
    plain_ms = 1e3 * plain_decode / plain_tokens
    split = {"round_ms": round(wall_ms, 4), "model_round_ms": round(model_draft + model_verify, 4),
             "draft_chain_ms": round(draft_ms, 4), "model_draft_ms": round(model_draft, 4),
             "verify_and_sync_ms": round(verify_ms, 4), "model_verify_ms": round(model_verify, 4),
             "loop_host_ms": round(wall_ms - draft_ms - verify_ms, 4),
             "plain_ms_per_token": round(plain_ms, 4), "model_step_ms": round(step, 4)}
    identical = sum(r["tokens"] == p["tokens"] for r, p in zip(rs, plain_runs))
    row.update({
        "speedup": round(speedup, 4), "predicted_speedup": round(predicted, 4),
        "predicted_speedup_v1": round(predicted_speedup(a, k, c_ratio), 4),
        "ratio": round(speedup / predicted, 4) if predicted else None,
        "acceptance": round(a, 4), "tokens_per_pass": round(row["tokens"] / sum(r["target_passes"] for r in rs), 4),
        "predicted_tokens_per_pass": round(tokens_per_pass(a, k), 4), "c": round(c_ratio, 4), "v": round(v, 4),
        "identical": f"{identical}/{len(rs)}", "time_split": split, "where": where_time_went(split),
    })
    return row


def where_time_went(s: dict) -> str:
    """The excess over the model's device times, per round, largest first, and plain decoding's own."""
    excess = {"draft chain": s["draft_chain_ms"] - s["model_draft_ms"],
              "verify+sync": s["verify_and_sync_ms"] - s["model_verify_ms"], "loop host": s["loop_host_ms"]}
    parts = ", ".join(f"{n} {v:+.2f}" for n, v in sorted(excess.items(), key=lambda kv: -abs(kv[1])))
    plain_extra = s["plain_ms_per_token"] - s["model_step_ms"]
    return (f"round {s['round_ms']:.2f} ms vs {s['model_round_ms']:.2f} modelled ({parts}); "
            f"plain {s['plain_ms_per_token']:.2f} ms/token vs {s['model_step_ms']:.2f} ({plain_extra:+.2f})")


def calibrated(plan: Plan, loops: dict, preds: dict, acceptance: dict) -> None:
    """The prediction at the CPU-measured acceptance with this pair's measured round times
    (random-draft rounds: k draft steps and a verify, whatever the acceptance) and measured
    plain tokens: what the loop as it stands would deliver with such a draft."""
    for pair, loop in loops.items():
        if "rows" not in loop:
            continue
        plain_ms = loop["rows"]["plain"]["ms_per_token"]
        for name, (a, _) in acceptance.items():
            if name.startswith(NO_DRAFT_COST_PREFIX):
                continue
            by_k = {}
            for k in plan.lens:
                row = loop["rows"].get(f"random k={k}")
                if row:
                    by_k[k] = round(tokens_per_pass(a, k) * plain_ms / row["time_split"]["round_ms"], 4)
            if by_k:
                best = max(by_k, key=by_k.get)
                preds[pair]["at_measured_acceptance"][name].update(
                    {"calibrated": by_k, "calibrated_best_k": best, "calibrated_best": by_k[best]})


# -- output ------------------------------------------------------------------------------------------------------
def _f(x, digits=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def markdown(report: dict) -> str:
    env = report["env"]
    lines = [f"## gpu_check: {env['device_name']}, torch {env['torch']}, {env['dtype']}, builder {env['builder']}"
             f"{', ' + env['plan'] if env.get('plan') else ''}", "",
             "| check | result | detail |", "|---|---|---|"]
    for name, chk in report["checks"].items():
        detail = {k: v for k, v in chk.items() if k != "ok" and not isinstance(v, (dict, list))}
        lines.append(f"| {name} | {'ok' if chk['ok'] else '**FAIL**'} | {json.dumps(detail, default=str)[:160]} |")
    lat = report.get("latency")
    if lat:
        clock = "device" if env["cuda"] else "wall (no CUDA)"
        lines += ["", f"Pass latency at context {CONTEXT}, ms ({clock}; captured = CUDA graph replay):", "",
                  "| model | params | step T=1 captured | eager | verify T=2 | T=5 | T=9 | v(9) | fwd host overhead us |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, m in lat.items():
            has9 = "T=9" in m["passes"]
            cap1 = m["passes"]["T=1"]["captured"]
            lines.append(f"| {name} | {m['parameters'] / 1e6:.0f}M | {_f(_clock(m, 1))} | {_f(_clock(m, 1, 'eager'))} | "
                         f"{_f(_clock(m, 2))} | {_f(_clock(m, 5)) if has9 else '-'} | {_f(_clock(m, 9)) if has9 else '-'} | "
                         f"{_f(_clock(m, 9) / _clock(m, 1), 2) if has9 else '-'} | {_f(cap1.get('host_overhead_us'), 1)} |")
        lines += ["", f"Draft step replayed in a chain (goal: overhead under {OVERHEAD_GOAL_US:.0f} us per step):", "",
                  "| model | replay us | chain us/step | overhead us/step | of which argmax+copies us | host issue us/step | chain k |",
                  "|---|---|---|---|---|---|---|"]
        for name, m in lat.items():
            s = m["draft_step"]
            lines.append(f"| {name} | {_f(s['replay_us'], 1)} | {_f(s['chain_us_per_step'], 1)} | "
                         f"{_f(s['overhead_us_per_step'], 1)} | {_f(s.get('glue_us_per_step'), 1)} | "
                         f"{_f(s['host_issue_us_per_step'], 1)} | {s['k']} |")
    preds = report.get("predictions")
    if preds:
        shown = [k for k in (1, 2, 4, 8) if k in report["env"]["draft_lens"]]
        at = "k=" + "/".join(map(str, shown))
        lines += ["", "Break-even: the per-token acceptance a draft needs (the analytic model with this pair's measured c "
                  "and v(k); 0: any, -: none):", "",
                  f"| pair | c | v(1) | v(8) | a for 1x at {at} | a for 1.5x at {at} | a for 2x at {at} |",
                  "|---|---|---|---|---|---|---|"]
        for pair, p in preds.items():
            ks = [k for k in shown if k in p["break_even"]]
            cell = lambda key: " / ".join(_f(p["break_even"][k][key], 2) for k in ks)  # noqa: E731
            v = p["costs"]["v"]
            lines.append(f"| {pair} | {_f(p['costs']['c'])} | {_f(v[1], 2)} | {_f(v[MAX_DRAFT], 2)} | {cell('acceptance_for_1x')} | "
                         f"{cell('acceptance_for_1.5x')} | {cell('acceptance_for_2x')} |")
        lines += ["", "At acceptance measured on the CPU with real SmolLM2 drafts (model: device costs; calibrated: this "
                  "pair's measured rounds):", "",
                  "| pair | draft acceptance | a | c | predicted (best k) | calibrated (best k) |", "|---|---|---|---|---|---|"]
        for pair, p in preds.items():
            for name, r in p["at_measured_acceptance"].items():
                cal = f"{_f(r['calibrated_best'], 2)}x (k={r['calibrated_best_k']})" if "calibrated" in r else "-"
                lines.append(f"| {pair} | {name} | {r['acceptance']} | {_f(r['c'])} | {_f(r['best'], 2)}x (k={r['best_k']}) | {cal} |")
    loops = report.get("loops")
    if loops:
        lines += ["", f"Loops ({env['dtype']}, captured): e2e = prefill included; decode = the rounds after the first (the "
                  "first, with the prefill and the draft's pass over the prompt, is the time to first token); speedup = "
                  f"decode tok/s over plain's; ratio = measured / predicted, goal >= {RATIO_GOAL}:", "",
                  "| pair | run | tok/s e2e | tok/s decode | TTFT ms | speedup | predicted | ratio | a | tok/pass | syncs/round "
                  "| identical | where the time went (ms) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for pair, loop in loops.items():
            if "rows" not in loop:
                lines.append(f"| {pair} | skipped: {loop.get('skipped', '')} ||||||||||||")
                continue
            for run, row in loop["rows"].items():
                where = row.get("where", "") if row.get("ratio") is not None and row["ratio"] < RATIO_GOAL else ""
                lines.append(f"| {pair} | {run} | {_f(row['tokens_per_second'], 1)} | {_f(row['decode_tokens_per_second'], 1)} | "
                             f"{_f(row['ttft_ms'], 1)} | {_f(row.get('speedup'), 2)} | {_f(row.get('predicted_speedup'), 2)} | {_f(row.get('ratio'), 2)} | "
                             f"{_f(row.get('acceptance'), 3)} | {_f(row.get('tokens_per_pass'), 2)} | {_f(row['syncs_per_round'], 2)} | "
                             f"{row.get('identical', '')} | {where} |")
    goals = report.get("goals", {})
    if goals:
        met = sum(1 for g in goals.values() if g["met"])
        lines += ["", f"Goals met: {met}/{len(goals)} "
                  f"(unmet: {', '.join(n for n, g in goals.items() if not g['met'])[:600] or 'none'})"]
    for note in report.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return
    loops = {p: l for p, l in report.get("loops", {}).items() if "rows" in l}
    if not loops:
        return
    fig, axes = plt.subplots(1, len(loops), figsize=(4.5 * len(loops), 4), squeeze=False)
    for ax, (pair, loop) in zip(axes[0], loops.items()):
        for kind, color in (("random", "tab:red"), ("self", "tab:green")):
            ks = [k for k in range(1, MAX_DRAFT + 1) if f"{kind} k={k}" in loop["rows"]]
            if not ks:
                continue
            ax.plot(ks, [loop["rows"][f"{kind} k={k}"]["speedup"] for k in ks], "o-", color=color, label=f"{kind}: measured")
            ax.plot(ks, [loop["rows"][f"{kind} k={k}"]["predicted_speedup"] for k in ks], "o:", color=color, alpha=0.6,
                    label=f"{kind}: predicted")
        for name, r in report["predictions"][pair]["at_measured_acceptance"].items():
            ks = sorted(r["predicted"], key=int)
            ax.plot([int(k) for k in ks], [r["predicted"][k] for k in ks], "--", linewidth=0.8, label=f"a={r['acceptance']} ({name})")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=pair, xlabel="draft length k", ylabel="speedup over plain")
        ax.legend(fontsize=6)
    fig.suptitle(f"{report['env']['device_name']}, {report['env']['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(c: Check, out: Path) -> None:
    c.report["failed"] = c.failed
    c.report["seconds"] = round(c.elapsed(), 1)
    (out / "gpu_check.json").write_text(json.dumps(c.report, indent=1, default=str) + "\n")


# -- main ------------------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny models (runs on a CPU): rehearses the script")
    ap.add_argument("--quick", action="store_true", help="draft lengths 1,2,4,8, 64 loop tokens, fewer iterations")
    ap.add_argument("--sections", default="correctness,latency,loops", help="comma separated subset (predictions follow latency)")
    ap.add_argument("--pairs", help="comma separated pair names (default: all)")
    ap.add_argument("--lens", help="draft lengths, comma separated (default 1..8)")
    ap.add_argument("--loop-tokens", type=int, help="new tokens per loop run (default 128; --tiny 16)")
    ap.add_argument("--iters", type=int, help="timed passes per latency figure (default 30, chains 20)")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="latency and loops (correctness is fp32)")
    ap.add_argument("--builder", choices=("auto", "transformers", "minimal"), default="auto")
    ap.add_argument("--max-layers", type=int, help="cut every model to this many layers (with real widths: a CPU shape check)")
    ap.add_argument("--acceptance", action="append", default=[], metavar="NAME=A",
                    help="add or replace a measured acceptance for the predictions (repeatable)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip loops that would end past this many seconds")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    if not cuda and not (args.tiny or args.max_layers):
        print("error: no CUDA device; run with --tiny (or --max-layers N) to rehearse on a CPU", file=sys.stderr)
        return 2
    sections = set(args.sections.split(","))
    unknown = sections - {"correctness", "latency", "loops"}
    if unknown:
        print(f"error: --sections: unknown {sorted(unknown)}", file=sys.stderr)
        return 2
    plan = make_plan(args)
    acceptance = dict(MEASURED_ACCEPTANCE)
    for item in args.acceptance:
        name, _, value = item.partition("=")
        acceptance[name] = (float(value), "--acceptance")
    device = "cuda" if cuda else "cpu"
    if not cuda:  # tiny models: more threads only contend (and this CPU is shared)
        torch.set_num_threads(1 if args.tiny else min(2, os.cpu_count() or 1))
    builder, builder_why = builder_name(args.builder)
    dtype = ({"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]) if cuda else torch.float32
    rng = np.random.default_rng(7)
    c = Check()
    c.report["env"] = {
        "torch": torch.__version__, "cuda_runtime": torch.version.cuda, "python": platform.python_version(),
        "device": device, "cuda": cuda,
        "device_name": torch.cuda.get_device_name() if cuda else f"{platform.machine()} CPU ({torch.get_num_threads()} threads)",
        "builder": builder, "builder_why": builder_why, "dtype": str(dtype).removeprefix("torch."), "max_seq": MAX_SEQ, "draft_lens": plan.lens,
        "plan": " ".join(x for x in ("tiny" if args.tiny else "", "quick" if args.quick else "",
                                     f"max-layers {args.max_layers}" if args.max_layers else "") if x),
        "captured_means": "CUDA graph replay" if cuda else "no CUDA: the fixed-window formulation, run eager",
        "clock": "device (CUDA events)" if cuda else "wall (no CUDA)",
    }
    if builder == "transformers":
        import transformers

        c.report["env"]["transformers"] = transformers.__version__
    c.report["plan"] = {"pairs": plan.pairs, "configs": {n: plan.configs[n] for n in {m for p in plan.pairs for m in p[1:]}},
                        "lens": plan.lens, "loop_tokens": plan.loop_tokens, "loop_prompts": plan.loop_prompts,
                        "repeats": plan.repeats, "latency_iters": plan.latency_iters, "check_tokens": plan.check_tokens,
                        "check_prompts": plan.check_prompts, "max_layers": plan.max_layers, "context": CONTEXT,
                        "acceptance": {n: {"a": a, "source": s} for n, (a, s) in acceptance.items()},
                        "budget_s": args.budget_s}
    if plan.max_layers:
        c.note(f"every model cut to at most {plan.max_layers} layers: shapes are real, times are not")
    with torch.no_grad():
        if "correctness" in sections:
            t = time.perf_counter()
            vocab = plan.configs[plan.correctness_pair[0]]["vocab_size"]
            prompts = [rng.integers(0, vocab, size=int(n)) for n in rng.integers(20, 200, size=plan.check_prompts)]
            correctness(c, plan, device, builder, prompts, plan.check_tokens)
            c.section("correctness_fp32", time.perf_counter() - t)
            write(c, args.out)
        graphs: dict = {}
        if sections & {"latency", "loops"}:
            t = time.perf_counter()
            for i, (_, tname, dname) in enumerate(plan.pairs):
                for seed, name in ((0, tname), (100 + i, dname)):
                    if name not in graphs:
                        graphs[name] = build_graph(name, plan, device, dtype, seed=seed, builder=builder)
            c.report["build"] = {n: {"parameters": parameters(g), "layers": g.num_layers} for n, g in graphs.items()}
            if cuda:
                c.report["build"]["gpu_memory_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            c.section("build", time.perf_counter() - t)
        if "latency" in sections or "loops" in sections:
            t = time.perf_counter()
            c.report["latency"] = latency(c, plan, graphs, device, dtype)
            c.report["predictions"] = predictions(plan, c.report["latency"], acceptance)
            c.section("latency", time.perf_counter() - t)
            write(c, args.out)
        if "loops" in sections:
            t = time.perf_counter()
            loops = c.report["loops"] = {}
            seen_targets = set()
            for pair in plan.pairs:
                name, tname, dname = pair
                vocab = plan.configs[tname]["vocab_size"]
                prompt_rng = np.random.default_rng(17)
                prompts = [prompt_rng.integers(0, vocab, size=int(n))
                           for n in prompt_rng.integers(*LOOP_PROMPT_LEN, size=plan.loop_prompts)]
                with_self = tname not in seen_targets
                estimate = estimate_loop_seconds(plan, pair_costs(c.report["latency"], tname, dname), with_self, cuda)
                if c.elapsed() + 1.3 * estimate > args.budget_s:  # estimates leave out some host time
                    loops[name] = {"skipped": f"estimated {estimate:.0f} s at {c.elapsed():.0f} s, budget {args.budget_s:.0f} s"}
                    c.note(f"loop {name} skipped: {loops[name]['skipped']}")
                    continue
                t_pair = time.perf_counter()
                loops[name] = loop_pair(c, plan, pair, graphs, c.report["latency"], device, dtype, prompts, with_self)
                loops[name]["seconds"] = round(time.perf_counter() - t_pair, 1)
                loops[name]["estimated_seconds"] = round(estimate, 1)
                if with_self:
                    seen_targets.add(tname)
                else:
                    loops[name]["self_draft"] = f"see the first pair with target {tname}"
                c.log(f"loop {name}: {loops[name]['seconds']} s (estimated {estimate:.0f} s)")
                write(c, args.out)
            calibrated(plan, loops, c.report["predictions"], acceptance)
            c.section("loops", time.perf_counter() - t)
        if "correctness" in sections:
            graphs.clear()
            free(device)
            t = time.perf_counter()
            restricted_head_as_exported(c, plan, device, builder)
            c.section("restricted_head_as_exported", time.perf_counter() - t)
        if cuda:
            c.report["env"]["max_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    write(c, args.out)
    text = markdown(c.report)
    (args.out / "summary.md").write_text(text + "\n")
    if "loops" in c.report:
        plot(c.report, args.out / "gpu_check.png")
    print(text)
    print(f"{'FAILED: ' + ', '.join(c.failed) if c.failed else 'all checks passed'} in {c.report['seconds']}s")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
