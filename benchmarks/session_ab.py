"""One bundle decoded by two source trees of specdeploy, in alternating processes: the speed of a
change to the runtime against the code before it.

    python -m benchmarks.session_ab BUNDLE --before /path/to/old/checkout [--after .]
        [--modes plain,auto] [--prompts FILE] [--count N] [--max-new-tokens N] [--rounds R]
        [--batch B --streams S] [--json PATH]

Each round starts one process per tree and mode, in alternating order (before, after, after,
before, ...), each importing `specdeploy` from its tree (a folder holding a `specdeploy` link to
it is put first on PYTHONPATH), loading the bundle and greedily decoding the first --count
prompts, chat template, --max-new-tokens each, after one warm-up request. A mode is `plain`
(speculate off) or `auto` (the bundle's draft, draft length auto). With --batch B a process
serves its prompts through a BatchSession of B slots, --streams requests at a time (the
scheduler's own path), else through one Session, one request after another. Reported per tree
and mode: the median over rounds of decode-only tokens per second (the tokens after each
request's first round over the time after it) beside whole-request tokens per second, and the
ratio after / before of each.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent

CHILD = r"""
import json, sys, threading, time
from specdeploy.runtime import Session
from specdeploy.runtime.decoding.batch import BatchSession
from specdeploy.runtime.tools.bench import read_prompts

bundle, mode, prompts_file, count, new, batch, streams = sys.argv[1:8]
count, new, batch, streams = int(count), int(new), int(batch), int(streams)
prompts = read_prompts(prompts_file)[:count]
kw = dict(chat=True, max_new_tokens=new, speculate=mode == "auto")
if batch:
    session = BatchSession(bundle, batch=batch, max_queue=len(prompts) + 1, prompt_cache=False)
else:
    session = Session(bundle, prompt_cache=False)
session.generate(prompts[0], **kw)  # warm-up
stats = []
t0 = time.perf_counter()
if batch:
    lock = threading.Semaphore(streams)
    def run(p):
        with lock:
            stats.append(session.generate(p, **kw).stats)
    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads: t.start()
    for t in threads: t.join()
else:
    for p in prompts:
        stats.append(session.generate(p, **kw).stats)
wall = time.perf_counter() - t0
decode_tokens = sum(s.new_tokens - s.first_round_tokens for s in stats)
decode_seconds = sum(s.seconds - s.first_token_seconds for s in stats)
print(json.dumps({"decode_tok_s": decode_tokens / decode_seconds if not batch else None,
                  "request_tok_s": sum(s.new_tokens for s in stats) / sum(s.seconds for s in stats),
                  "throughput_tok_s": sum(s.new_tokens for s in stats) / wall,
                  "tokens": sum(s.new_tokens for s in stats)}))
if batch:
    session.close()
"""


def run_child(tree: Path, args, mode: str, links: dict[Path, Path]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(links[tree]), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.bundle), mode, str(args.prompts), str(args.count),
                          str(args.max_new_tokens), str(args.batch), str(args.streams)],
                         env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        sys.exit(f"{tree}: the decode failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--before", type=Path, required=True, help="the source tree before the change")
    ap.add_argument("--after", type=Path, default=HERE.parent, help="the source tree after it (default: this one)")
    ap.add_argument("--modes", default="plain,auto")
    ap.add_argument("--prompts", type=Path, default=HERE / "prompts.txt")
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=0, help="serve through a BatchSession of this many slots")
    ap.add_argument("--streams", type=int, default=1, help="with --batch: requests in flight at a time")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    with tempfile.TemporaryDirectory() as tmp:
        links = {}
        for name, tree in trees.items():
            folder = Path(tmp) / name
            folder.mkdir()
            (folder / "specdeploy").symlink_to(tree)
            links[tree] = folder
        runs: dict[tuple[str, str], list[dict]] = {}
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for mode in args.modes.split(","):
                for name in order:
                    runs.setdefault((name, mode), []).append(run_child(trees[name], args, mode, links))
    key = "throughput_tok_s" if args.batch else "decode_tok_s"
    rows = {}
    for (name, mode), results in runs.items():
        rows[f"{name} {mode}"] = {k: statistics.median(x[k] for x in results) for k in (key, "request_tok_s")}
    what = f"BatchSession({args.batch}), {args.streams} streams" if args.batch else "Session"
    print(f"{args.bundle}: {what}, {args.count} prompts x {args.max_new_tokens} tokens, medians of {args.rounds} rounds")
    print(f"{'':16} {key:>18} {'request_tok_s':>14}")
    for label, row in rows.items():
        print(f"{label:16} {row[key]:18.1f} {row['request_tok_s']:14.1f}")
    for mode in args.modes.split(","):
        a, b = rows[f"before {mode}"], rows[f"after {mode}"]
        print(f"after / before, {mode}: {key} {b[key] / a[key]:.3f}x, request {b['request_tok_s'] / a['request_tok_s']:.3f}x")
    if args.json:
        from benchmarks.provenance import provenance

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "runs": {f"{n} {m}": v for (n, m), v in runs.items()},
                                         "settings": {k: str(v) for k, v in vars(args).items()},
                                         "provenance": provenance()}, indent=1))


if __name__ == "__main__":
    main()
