"""`specdeploy bench`: a latency profile of one bundle on one backend.

For each prompt and repeat, plain decoding and every draft length run in turn on the same
session (alternating, so drift hits them alike). Per draft length it reports time to first
token, inter-token latency (median, p90), tokens/s, the time split (prefill / draft /
verify / host), acceptance per draft position, the measured speedup over plain decoding
(the median of the per-cycle ratios) and beside it the analytic model's prediction from
the measured acceptance and cost ratio (DESIGN.md section 4).

Clocks: the loop's own wall clock (every engine pass ends in its one host sync, so a
pass's wall time includes its device time); engines that can time themselves on the
device (the torch backend on CUDA: CUDA events) add `device` seconds per role.

The pure arithmetic (`percentile`, `tokens_per_pass`, `predicted_speedup`,
`acceptance_estimate`, `inter_token_gaps`) is separate and tested by hand.
"""
from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .errors import InputError

DEFAULT_DRAFT_LENS: tuple = (1, 2, 4, 8, "auto")
DEFAULT_PROMPTS = (
    "Explain in three short sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List the planets of the solar system in order from the sun.",
    "Give me a short recipe for pancakes.",
)


# -- pure helpers -----------------------------------------------------------------------------
def read_prompts(path: Path) -> list[str]:
    """One prompt per non-blank line; the two characters backslash and n inside a line stand
    for a newline (prompts with code)."""
    return [line.replace("\\n", "\n") for line in path.read_text().splitlines() if line.strip()]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, linear between closest ranks (numpy's default method).

    >>> percentile([1, 2, 3, 4], 50), percentile([1, 2, 3, 4], 90)
    (2.5, 3.7)
    """
    if not values:
        return float("nan")
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    lo = int(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def tokens_per_pass(acceptance: float, draft_len: float) -> float:
    """Expected tokens per target pass with per-token acceptance a and draft length g:
    (1 - a^(g+1)) / (1 - a), and g + 1 when a = 1.

    >>> tokens_per_pass(0.5, 2)
    1.75
    """
    a, g = acceptance, draft_len
    if a >= 1.0:
        return g + 1.0
    return (1.0 - a ** (g + 1)) / (1.0 - a)


def predicted_speedup(acceptance: float, draft_len: float, cost_ratio: float) -> float:
    """Leviathan et al.'s speedup: tokens per pass / (g*c + 1), c = draft step / target pass.

    >>> round(predicted_speedup(0.5, 2, 0.1), 6)
    1.458333
    """
    return tokens_per_pass(acceptance, draft_len) / (draft_len * cost_ratio + 1.0)


def acceptance_estimate(rounds: Sequence[tuple[int, int]]) -> float:
    """Per-token acceptance a from (proposed, accepted) per round: accepted tokens over
    acceptance trials, where each round that stopped at a rejection adds one failed trial
    (the geometric model's maximum-likelihood estimate; a round that accepted all it
    proposed was cut by the draft length, not by a rejection).

    >>> acceptance_estimate([(4, 2), (4, 4), (2, 0)])
    0.75
    """
    accepted = sum(a for p, a in rounds if p)
    rejected = sum(1 for p, a in rounds if p and a < p)
    return accepted / (accepted + rejected) if accepted + rejected else 0.0


def inter_token_gaps(start: float, arrivals: Sequence[tuple[float, int]]) -> tuple[float, list[float]]:
    """(time to first token, per-token gaps) from the arrival time and token count of each
    streamed round. A round carries several tokens at once: its gap since the previous
    round is shared among them, one sample per token (the first round's tokens give the
    time to first token instead).

    >>> inter_token_gaps(0.0, [(0.5, 2), (0.75, 1), (1.5, 3)])
    (0.5, [0.25, 0.25, 0.25, 0.25])
    """
    arrivals = [(t, n) for t, n in arrivals if n]
    if not arrivals:
        return float("nan"), []
    gaps = []
    for (t_prev, _), (t, n) in zip(arrivals, arrivals[1:]):
        gaps += [(t - t_prev) / n] * n
    return arrivals[0][0] - start, gaps


def parse_draft_lens(text: str | Sequence, max_draft: int) -> list:
    """'1,2,4,8,auto' -> [1, 2, 4, 8, 'auto'], each k checked against the bundle's max draft."""
    items = text.replace(" ", "").split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        if item in ("auto", None):
            out.append("auto")
            continue
        try:
            k = int(item)
        except (TypeError, ValueError):
            raise InputError(f"--draft-len {item!r}: expected integers or 'auto', comma separated") from None
        if not 1 <= k <= max_draft:
            raise InputError(f"--draft-len {k}: outside [1, {max_draft}] (the bundle's max draft)")
        out.append(k)
    if not out:
        raise InputError("--draft-len: give at least one draft length")
    return out


# -- one timed generation --------------------------------------------------------------------
@dataclass
class Run:
    tokens: list[int]
    seconds: float
    ttft: float
    gaps: list[float]
    rounds: list[tuple[int, int]]  # (proposed, accepted) per round
    stats: object  # the loop's Stats
    device: dict[str, float] = field(default_factory=dict)  # role -> device seconds (CUDA events)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else 0.0


def timed_generation(session, prompt_ids: list[int], max_new_tokens: int, draft_len, speculate: bool) -> Run:
    """One generation through `Session.stream`, timing each round's piece as it arrives."""
    engines = _timed_engines(session)
    device0 = {role: e.stats.device_seconds for role, e in engines.items()}
    if speculate and draft_len not in ("auto", None) and session.drafter is not None:
        # A pinned k drafts k tokens every round; DraftLength.choose (loop.py) leaves the
        # confidence floor an earlier `auto` run set on the shared drafter, so clear it here.
        session.drafter.min_confidence = 0.0
    gen = session.stream(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, draft_len=draft_len, speculate=speculate)
    arrivals, rounds, tokens = [], [], []
    start = time.perf_counter()
    for piece in gen:
        now = time.perf_counter()
        if piece.token_ids:  # one piece per round (a final text flush carries none)
            arrivals.append((now, len(piece.token_ids)))
            rounds.append((gen.stats.last_proposed, gen.stats.last_accepted))
            tokens += piece.token_ids
    seconds = time.perf_counter() - start
    ttft, gaps = inter_token_gaps(start, arrivals)
    device = {role: e.stats.device_seconds - device0[role] for role, e in engines.items()}
    return Run(tokens, seconds, ttft, gaps, rounds, gen.stats, device)


def _timed_engines(session) -> dict:
    """Engines that time their passes on the device (CUDA events), turned on, by role."""
    engines = {"target": session.target}
    drafter_engine = getattr(session.drafter, "engine", None)
    if drafter_engine is not None:
        engines["draft"] = drafter_engine
    timed = {}
    for role, engine in engines.items():
        if getattr(engine, "time_device", None) is not None and getattr(engine, "device", None) is not None:
            if str(engine.device).startswith("cuda"):
                engine.time_device = True
                timed[role] = engine
    return timed


# -- the benchmark -------------------------------------------------------------------------------
def bench(
    bundle: str | Path,
    backend: str = "ort",
    draft_lens: str | Sequence = DEFAULT_DRAFT_LENS,
    prompts: Sequence[str] | None = None,
    max_new_tokens: int = 64,
    repeats: int = 3,
    chat: bool = True,
    threads: int | None = None,
    warmup: bool = True,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """Profile `bundle` on `backend`; returns the report (see `format_report`, `plot`)."""
    from .session import Session

    session = Session(bundle, threads=threads, backend=backend, prompt_cache=False)  # every run prefills its prompt
    lens = parse_draft_lens(draft_lens, session.bundle.max_draft) if session.drafter is not None else []
    prompts = list(prompts or DEFAULT_PROMPTS)
    if not prompts:
        raise InputError("no prompts to benchmark")
    use_chat = chat and bool(session.bundle.tokenizer.get("chat_template"))
    encoded = [session.encode(p, chat=use_chat) for p in prompts]
    for ids in encoded:
        session.check_request(np.asarray(ids), max_new_tokens, 0)
    if warmup:  # first passes pay for allocation and (on CUDA) graph capture
        for k in [None] + lens:
            timed_generation(session, encoded[0], min(8, max_new_tokens), k or 0, k is not None)
    plain_runs: list[Run] = []
    spec_runs: dict = {k: [] for k in lens}
    ratios: dict = {k: [] for k in lens}
    identical: dict = {k: 0 for k in lens}
    for r in range(repeats):
        for i, ids in enumerate(encoded):
            plain = timed_generation(session, ids, max_new_tokens, 0, speculate=False)
            plain_runs.append(plain)
            for k in lens:
                run = timed_generation(session, ids, max_new_tokens, k, speculate=True)
                spec_runs[k].append(run)
                ratios[k].append(run.tokens_per_second / plain.tokens_per_second if plain.tokens_per_second else 0.0)
                identical[k] += run.tokens == plain.tokens
            log(f"repeat {r + 1}/{repeats}, prompt {i + 1}/{len(encoded)}: plain {plain.tokens_per_second:.1f} tok/s"
                + "".join(f", k={k} {spec_runs[k][-1].tokens_per_second:.1f}" for k in lens))
    plain_summary = _summarise(plain_runs)
    plain_step = plain_summary["verify_seconds"] / max(1, plain_summary["target_passes"])
    configs = []
    for k in lens:
        row = _summarise(spec_runs[k])
        rounds = [rd for run in spec_runs[k] for rd in run.rounds]
        a = acceptance_estimate(rounds)
        # Mean tokens drafted per round, rounds that drafted none included (auto may choose
        # a plain step; an n-gram lookup may find nothing): the g the passes really carried.
        g = statistics.mean(p for p, _ in rounds) if rounds else 0.0
        draft_step = row["draft_seconds"] / row["draft_passes"] if row["draft_passes"] else 0.0
        c = draft_step / plain_step if plain_step else 0.0
        verify_pass = row["verify_seconds"] / max(1, row["target_passes"])
        v = verify_pass / plain_step if plain_step else 0.0
        row.update(
            draft_len=k,
            measured_speedup=statistics.median(ratios[k]),
            predicted_speedup=predicted_speedup(a, g, c),
            acceptance=a,
            mean_draft_len=g,
            predicted_tokens_per_pass=tokens_per_pass(a, g),
            cost_ratio=c,
            verify_cost_ratio=v,
            # The same model with the verify pass's measured cost v (a pass at T = g+1 costs
            # more than a plain step at T = 1): tokens per pass / (g*c + v).
            predicted_speedup_with_verify=tokens_per_pass(a, g) / (g * c + v) if v else 0.0,
            identical=f"{identical[k]}/{len(spec_runs[k])}",
        )
        configs.append(row)
    return {
        "bundle": str(bundle),
        "backend": backend,
        "device": _device_name(session),
        "clock": "wall-clock + cuda-events" if _timed_engines(session) else "wall-clock",
        "draft": session.bundle.manifest["draft"],
        "prompts": len(prompts),
        "chat": use_chat,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "plain": plain_summary,
        "configs": configs,
    }


def _summarise(runs: list[Run]) -> dict:
    """Totals and latency figures over a list of runs of one configuration."""
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    gaps = [g for r in runs for g in r.gaps]
    s = [r.stats for r in runs]
    prefill = sum(x.prefill_seconds for x in s)
    draft = sum(x.draft_seconds for x in s)
    verify = sum(x.verify_seconds for x in s)
    proposed_at, accepted_at = [], []
    for x in s:
        for i, (p, a) in enumerate(zip(x.proposed_at, x.accepted_at)):
            if i == len(proposed_at):
                proposed_at.append(0)
                accepted_at.append(0)
            proposed_at[i] += p
            accepted_at[i] += a
    out = {
        "runs": len(runs),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "ttft_ms_median": 1000 * statistics.median(r.ttft for r in runs),
        "itl_ms_median": 1000 * percentile(gaps, 50),
        "itl_ms_p90": 1000 * percentile(gaps, 90),
        "target_passes": sum(x.target_passes for x in s),
        "draft_passes": sum(x.draft_passes for x in s),
        "tokens_per_pass": tokens / max(1, sum(x.target_passes for x in s)),
        "prefill_seconds": prefill,
        "draft_seconds": draft,
        "verify_seconds": verify,
        "host_seconds": max(0.0, seconds - prefill - draft - verify),
        "acceptance_by_position": [round(a / p, 4) if p else None for a, p in zip(accepted_at, proposed_at)],
    }
    device: dict[str, float] = {}
    for r in runs:
        for role, sec in r.device.items():
            device[role] = device.get(role, 0.0) + sec
    if device:
        out["device_seconds"] = device
    return out


def _device_name(session) -> str:
    device = getattr(session.target, "device", None)
    if device is not None and str(device).startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name(device)} ({session.backend})"
    return f"{platform.processor() or platform.machine()} CPU ({session.backend})"


# -- presentation --------------------------------------------------------------------------------
def format_report(report: dict) -> str:
    p = report["plain"]
    lines = [
        f"bundle {report['bundle']} on {report['device']}; {report['prompts']} prompts x {report['repeats']} repeats, "
        f"{report['max_new_tokens']} new tokens; clock: {report['clock']}",
        f"{'draft':>6} {'tok/s':>8} {'speedup':>8} {'predicted':>9} {'pred(v)':>8} {'accept':>7} {'tok/pass':>8} {'c':>6} {'v':>5} "
        f"{'TTFT ms':>8} {'ITL ms':>7} {'p90':>7}  time split prefill/draft/verify/host  identical",
        f"{'plain':>6} {p['tokens_per_second']:8.1f} {1.0:8.2f} {'':>9} {'':>8} {'':>7} {p['tokens_per_pass']:8.2f} {'':>6} {'':>5} "
        f"{p['ttft_ms_median']:8.1f} {p['itl_ms_median']:7.2f} {p['itl_ms_p90']:7.2f}  {_split(p)}",
    ]
    for c in report["configs"]:
        lines.append(
            f"{str(c['draft_len']):>6} {c['tokens_per_second']:8.1f} {c['measured_speedup']:8.2f} "
            f"{c['predicted_speedup']:9.2f} {c['predicted_speedup_with_verify']:8.2f} {c['acceptance']:7.2f} "
            f"{c['tokens_per_pass']:8.2f} {c['cost_ratio']:6.3f} {c['verify_cost_ratio']:5.2f} "
            f"{c['ttft_ms_median']:8.1f} {c['itl_ms_median']:7.2f} {c['itl_ms_p90']:7.2f}  {_split(c)}  {c['identical']}"
        )
    for c in report["configs"]:
        by_pos = ", ".join("-" if x is None else f"{x:.2f}" for x in c["acceptance_by_position"])
        lines.append(f"acceptance by position, draft {c['draft_len']}: {by_pos}")
    return "\n".join(lines)


def _split(row: dict) -> str:
    total = row["seconds"] or 1.0
    parts = [row[f"{name}_seconds"] / total for name in ("prefill", "draft", "verify", "host")]
    return "/".join(f"{100 * x:.0f}%" for x in parts).ljust(20)


def plot(report: dict, path: str | Path) -> None:
    """Tokens/s and measured vs predicted speedup across draft lengths (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install matplotlib") from None
    configs = report["configs"]
    labels = [str(c["draft_len"]) for c in configs]
    x = list(range(len(configs)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(x, [c["tokens_per_second"] for c in configs], color="tab:blue", label="speculative")
    left.axhline(report["plain"]["tokens_per_second"], color="black", linestyle="--", label="plain decoding")
    top = max([c["tokens_per_second"] for c in configs] + [report["plain"]["tokens_per_second"]])
    left.set(xticks=x, xticklabels=labels, xlabel="draft length", ylabel="tokens/s", title="Throughput",
             ylim=(0, 1.25 * top))
    left.legend(loc="upper center", ncol=2, fontsize=8)
    right.plot(x, [c["measured_speedup"] for c in configs], "o-", label="measured")
    right.plot(x, [c["predicted_speedup"] for c in configs], "s--", label="predicted (a, c measured)")
    right.axhline(1.0, color="grey", linewidth=0.8)
    for i, c in enumerate(configs):
        right.annotate(f"a={c['acceptance']:.2f}", (i, c["measured_speedup"]), textcoords="offset points",
                       xytext=(0, 8), ha="center", fontsize=8)
    right.set(xticks=x, xticklabels=labels, xlabel="draft length", ylabel="speedup over plain", title="Speedup")
    right.legend(loc="best")
    fig.suptitle(f"{Path(report['bundle']).name} on {report['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
