"""The report: per-configuration summaries of timed runs, the analytic model's prediction
beside the measured speedup, and the report as text and JSON.

A configuration's prediction comes from what its runs measured: acceptance a (the
geometric model's estimate over every round), the mean draft length g the rounds really
carried, and the cost ratio c of a draft step over a plain decoding step (docs/design.md,
"The cost model"; the formulas are specdeploy.core.analytic's).
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from specdeploy.core.analytic import acceptance_estimate, predicted_speedup, tokens_per_pass
from specdeploy.runtime.backends.devices import device_name as gpu_name

from specdeploy.runtime.tools.bench.latency import percentile
from specdeploy.runtime.tools.bench.runs import Run


def summarise(runs: list[Run]) -> dict:
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
    sizes = [n for x in s for n in x.tree_sizes]
    if sizes:  # tree rounds: the nodes verified per round (0: a plain step) and the paths accepted
        out["tree_rounds"] = len(sizes)
        out["tree_nodes_mean"] = statistics.mean(sizes)
        out["tree_size_histogram"] = {str(k): sizes.count(k) for k in sorted(set(sizes))}
        out["accepted_path_mean"] = statistics.mean(n for x in s for n in x.path_lengths)
    device: dict[str, float] = {}
    for r in runs:
        for role, sec in r.device.items():
            device[role] = device.get(role, 0.0) + sec
    if device:
        out["device_seconds"] = device
    return out


def config_row(draft_len, runs: list[Run], plain: dict, ratios: list[float], identical: int) -> dict:
    """One draft length's row: `summarise(runs)` plus the measured speedup (the median of the
    per-cycle `ratios` over plain decoding), the model's inputs measured from the runs and
    its prediction. `plain`: the plain-decoding summary, whose verify time per target pass
    is the unit of cost; `identical`: how many runs equalled their plain run."""
    row = summarise(runs)
    plain_step = plain["verify_seconds"] / max(1, plain["target_passes"])
    rounds = [rd for run in runs for rd in run.rounds]
    a = acceptance_estimate(rounds)
    # Mean tokens drafted per round, rounds that drafted none included (auto may choose
    # a plain step; an n-gram lookup may find nothing): the g the passes really carried.
    g = statistics.mean(p for p, _ in rounds) if rounds else 0.0
    draft_step = row["draft_seconds"] / row["draft_passes"] if row["draft_passes"] else 0.0
    c = draft_step / plain_step if plain_step else 0.0
    verify_pass = row["verify_seconds"] / max(1, row["target_passes"])
    v = verify_pass / plain_step if plain_step else 0.0
    row.update(
        draft_len=draft_len,
        measured_speedup=statistics.median(ratios),
        predicted_speedup=predicted_speedup(a, g, c),
        acceptance=a,
        mean_draft_len=g,
        predicted_tokens_per_pass=tokens_per_pass(a, g),
        cost_ratio=c,
        verify_cost_ratio=v,
        # The same model with the verify pass's measured cost v (a pass at T = g+1 costs
        # more than a plain step at T = 1): tokens per pass / (g*c + v).
        predicted_speedup_with_verify=tokens_per_pass(a, g) / (g * c + v) if v else 0.0,
        identical=f"{identical}/{len(runs)}",
    )
    return row


def device_name(session) -> str:
    """The target engine's device for the report's header, with the backend (and where it was
    asked to run). A GPU is named by the NVIDIA driver: no torch import for an ort engine."""
    device = str(session.target.device)
    if device.startswith("cuda"):
        return f"{gpu_name(device)} ({session.choice})"
    return f"{platform.processor() or platform.machine()} CPU ({session.choice})"


def format_report(report: dict) -> str:
    """The report as a table: plain decoding, then one line per draft length."""
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
        if "tree_rounds" in c:
            lines.append(f"token trees, draft {c['draft_len']}: {c['tree_nodes_mean']:.1f} nodes a round on average "
                         f"(sizes {c['tree_size_histogram']}), accepted path {c['accepted_path_mean']:.2f} tokens")
        else:
            by_pos = ", ".join("-" if x is None else f"{x:.2f}" for x in c["acceptance_by_position"])
            lines.append(f"acceptance by position, draft {c['draft_len']}: {by_pos}")
    return "\n".join(lines)


def _split(row: dict) -> str:
    total = row["seconds"] or 1.0
    parts = [row[f"{name}_seconds"] / total for name in ("prefill", "draft", "verify", "host")]
    return "/".join(f"{100 * x:.0f}%" for x in parts).ljust(20)


# The checkout this module lies in when installed editable (runtime/tools/bench/report.py -> root).
_CHECKOUT = Path(__file__).resolve().parents[3]


def provenance(checkout: str | Path | None = None) -> dict:
    """Where a measurement came from, written into every report a benchmark saves: the command
    line, the UTC date, the commit of `checkout` (this package's own by default; "-dirty" when
    tracked files differ from it, "unknown" outside a git checkout) and the machine."""
    return {
        "command": shlex.join(sys.argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(Path(checkout) if checkout is not None else _CHECKOUT),
        "machine": _machine(),
    }


def _commit(checkout: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        # A folder inside some other repository (site-packages in a checkout's .venv) is no checkout of ours.
        if Path(git("rev-parse", "--show-toplevel")).resolve() != checkout.resolve():
            return "unknown"
        head = git("rev-parse", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _machine() -> dict:
    import numpy
    import onnxruntime

    return {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "onnxruntime": onnxruntime.__version__,
        "numpy": numpy.__version__,
    }


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux); the platform's processor string elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_json(report: dict, path: str | Path) -> None:
    """The report as JSON, with its provenance (command, date, commit, machine) beside it."""
    Path(path).write_text(json.dumps({**report, "provenance": provenance()}, indent=2) + "\n")
