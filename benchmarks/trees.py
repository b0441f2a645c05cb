"""Token trees against chains, side by side on one target, runs alternating in one process.

    python benchmarks/trees.py BUNDLE [--prompts FILE] [--limit N] [--max-new-tokens N]
        [--shared] [--json OUT]

BUNDLE has a suffix draft (`--draft suffix`). For each prompt (chat template applied), in
turn: plain decoding, the n-gram chain of an `--draft ngram` bundle (the same target with the
prompt-lookup drafter, n-grams 4..2, draft length auto), the suffix drafter's chains
(`--tree-nodes 1`) and its trees (`--tree-nodes auto`). Every output is checked token for token
against plain. Decode-only tok/s (first generated token to last); per configuration the median
over prompts of the per-prompt ratio to plain, tokens per target pass, acceptance (accepted /
proposed) and the tree sizes used.

The suffix rows are private requests (the drafter draws on the request's own prompt and
output only, as the n-gram drafter does). With --shared, two more rows draw on a suffix index
of the earlier prompts' requests and outputs, as a service's would: a prompt's answer joins
the index only after all of that prompt's runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specdeploy.runtime import Session
from specdeploy.runtime.tools.bench import read_prompts
from specdeploy.runtime.decoding.drafters import NgramDrafter

try:
    from benchmarks.provenance import provenance
except ModuleNotFoundError:  # run as a file (python benchmarks/NAME.py): benchmarks/ is on sys.path
    from provenance import provenance

HERE = Path(__file__).parent
CONFIGS = {  # name -> (drafter, stream keyword arguments)
    "ngram chain": ("ngram", {}),
    "suffix chain": ("suffix", {"tree_nodes": 1, "private": True}),
    "suffix tree": ("suffix", {"tree_nodes": "auto", "private": True}),
}
SHARED = {"shared chain": ("suffix", {"tree_nodes": 1}), "shared tree": ("suffix", {"tree_nodes": "auto"})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--prompts", default=str(HERE / "prompts_varied.txt"))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--shared", action="store_true", help="also rows that draw on the earlier requests (a shared index)")
    ap.add_argument("--json")
    args = ap.parse_args()
    session = Session(args.bundle, prompt_cache=False)  # every run prefills its prompt
    if session.bundle.draft_kind != "suffix":
        raise SystemExit(f"{args.bundle}: its draft is {session.bundle.draft_kind!r}; export it with --draft suffix")
    drafters = {"suffix": session.drafter, "ngram": NgramDrafter(4, 2)}
    configs = {**CONFIGS, **(SHARED if args.shared else {})}
    rows: dict[str, list[dict]] = {name: [] for name in configs}
    for prompt in read_prompts(Path(args.prompts))[: args.limit]:
        ids = session.encode(prompt, chat=True)
        plain = session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, speculate=False)
        said = []
        for name, (kind, kwargs) in configs.items():
            session.drafter = drafters[kind]
            if kind == "suffix":  # keep this prompt's own runs out of the index until all have run
                session.drafter.remember = said.append
            spec = session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, **kwargs)
            if kind == "suffix":
                del session.drafter.remember
            assert spec.token_ids == plain.token_ids, (prompt, name)
            s = spec.stats
            rows[name].append({
                "ratio": s.decode_tokens_per_second / plain.stats.decode_tokens_per_second,
                "tok_s": s.decode_tokens_per_second, "plain_tok_s": plain.stats.decode_tokens_per_second,
                "tokens_per_pass": s.mean_accepted, "acceptance": s.acceptance_rate,
                "tree_size": statistics.mean(s.tree_sizes) if s.tree_sizes else None,
            })
        if args.shared and said:
            drafters["suffix"].private = False
            drafters["suffix"].remember(said[-1])
        print(f"{prompt[:40]!r:44}", "  ".join(f"{n} {r[-1]['ratio']:.2f}x/{r[-1]['tokens_per_pass']:.2f}"
                                              for n, r in rows.items()), flush=True)
    report = {"bundle": args.bundle, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "shared": args.shared, "configs": {}}
    print(f"\n{'configuration':14} {'speedup':>8} {'tok/s':>7} {'plain':>7} {'tok/pass':>8} {'accept':>7} {'nodes':>6}")
    for name, r in rows.items():
        med = {key: statistics.median(x[key] for x in r) for key in ("ratio", "tok_s", "plain_tok_s",
                                                                      "tokens_per_pass", "acceptance")}
        sizes = [x["tree_size"] for x in r if x["tree_size"] is not None]
        med["tree_size"] = statistics.median(sizes) if sizes else None
        report["configs"][name] = {"median": med, "prompts": r}
        print(f"{name:14} {med['ratio']:7.2f}x {med['tok_s']:7.1f} {med['plain_tok_s']:7.1f} "
              f"{med['tokens_per_pass']:8.2f} {med['acceptance']:7.2f} "
              f"{'-' if med['tree_size'] is None else format(med['tree_size'], '.1f'):>6}")
    if args.json:
        Path(args.json).write_text(json.dumps({**report, "provenance": provenance()}, indent=2))


if __name__ == "__main__":
    main()
