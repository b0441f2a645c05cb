"""Structured output's cost and speculation under a grammar, runs alternating in one session.

    python benchmarks/structured.py BUNDLE [--prompts FILE] [--limit N] [--max-new-tokens N]
        [--repeats R] [--json OUT]

Each prompt (a short text) is asked, through the chat template, for a JSON object of a fixed
schema (a person's name, age, city, occupation and hobbies). Per prompt, R times, in turn:
plain decoding unconstrained (`free`), plain decoding under the schema (`plain`), speculative
under the schema with draft length auto (`spec`), and the same with drafting blind to the
grammar (`blind`: no forced tokens proposed, no draft cut where the grammar leaves it). Every
constrained speculative output is checked token for token against constrained plain, and
every constrained output that ends (EOS within the token limit) parses and validates against
the schema. Decode-only tok/s runs
from the end of the first round to the last token; a prompt's figure is the median of its
R runs; the report gives the median over prompts of each mode and of each prompt's ratios,
tokens per target pass, the tokens the grammar forced, and the mask's own time per token.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema

from specdeploy.runtime import Session
from specdeploy.runtime.decoding import accept, grammar
from specdeploy.runtime.tools.bench import read_prompts

try:
    from benchmarks.provenance import provenance
except ModuleNotFoundError:  # run as a file: benchmarks/ is on sys.path
    from provenance import provenance

HERE = Path(__file__).parent
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
        "occupation": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "occupation", "hobbies"],
    "additionalProperties": False,
}
ASK = "Extract the person's name, age, city, occupation and hobbies as a JSON object: "


class MaskClock:
    """Seconds spent computing grammar masks (Constraint.allowed), and how many."""

    def __init__(self):
        self.seconds, self.count = 0.0, 0
        original = grammar.Constraint.allowed

        def timed(constraint, matcher=None):
            t0 = time.perf_counter()
            out = original(constraint, matcher)
            self.seconds += time.perf_counter() - t0
            self.count += 1
            return out

        grammar.Constraint.allowed = timed


class Blind:
    """Drafting blind to the grammar, for the comparison: proposals taken whole, nothing forced."""

    def __enter__(self):
        self.saved = accept.Judge.cut, accept.Judge.admissible, accept.Judge.forced
        accept.Judge.cut = lambda judge, proposal: proposal
        accept.Judge.admissible = lambda judge, tokens, probs, after=None: tokens
        accept.Judge.forced = lambda judge, most: accept.EMPTY

    def __exit__(self, *exc):
        accept.Judge.cut, accept.Judge.admissible, accept.Judge.forced = self.saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--prompts", default=str(HERE / "prompts_extract.txt"))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    session = Session(args.bundle, prompt_cache=False)  # every run prefills its prompt
    clock = MaskClock()
    structure = {"json": SCHEMA}
    modes = ("free", "plain", "spec", "blind")
    rows = []
    for text in read_prompts(Path(args.prompts))[: args.limit]:
        ids = session.encode_messages([{"role": "user", "content": ASK + text}])
        runs = {m: [] for m in modes}
        masks = []
        for _ in range(args.repeats):
            free = session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, speculate=False)
            before = (clock.seconds, clock.count)
            plain = session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, speculate=False,
                                     structure=structure)
            masks.append(((clock.seconds - before[0]) / max(1, clock.count - before[1]), plain.stats.seconds))
            finished = plain.stats.finish_reason == "eos"  # else cut at the token limit, incomplete
            if finished:
                jsonschema.validate(json.loads(plain.text), SCHEMA)
            spec = session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, structure=structure)
            with Blind():
                blind = session.generate(prompt_ids=ids, max_new_tokens=args.max_new_tokens, structure=structure)
            assert spec.token_ids == plain.token_ids and blind.token_ids == plain.token_ids, text
            for mode, out in zip(modes, (free, plain, spec, blind)):
                runs[mode].append(out.stats)
        med = {m: statistics.median(s.decode_tokens_per_second for s in runs[m]) for m in modes}
        row = {"prompt": text, "tokens": len(plain.token_ids), "free_tokens": len(free.token_ids), "finished": finished,
               **{f"{m}_tok_s": round(med[m], 2) for m in modes},
               "plain_vs_free": round(med["plain"] / med["free"], 3),
               "spec_vs_plain": round(med["spec"] / med["plain"], 3),
               "blind_vs_plain": round(med["blind"] / med["plain"], 3),
               "spec_tokens_per_pass": round(runs["spec"][-1].mean_accepted, 3),
               "blind_tokens_per_pass": round(runs["blind"][-1].mean_accepted, 3),
               "spec_forced": runs["spec"][-1].forced,
               "mask_us": round(statistics.median(m for m, _ in masks) * 1e6, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = ("free_tok_s", "plain_tok_s", "spec_tok_s", "blind_tok_s", "plain_vs_free", "spec_vs_plain",
            "blind_vs_plain", "spec_tokens_per_pass", "blind_tokens_per_pass", "spec_forced", "mask_us", "tokens")
    summary = {k: statistics.median(r[k] for r in rows) for k in keys}
    summary["finished"] = sum(r["finished"] for r in rows)
    summary["prompts"] = len(rows)
    print("medians over prompts:", json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "prompts": rows, "schema": SCHEMA,
                                               "provenance": provenance()}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
