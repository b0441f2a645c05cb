"""Long prompts against llama.cpp: documents of 1k-6k tokens, summary and edit tasks.

    python benchmarks/long_prompts.py BUNDLE [BUNDLE ...] [--gguf FILE] [--lengths 1024,3072,6144]
        [--max-new-tokens N] [--repeats R] [--threads N] [--json OUT]

The documents are files every Debian system carries: the GPL-3 licence text for the summaries
(cut at a line end to the length asked, counted in the bundle's tokens, then "Summarize the
text above"), and Python's own `json/encoder.py` for the edit ("rewrite the code with every
comment removed": most of the answer copies the input). Our chat template wraps each; llama.cpp
gets the very same token ids. Per prompt and repeat, taking turns: llama.cpp plain, then for
each bundle ours plain and ours with the bundle's draft (draft length auto); greedy; every
prompt processed whole on both sides (no prefix cache); every run decodes exactly
--max-new-tokens tokens (end-of-sequence ignored on both sides), so both read the same
contexts. Reported per prompt and bundle, median over repeats: time to the first token,
decode-only tok/s (the tokens after the first over the time after it) and whole-request tok/s,
side by side, never one divided by the other; and whether each output equals the others.
Each bundle needs a --max-seq the longest prompt plus --max-new-tokens fits in.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
from pathlib import Path

from specdeploy.runtime import Session

try:
    from benchmarks.llamacpp import decode_rate, llama_generate, load_llama_cpp
    from benchmarks.provenance import provenance
except ModuleNotFoundError:  # run as a file
    from llamacpp import decode_rate, llama_generate, load_llama_cpp
    from provenance import provenance

LICENCE = Path("/usr/share/common-licenses/GPL-3")
SOURCE = Path(sysconfig.get_paths()["stdlib"]) / "json" / "encoder.py"
SUMMARY = "\n\nSummarize the text above in a few sentences."
EDIT = "Rewrite the following Python code with every comment removed, changing nothing else.\n\n"


def cut(session: Session, text: str, tokens: int) -> str:
    """The longest prefix of `text` that ends at a line end and encodes to at most `tokens`."""
    lines = text.splitlines(keepends=True)
    lo, hi = 1, len(lines)
    while lo < hi:  # the most lines that fit
        mid = (lo + hi + 1) // 2
        if len(session.encode("".join(lines[:mid]), chat=False)) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo])


def prompts(session: Session, lengths: list[int]) -> list[tuple[str, str]]:
    """(name, prompt) for each summary length, then the edit at the middle length."""
    licence = LICENCE.read_text()
    out = [(f"summary {n}", cut(session, licence, n) + SUMMARY) for n in lengths]
    middle = sorted(lengths)[len(lengths) // 2]
    out.append((f"edit {middle}", EDIT + cut(session, SOURCE.read_text(), middle)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--gguf", help="GGUF for llama.cpp (default: the embedded default)")
    ap.add_argument("--lengths", default="1024,3072,6144", help="summary document lengths, in tokens")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    llama_cpp, args.gguf = load_llama_cpp(args.gguf)
    sessions = {}
    for path in args.bundles:  # a plain and a speculative session each (one set of weights)
        plain = Session(path, threads=args.threads, prompt_cache=False)
        sessions[path] = (plain, plain.fork())
        for session in sessions[path]:
            session.eos_token_ids = []  # both sides decode every token asked for
    first = sessions[args.bundles[0]][0]
    cases = prompts(first, [int(x) for x in args.lengths.split(",")])
    longest = max(len(first.encode(p, chat=True)) for _, p in cases)
    for path, (plain, _) in sessions.items():
        if longest + args.max_new_tokens > plain.bundle.max_seq:
            sys.exit(f"{path}: max_seq {plain.bundle.max_seq} is below the longest prompt ({longest} tokens) "
                     f"+ {args.max_new_tokens} new; export it with a larger --max-seq")
    llm = llama_cpp.Llama(args.gguf, n_ctx=longest + args.max_new_tokens, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False, seed=0)
    engines = ["llama.cpp plain"] + [f"{path} {kind}" for path in args.bundles for kind in ("plain", "spec")]
    keys = ("first_token_s", "decode_tps", "request_tps")
    rows = []
    for name, prompt in cases:
        ids = first.encode(prompt, chat=True)
        m = {e: {k: [] for k in keys} for e in engines}
        out = {}
        for _ in range(args.repeats):
            ref, s, first_s = llama_generate(llm, ids, args.max_new_tokens, set(), keep_cache=False)
            for k, v in zip(keys, (first_s, decode_rate(len(ref), s, first_s), len(ref) / s)):
                m["llama.cpp plain"][k].append(v)
            for path, (plain_session, spec_session) in sessions.items():
                plain = plain_session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, speculate=False)
                spec = spec_session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, draft_len="auto")
                out[path] = plain, spec
                for kind, result in (("plain", plain), ("spec", spec)):
                    for k, v in zip(keys, (result.stats.first_token_seconds, result.stats.decode_tokens_per_second,
                                           result.stats.tokens_per_second)):
                        m[f"{path} {kind}"][k].append(v)
        llama = {k: round(statistics.median(v), 3) for k, v in m["llama.cpp plain"].items()}
        for path, (plain, spec) in out.items():
            row = {"prompt": name, "bundle": path, "prompt_tokens": len(ids), "new_tokens": len(plain.token_ids),
                   "llama_cpp_new_tokens": len(ref), "spec_identical_to_plain": spec.token_ids == plain.token_ids,
                   "plain_identical_to_llama_cpp": plain.token_ids == ref,
                   "spec_tokens_per_pass": round(spec.stats.mean_accepted, 2), "llama.cpp plain": llama}
            for kind in ("plain", "spec"):
                row[f"ours {kind}"] = {k: round(statistics.median(v), 3) for k, v in m[f"{path} {kind}"].items()}
                row[f"decode_ours_{kind}_vs_llama_cpp"] = round(row[f"ours {kind}"]["decode_tps"] / llama["decode_tps"], 3)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)

    print(f"\nagainst llama.cpp on {Path(args.gguf).name}; {args.threads} threads, greedy, {args.max_new_tokens} new "
          f"tokens, median of {args.repeats}, every prompt processed whole, the engines taking turns")
    print(f"{'prompt':<14} {'tokens':>6} {'bundle':<28} | {'first token s: ours / llama.cpp':>32} | "
          f"{'decode tok/s: plain / spec / llama.cpp':>40} | {'request tok/s: plain / spec / llama.cpp':>41} | same")
    for r in rows:
        o, s, c = r["ours plain"], r["ours spec"], r["llama.cpp plain"]
        same = ("spec=plain" if r["spec_identical_to_plain"] else "SPEC DIFFERS") + (
            ", plain=llama.cpp" if r["plain_identical_to_llama_cpp"] else ", plain!=llama.cpp")
        print(f"{r['prompt']:<14} {r['prompt_tokens']:>6} {r['bundle'][-28:]:<28} | {o['first_token_s']:>14.2f} / "
              f"{c['first_token_s']:<15.2f} | {o['decode_tps']:>9.1f} / {s['decode_tps']:5.1f} / {c['decode_tps']:<5.1f} "
              f"({r['decode_ours_plain_vs_llama_cpp']:.2f}x, {r['decode_ours_spec_vs_llama_cpp']:.2f}x) | "
              f"{o['request_tps']:>12.1f} / {s['request_tps']:5.1f} / {c['request_tps']:<8.1f}| {same}")
    if args.json:
        meta = {"bundles": args.bundles, "gguf": args.gguf, "threads": args.threads, "repeats": args.repeats,
                "max_new_tokens": args.max_new_tokens, "llama_cpp_python": llama_cpp.__version__,
                "documents": {"summary": str(LICENCE), "edit": str(SOURCE)}}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "provenance": provenance()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
