"""The report as a figure: throughput and measured vs predicted speedup per draft length.

matplotlib is imported inside `plot` only: it is optional, and `specdeploy bench` without
`--plot` never needs it.
"""
from __future__ import annotations

from pathlib import Path

from specdeploy.core.errors import InputError


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
