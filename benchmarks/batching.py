"""Concurrent streams: the batched scheduler against the session pool, plain and speculative.

    python -m benchmarks.batching BUNDLE [--streams 1,2,4,8] [--modes pool,plain,spec]
        [--prompts FILE] [--requests N] [--max-new-tokens N] [--repeats R] [--workers W]
        [--json OUT] [--plot OUT.png]

C client threads each send their share of the prompts (chat template, greedy) one after
another, all starting together; every mode runs the same requests:

- pool: `SessionPool` with W workers (a batch of one each, sharing the cores), speculation off;
- poolspec: the same pool, speculation `auto` (what `serve` ran by default before it batched);
- plain: `BatchSession(batch=C)` with speculation off;
- spec: `BatchSession(batch=C)`, speculation under the batch's policy (`auto`);
- serve: what `specdeploy serve` runs told neither --batch nor --workers: the batch
  `default_batch` sizes for the bundle (8 slots whatever C), speculation `auto`.

Per request it records the time to its first token (TTFT, from the request's start, queueing
included), the gaps between its pieces divided by the tokens each brought (inter-token
latency, ITL), and its decode time (first token to last). Reported per mode and C:

- decode-only tok/s at C (batched modes): the tokens the scheduler's rounds with all C lanes
  running committed, over those rounds' time (their passes and the host work around them):
  C streams decoding together, prefill and the gaps while a finished request's successor
  joins left out (`BatchSession.timing_by_lanes`);
- decode tok/s, served: tokens after each request's first, summed, over the time some
  request of the run was decoding (the union of the requests' first-to-last intervals). It
  counts, inside those intervals, the prefill passes of requests joining, the rounds run
  with fewer lanes while a successor joins, and the tail where streams have run out of
  requests: what a client population of C sees, and the one figure the pool also has;
- total tok/s: every new token over the run's wall time (whole requests, prefill included);
- TTFT and ITL p50/p99.

Modes alternate within each repeat (pool, plain, spec, pool, ...), and figures are medians
over repeats. Every request's tokens are compared with the same request through a `Session`
alone: a mismatch fails the run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from specdeploy.core.manifest import load_bundle
from specdeploy.runtime import Session
from specdeploy.runtime.decoding.batch import BatchSession
from specdeploy.runtime.serving.pool import SessionPool, default_batch

try:
    from benchmarks.provenance import provenance
except ModuleNotFoundError:  # run as a file
    from provenance import provenance

HERE = Path(__file__).parent


def run_streams(server, prompts: list[str], streams: int, max_new_tokens: int, speculate: bool) -> dict:
    """Send `prompts` over `streams` client threads; -> per-request records and the wall time."""
    records: list[dict | None] = [None] * len(prompts)
    share = [list(range(i, len(prompts), streams)) for i in range(streams)]
    go = threading.Event()

    def client(indices):
        go.wait()
        for i in indices:
            t0 = time.perf_counter()
            gen = server.stream(prompts[i], chat=True, max_new_tokens=max_new_tokens, speculate=speculate)
            arrivals, ids = [], []
            for piece in gen:
                if piece.token_ids:
                    arrivals.append((time.perf_counter(), len(piece.token_ids)))
                    ids += piece.token_ids
            records[i] = {"start": t0, "arrivals": arrivals, "ids": ids}

    threads = [threading.Thread(target=client, args=(s,)) for s in share if s]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    go.set()
    for t in threads:
        t.join()
    return {"records": records, "wall": time.perf_counter() - t0}


def summarize(run: dict) -> dict:
    recs = run["records"]
    ttft, itl, spans, decoded, total = [], [], [], 0, 0
    for r in recs:
        arr = r["arrivals"]
        total += sum(n for _, n in arr)
        ttft.append(arr[0][0] - r["start"])
        for (t_prev, _), (t, n) in zip(arr, arr[1:]):
            itl += [(t - t_prev) / n] * n
        if len(arr) > 1:
            spans.append((arr[0][0], arr[-1][0]))
            decoded += sum(n for _, n in arr[1:])
    busy, end = 0.0, -1.0  # the union of the decode intervals
    for a, b in sorted(spans):
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {"decode_tok_s": decoded / busy if busy else float("nan"), "total_tok_s": total / run["wall"],
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "tokens": total, "wall_s": run["wall"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--modes", default="pool,plain,spec")
    ap.add_argument("--prompts", default=str(HERE / "prompts_varied.txt"))
    ap.add_argument("--requests", type=int, default=16, help="requests per run (the first N prompts, repeated as needed)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="the session pool's workers")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    texts = [p for p in Path(args.prompts).read_text().splitlines() if p.strip()]
    prompts = [texts[i % len(texts)] for i in range(args.requests)]
    streams = [int(s) for s in args.streams.split(",")]
    modes = args.modes.split(",")

    solo = Session(args.bundle, prompt_cache=False)
    reference = {p: solo.generate(p, chat=True, max_new_tokens=args.max_new_tokens, speculate=False).token_ids
                 for p in dict.fromkeys(prompts)}
    del solo
    pool = SessionPool(args.bundle, workers=args.workers, max_queue=64) if {"pool", "poolspec"} & set(modes) else None
    report = {"bundle": args.bundle, "requests": args.requests, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "workers": args.workers, "prompts": args.prompts, "runs": {},
              "provenance": provenance()}
    served = None
    if "serve" in modes:
        slots, why = default_batch(load_bundle(args.bundle, verify=False))
        if slots is None:
            raise SystemExit(f"{args.bundle}: serve runs one session here ({why}): measure it as --modes pool --workers 1")
        served = BatchSession(args.bundle, batch=slots, max_queue=64)
        report["serve_batch"] = slots
    for c in streams:
        batched = BatchSession(args.bundle, batch=c, max_queue=64) if {"plain", "spec"} & set(modes) else None
        if batched is not None:
            report["memory_per_sequence_bytes"] = batched.memory_per_sequence
        results: dict[str, list[dict]] = {m: [] for m in modes}
        for rep in range(args.repeats):
            for mode in modes:
                server = {"pool": pool, "poolspec": pool, "serve": served}.get(mode, batched)
                before = dict(server.timing) if server is not pool else None
                full_before = list(server.timing_by_lanes.get(c, [0, 0.0, 0])) if server is not pool else None
                run = run_streams(server, prompts, c, args.max_new_tokens, speculate=mode in ("spec", "serve", "poolspec"))
                for p, r in zip(prompts, run["records"]):
                    if r["ids"] != reference[p]:
                        raise SystemExit(f"{mode} at {c} streams: the output of {p!r:.40} differs from a Session alone")
                results[mode].append(summarize(run))
                s = results[mode][-1]
                if before is not None:  # the scheduler's own account: batched rounds alone
                    d = {k: server.timing[k] - before[k] for k in before}
                    s["round_tok_s"] = d["tokens"] / d["round_seconds"]
                    s["mean_lanes"] = d["lanes"] / d["rounds"]
                    s["prefill_share"] = d["prefill_seconds"] / run["wall"]
                    s["host_share"] = 1 - d["pass_seconds"] / d["round_seconds"]
                    full = [a - b for a, b in zip(server.timing_by_lanes.get(c, [0, 0.0, 0]), full_before)]
                    s["full_tok_s"] = full[2] / full[1] if full[1] else float("nan")  # rounds with all C lanes
                    s["full_share"] = full[0] / d["rounds"]
                print(f"streams {c} {mode:5s} rep {rep}: decode {s['decode_tok_s']:6.1f} tok/s, total "
                      f"{s['total_tok_s']:6.1f} tok/s, TTFT p50 {s['ttft_p50_ms']:6.0f} ms, ITL p50 {s['itl_p50_ms']:5.1f} "
                      f"p99 {s['itl_p99_ms']:6.1f} ms" + (f"; rounds of all {c} lanes {s['full_tok_s']:6.1f} tok/s "
                      f"({100 * s['full_share']:.0f}% of rounds); rounds alone {s['round_tok_s']:6.1f} tok/s, {s['mean_lanes']:.2f} "
                      f"lanes a round, outside the target pass {100 * s['host_share']:.0f}%, prefill {100 * s['prefill_share']:.0f}% of the run"
                      if "round_tok_s" in s else ""), flush=True)
        if batched is not None:
            report.setdefault("widths", {})[c] = {f"B={b} T={t}": n for (b, t), n in sorted(batched.widths.items())}
            print(f"passes by width at {c} streams (plain and spec runs together): {report['widths'][c]}")
            batched.close()
        report["runs"][c] = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
        report["runs"][c]["all"] = results
    if served is not None:
        served.close()
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)


def table(report: dict) -> str:
    lines = ["| streams | mode | decode-only tok/s, rounds of all C lanes | decode tok/s, served | total tok/s | "
             "TTFT p50 / p99 ms | ITL p50 / p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for c, modes in report["runs"].items():
        for mode, s in modes.items():
            if mode == "all":
                continue
            full = f"{s['full_tok_s']:.1f}" if "full_tok_s" in s else "-"
            lines.append(f"| {c} | {mode} | {full} | {s['decode_tok_s']:.1f} | {s['total_tok_s']:.1f} | "
                         f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f} | {s['itl_p50_ms']:.1f} / {s['itl_p99_ms']:.1f} |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = list(report["runs"])
    modes = [m for m in report["runs"][cs[0]] if m != "all"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode in modes:
        get = lambda k: [report["runs"][c][mode][k] for c in cs]  # noqa: E731
        axes[0].plot(cs, get("decode_tok_s"), marker="o", label=mode)
        axes[1].plot(cs, get("ttft_p50_ms"), marker="o", label=f"{mode} p50")
        axes[1].plot(cs, get("ttft_p99_ms"), marker="x", linestyle=":", label=f"{mode} p99")
        axes[2].plot(cs, get("itl_p50_ms"), marker="o", label=f"{mode} p50")
        axes[2].plot(cs, get("itl_p99_ms"), marker="x", linestyle=":", label=f"{mode} p99")
    for ax, title in zip(axes, ("total decode tokens/s", "time to first token (ms)", "inter-token latency (ms)")):
        ax.set_xlabel("concurrent streams")
        ax.set_xticks(cs)
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"{Path(report['bundle']).name}: {report['requests']} requests x {report['max_new_tokens']} tokens, greedy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
