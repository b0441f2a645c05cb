"""Our runtime against llama.cpp on the same GGUF, same prompts, same threads, alternating.

    pip install llama-cpp-python      # optional: it compiles llama.cpp (minutes)
    python benchmarks/llamacpp.py engines/smollm2-int4 [engines/smollm2-int8 ...] [--gguf FILE]
        [--prompts FILE] [--max-new-tokens N] [--repeats R] [--threads N] [--prompt-cache] [--json OUT]

For every prompt (our chat template applied; llama.cpp gets the very same token ids), one
repeat runs, in this order: llama.cpp plain, llama.cpp prompt-lookup speculation
(LlamaPromptLookupDecoding), then for each bundle ours plain and ours speculative (the
bundle's draft, draft length auto). Greedy everywhere. tokens/s = new tokens / wall time
from the call to the last token (the whole prompt processed on both sides: llama.cpp's
cache of the previous call's prompt is reset before each call; with --prompt-cache both
sides reuse the prefix the previous call shared), median over repeats, then over
prompts. Decode-only tok/s: the tokens after the first over the time after the first token
(prompt processing excluded; ours from the session's Stats). Each speculative output is compared with its own plain one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specdeploy.runtime import Session
from specdeploy.runtime.tools.bench.inputs import read_prompts

try:
    from benchmarks.provenance import provenance
except ModuleNotFoundError:  # run as a file (python benchmarks/NAME.py): benchmarks/ is on sys.path
    from provenance import provenance

HERE = Path(__file__).parent


def llama_generate(llm, ids: list[int], max_new_tokens: int, eos: set[int], keep_cache: bool
                   ) -> tuple[list[int], float, float]:
    """llama.cpp's greedy tokens for `ids`, the seconds they took, prompt processing
    included, and the seconds to the first token (decode-only: the rest). llama-cpp-python keeps the previous call's KV cache and skips the prompt
    prefix it shares with the new one (a repeat, or the chat template's system prompt);
    unless `keep_cache`, `reset()` forgets it and llama.cpp processes the whole prompt."""
    if not keep_cache:
        llm.reset()
    t0 = time.perf_counter()
    out: list[int] = []
    first = 0.0
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == 1:
            first = time.perf_counter() - t0
        if token in eos or len(out) >= max_new_tokens:
            break
    return out, time.perf_counter() - t0, first


def load_llama_cpp(gguf: str | None):
    """llama-cpp-python (or exit with how to install it) and the GGUF to give it: `gguf`, or
    the embedded default's."""
    try:
        import llama_cpp
    except ImportError:
        sys.exit("this benchmark needs llama-cpp-python: pip install llama-cpp-python")
    if gguf is None:
        from specdeploy.export import embedded_default

        gguf = str(embedded_default())
    return llama_cpp, gguf


def decode_rate(tokens: int, seconds: float, first: float) -> float:
    """Tokens after the first over the time after it (prompt processing excluded)."""
    return (tokens - 1) / (seconds - first) if tokens > 1 and seconds > first else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--gguf", help="GGUF for llama.cpp (default: the embedded default)")
    ap.add_argument("--prompts", default=str(HERE / "prompts.txt"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lookup-tokens", type=int, default=10, help="llama.cpp prompt-lookup draft length")
    ap.add_argument("--prompt-cache", action="store_true",
                    help="both sides reuse the K/V of the prompt prefix the previous call shared (llama-cpp-python's "
                         "default, our Session's prompt cache); default: both process every prompt whole")
    ap.add_argument("--json")
    args = ap.parse_args()
    llama_cpp, args.gguf = load_llama_cpp(args.gguf)
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    prompts = read_prompts(Path(args.prompts))  # a backslash-n inside a line is a newline
    sessions = {path: Session(path, threads=args.threads, prompt_cache=args.prompt_cache) for path in args.bundles}
    # Plain and speculative runs get a session each (one set of weights), as llama.cpp's plain and
    # lookup runs get a Llama each: with --prompt-cache each side reuses only its own previous call.
    spec_sessions = {path: session.fork() for path, session in sessions.items()}
    first = next(iter(sessions.values()))
    ctx = first.bundle.max_seq
    common = dict(n_ctx=ctx, n_threads=args.threads, n_threads_batch=args.threads, verbose=False, seed=0)
    plain_llm = llama_cpp.Llama(args.gguf, **common)
    lookup_llm = llama_cpp.Llama(
        args.gguf, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=args.lookup_tokens), **common
    )
    eos = set(first.eos_token_ids)

    names = ["llama.cpp plain", "llama.cpp lookup"] + [f"{p} {m}" for p in sessions for m in ("plain", "spec")]
    tps: dict[str, list[float]] = {n: [] for n in names}
    dps: dict[str, list[float]] = {n: [] for n in names}  # decode-only
    same = {n: 0 for n in names if not n.endswith("plain")}
    match_llama = {p: 0 for p in sessions}
    rows = []
    for prompt in prompts:
        ids = first.encode(prompt, chat=True)
        runs: dict[str, list[float]] = {n: [] for n in names}
        decode: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.repeats):
            ref, s, first_s = llama_generate(plain_llm, ids, args.max_new_tokens, eos, args.prompt_cache)
            runs["llama.cpp plain"].append(len(ref) / s)
            decode["llama.cpp plain"].append(decode_rate(len(ref), s, first_s))
            look, s, first_s = llama_generate(lookup_llm, ids, args.max_new_tokens, eos, args.prompt_cache)
            runs["llama.cpp lookup"].append(len(look) / s)
            decode["llama.cpp lookup"].append(decode_rate(len(look), s, first_s))
            outputs = {}
            for path, session in sessions.items():
                plain = session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, speculate=False)
                spec = spec_sessions[path].generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, draft_len="auto")
                runs[f"{path} plain"].append(plain.stats.tokens_per_second)
                runs[f"{path} spec"].append(spec.stats.tokens_per_second)
                decode[f"{path} plain"].append(plain.stats.decode_tokens_per_second)
                decode[f"{path} spec"].append(spec.stats.decode_tokens_per_second)
                outputs[path] = (plain.token_ids, spec.token_ids, spec.stats)
        row = {"prompt": prompt[:40], "new_tokens": len(ref)}
        for n in names:
            row[n] = round(statistics.median(runs[n]), 2)
            tps[n].append(statistics.median(runs[n]))
            dps[n].append(statistics.median(decode[n]))
        same["llama.cpp lookup"] += look == ref
        row["llama.cpp lookup identical"] = look == ref
        for path, (plain_ids, spec_ids, stats) in outputs.items():
            same[f"{path} spec"] += spec_ids == plain_ids
            match_llama[path] += plain_ids == ref
            row[f"{path} spec identical"] = spec_ids == plain_ids
            row[f"{path} plain equals llama.cpp"] = plain_ids == ref
            row[f"{path} acceptance"] = round(stats.acceptance_rate, 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    base = statistics.median(tps["llama.cpp plain"])
    decode_base = statistics.median(dps["llama.cpp plain"])
    summary = {}
    cache = "prompt prefixes cached on both sides" if args.prompt_cache else "every prompt processed whole"
    print(f"\n{len(prompts)} prompts, {args.max_new_tokens} new tokens max, {args.threads} threads, median of {args.repeats}, {cache}")
    print(f"{'engine':50s} {'tok/s':>8s} {'vs llama.cpp':>13s} {'decode tok/s':>13s} {'vs llama.cpp':>13s}  output")
    for n in names:
        med = statistics.median(tps[n])
        if n in same:
            check = f"{same[n]}/{len(prompts)} identical to its plain decoding"
        elif n.endswith(" plain") and n != "llama.cpp plain":
            check = f"{match_llama[n[: -len(' plain')]]}/{len(prompts)} identical to llama.cpp plain"
        else:
            check = ""
        dec = statistics.median(dps[n])
        summary[n] = {"tokens_per_second": round(med, 2), "vs_llama_cpp_plain": round(med / base, 3),
                      "decode_tokens_per_second": round(dec, 2), "decode_vs_llama_cpp_plain": round(dec / decode_base, 3),
                      "check": check}
        print(f"{n:50s} {med:8.1f} {med / base:12.2f}x {dec:13.1f} {dec / decode_base:12.2f}x  {check}")
    if args.json:
        meta = {"gguf": args.gguf, "threads": args.threads, "repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
                "llama_cpp_python": llama_cpp.__version__, "prompts": len(prompts), "prompt_cache": args.prompt_cache}
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows,
                                                "provenance": provenance()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
