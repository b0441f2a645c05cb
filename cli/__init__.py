"""The `specdeploy` command. Thin: every command calls library functions.

User mistakes print one line on stderr (`error: ...`) and exit 1, never a traceback.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from pathlib import Path

import click

from specdeploy.core.errors import InputError, SpecdeployError
from specdeploy.core.choices import BACKENDS, DEVICES, DTYPES, KV_CHOICES, QUANT_SCHEMES
from specdeploy.core.manifest import ATTENTIONS

DEFAULT_PROMPT = "Explain in three short sentences why the sky is blue."


THREADS = click.IntRange(1, 256)  # ONNX Runtime intra-op threads: a pool past this is a typo, not a setting
POSITIVE = click.IntRange(min=1)


def _writable_file(flag: str, path: Path | None) -> None:
    """Checked before the run whose results it will hold: a run's minutes are not lost to a
    missing folder at the end."""
    if path is None:
        return
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a folder; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: no folder {parent}")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{flag} {path}: the folder {parent} is not writable")


def _port_free(host: str, port: int) -> None:
    """Before the bundle loads: a port in use is a one-line error, not the server's own exit."""
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, port))
    except OSError as e:
        raise InputError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None


class _Cli(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SpecdeployError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(1)




def _device_options(command):
    """--device and --trt-ep: where the engines run (checked by the runtime, one-line errors)."""
    command = click.option("--trt-ep", is_flag=True,
                           help="ort on CUDA: ONNX Runtime's TensorRT execution provider (engine cache beside the "
                                "bundle); its CUDA provider where TensorRT is missing.")(command)
    return click.option("--device", help="cpu, cuda or cuda:N for the ort and torch backends  "
                                         "[default: ort on the CPU, torch on CUDA when it sees a GPU]")(command)


@click.group(cls=_Cli)
def main():
    """Export draft and target models into bundles; run lossless speculative decoding."""


_own_process = False  # set by run(): the `specdeploy` command, whose ONNX Runtime sessions are all ours


def run():
    """The `specdeploy` command's entry point: `main` in a process of its own."""
    global _own_process
    _own_process = True
    main()


def _share_threads(threads: int | None) -> None:
    """In a process of its own, the sessions run on one ONNX Runtime thread pool (a target and
    its draft take turns on the same threads: runtime.backends.ort.share_cpu_threads)."""
    if _own_process:
        from specdeploy.runtime.backends.ort import share_cpu_threads

        share_cpu_threads(threads)


@main.command("export")
@click.option("--target", required=True, help="Hugging Face model folder or .gguf file ('smollm2': the embedded default).")
@click.option("--draft", default="ngram", show_default=True,
              help="PATH (a model sharing the target's tokenizer, or an EAGLE-3 head folder), self:layers=N[,dtype=D], "
                   "mtp (the MTP layer of the target's checkpoint), "
                   "ngram, suffix (a suffix index over the request and earlier ones, proposing token trees), or none.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Bundle folder to write.")
@click.option("--max-seq", type=int, default=None,
              help="KV buffer length: prompt + new tokens must fit; export states its K/V memory.  "
                   "[default: the model's context, at most 8192]")
@click.option("--max-draft", default=8, show_default=True, help="Largest draft length a verify pass may carry.")
@click.option("--max-batch", default=8, show_default=True,
              help="Most sequences one pass may carry (the graphs' batch dimension: what `serve` batches).")
@click.option("--for", "device", type=click.Choice(DEVICES), default="cpu", show_default=True,
              help="Where the bundle will run: cpu (ONNX Runtime), cuda (ONNX Runtime CUDA or torch), tensorrt "
                   "(standard ONNX only, checked by check-trt); sets --dtype's default.")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="Target weights: fp32; fp16 (GPUs; KV cache fp16 too); int8/int4 (weight-only blocks).  "
                   "[default: int4 --for cpu, fp16 --for cuda/tensorrt (fp32 for Gemma)]")
@click.option("--draft-dtype", type=click.Choice(DTYPES), default=None, help="Draft model weights.  [default: --dtype]")
@click.option("--kv-dtype", type=click.Choice(list(KV_CHOICES)), default=None,
              help="Target KV buffers: fp16 halves the memory a long context reads and holds (fp32/int8/int4 "
                   "targets, exact attention).  [default: fp16 for an int8/int4 target --for cpu with exact "
                   "attention, else the dtype's own: fp32, fp16, bf16]")
@click.option("--prefill-chunk", type=POSITIVE, default=None, help="Prompt tokens per prefill pass.  [default: 64, at most --max-seq]")
@click.option("--attention", type=click.Choice(ATTENTIONS), default="exact", show_default=True,
              help="Target graph: exact (verify rows equal single steps bit for bit) or fused (ONNX Runtime's "
                   "GroupQueryAttention and fused norms; ONNX Runtime only; exact up to rounding).")
@click.option("--quant-scheme", type=click.Choice(QUANT_SCHEMES), default="exact", show_default=True,
              help="int8/int4 target: exact (a GGUF's own blocks) or fast (re-quantized in the form the CPU kernels "
                   "run fastest, 4-bit head).")
@click.option("--draft-attention", type=click.Choice(ATTENTIONS), default=None,
              help="Draft graph.  [default: fused for an int8/int4 draft, else --attention]")
@click.option("--draft-quant-scheme", type=click.Choice(QUANT_SCHEMES), default=None,
              help="int8/int4 draft.  [default: exact]")
@click.option("--cache", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A folder that keeps each exported graph: a later export of the same source with the same "
                   "choices (another --draft for one target) reuses it instead of exporting it again.")
def export_cmd(target, draft, out, max_seq, max_draft, max_batch, device, dtype, draft_dtype, kv_dtype, prefill_chunk,
               attention, quant_scheme, draft_attention, draft_quant_scheme, cache):
    """Export TARGET (and its draft) into an ONNX bundle with in-place KV buffers."""
    from specdeploy.export import build_bundle, embedded_default

    if target == "smollm2":
        target = embedded_default()
    build_bundle(
        target, draft, out, max_seq, max_draft, dtype, prefill_chunk, log=lambda m: click.echo(m, err=True),
        draft_dtype=draft_dtype, attention=attention, quant_scheme=quant_scheme, draft_attention=draft_attention,
        draft_quant_scheme=draft_quant_scheme, device=device, max_batch=max_batch, kv_dtype=kv_dtype, cache=cache,
    )


@main.command("distill")
@click.option("--target", required=True, help="Hugging Face model folder or .gguf file ('smollm2': the embedded default).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Folder for the draft (a Hugging Face model).")
@click.option("--kind", type=click.Choice(["model", "eagle3"]), default="model", show_default=True,
              help="model: a small causal LM of the target's family; eagle3: an EAGLE-3 head over the target's hidden "
                   "states, in the published layout.")
@click.option("--layers", type=int, help="Draft layers, initialised from the target's first ones (--kind model).  [default: 2]")
@click.option("--draft-vocab", type=int, help="Tokens the draft's head covers (the target's most frequent picks).  [default: 8192]")
@click.option("--tokens", type=int, help="Answer tokens the target generates to learn from.  [default: 40000; eagle3 100000]")
@click.option("--steps", type=int, help="Training steps.  [default: 500; eagle3 900]")
@click.option("--ttt", type=int, help="--kind eagle3: unrolled draft steps per training row.  [default: 3]")
@click.option("--batch", type=int, help="Answers per training step.  [default: 8]")
@click.option("--lr", type=float, help="Peak learning rate (AdamW, warm-up then cosine).  [default: 0.001; eagle3 0.002]")
@click.option("--temperature", type=float, help="The target samples its answers at this temperature (0: greedy).  [default: 0.7]")
@click.option("--max-new-tokens", type=int, help="Tokens per answer.  [default: 128]")
@click.option("--seed", type=int, help="Everything random is drawn from it.  [default: 0]")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def distill_cmd(target, out, kind, no_progress, **given):
    """Train a draft for TARGET: it learns the target's own next-token distributions on
    answers the target writes. Interrupted runs resume (work in OUT.work/); the result is the
    same under the same seed. Export it with `specdeploy export --draft OUT`."""
    from specdeploy.export import embedded_default

    if target == "smollm2":
        target = embedded_default()
    given = {k: v for k, v in given.items() if v is not None}
    say = dict(log=lambda m: click.echo(m, err=True), progress=not no_progress)
    if kind == "eagle3":
        from specdeploy.export.distill_eagle3 import HeadSettings, distill_head

        if "layers" in given:
            raise InputError("--layers: a --kind model setting; an EAGLE-3 head has one layer")
        distill_head(target, out, HeadSettings(**given), **say)
        return
    from specdeploy.export.distill import DistillSettings, distill

    if "ttt" in given:
        raise InputError("--ttt: a --kind eagle3 setting")
    distill(target, out, DistillSettings(**given), **say)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise InputError(f"--prompt-ids {text!r}: expected integers separated by commas") from None


def _request_options(command):
    """The request schema's settings (runtime/decoding/request.py `SETTINGS`) as options of
    `generate`, one per setting, named as the library names them (--top-p for top_p; --no-speculate
    for speculate), with the library's defaults: a setting added to the schema is an option here,
    as it is a field of an HTTP body and a Triton input."""
    from specdeploy.runtime.decoding.request import BOOLEAN, DEFAULTS, INTEGER, NUMBER, SESSION_DEFAULTS, SETTINGS, STRINGS

    for name, s in reversed(list(SETTINGS.items())):
        default = SESSION_DEFAULTS.get(name, DEFAULTS[name])
        doc = re.sub(r"\s*\(default [^)]*\)|;? default \w+", "", s.doc)  # the schema's (a wire request's) default
        shown = "" if default is None or default is False or default == () else f"  [default: {default}]"
        doc = doc[:1].upper() + doc[1:] + "." + shown
        if name == "speculate":
            option = click.option("--no-speculate", "speculate", flag_value=False, default=None,
                                  help="Plain decoding with the target alone.")
        elif s.kind is BOOLEAN:
            option = click.option(f"--{name.replace('_', '-')}", name, flag_value=True, default=None, help=doc)
        else:
            kind = {INTEGER: int, NUMBER: float}.get(s.kind, str)
            option = click.option(f"--{name.replace('_', '-')}", name, type=kind, default=None,
                                  multiple=s.kind is STRINGS, help=doc)
        command = option(command)
    return command


def _json_option(name: str, text: str | None):
    """--tools and --tool-choice take JSON (OpenAI's forms); a tool choice may be a bare word."""
    if text is None or (name == "tool_choice" and not text.lstrip().startswith("{")):
        return text
    try:
        return json.loads(text)
    except ValueError as e:
        raise InputError(f"--{name.replace('_', '-')}: not JSON ({e})") from None


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompt", help="Prompt text.")
@click.option("--prompt-ids", help="Prompt as token ids, comma separated (instead of --prompt).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the bundle's chat template as a user message.")
@_request_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: text, token_ids, stats (and logprobs, "
                                                      "tool_calls where asked for).")
@click.option("--threads", type=THREADS, help="ONNX Runtime intra-op threads (default: all cores).")
@click.option("--backend", type=click.Choice(BACKENDS), default="ort", show_default=True)
@_device_options
def generate(bundle, prompt, prompt_ids, chat, as_json, threads, backend, device, trt_ep, **settings):
    """Generate from BUNDLE, streaming the text."""
    from specdeploy.runtime.decoding.session import Session

    if (prompt is None) == (prompt_ids is None):
        raise InputError("give exactly one of --prompt or --prompt-ids")
    kwargs = {k: _json_option(k, v) if k in ("tools", "tool_choice") else v for k, v in settings.items()
              if v is not None and v != ()}
    if "logprobs" in kwargs and not as_json:
        raise InputError("--logprobs: the log probabilities are printed with --json")
    if backend == "ort":
        _share_threads(threads)
    session = Session(bundle, threads=threads, backend=backend, device=device, trt_ep=trt_ep)
    kwargs["chat"] = chat
    if prompt_ids is not None:
        kwargs["prompt_ids"] = _parse_ids(prompt_ids)
    gen = session.stream(prompt, **kwargs)
    if as_json:
        texts, ids, logprobs = [], [], []
        for piece in gen:
            texts.append(piece.text)
            ids += piece.token_ids
            logprobs += piece.logprobs or []
        out = {"text": "".join(texts), "token_ids": ids, "stats": gen.stats.as_dict()}
        if "logprobs" in kwargs:
            out["logprobs"] = [lp._asdict() for lp in logprobs]
        if "tools" in kwargs:
            out["text"], calls = session.tool_calls(ids)
            out["tool_calls"] = [call._asdict() for call in calls]
        click.echo(json.dumps(out))
        return
    for piece in gen:
        click.echo(piece.text, nl=False)
        sys.stdout.flush()
    click.echo()
    s = gen.stats
    click.echo(
        f"[{s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s, acceptance {s.acceptance_rate:.2f}, "
        f"{s.mean_accepted:.2f} tokens per target pass]",
        err=True,
    )


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--no-verify", is_flag=True, help="Skip the checksums.")
def inspect(bundle, no_verify):
    """Print BUNDLE's manifest in human terms."""
    from specdeploy.core.manifest import load_bundle
    from specdeploy.runtime.tools.report import describe

    click.echo(describe(load_bundle(bundle, verify=not no_verify)))


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--backend", type=click.Choice(BACKENDS), default="ort", show_default=True)
@_device_options
@click.option("--draft-len", default="1,2,4,8,auto", show_default=True, help="Comma-separated draft lengths.")
@click.option("--prompts", type=click.Path(path_type=Path), help="One prompt per line (default: a built-in set).")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--repeats", type=POSITIVE, default=3, show_default=True)
@click.option("--no-chat", is_flag=True, help="Send prompts as plain text, not through the chat template.")
@click.option("--threads", type=THREADS)
@click.option("--json", "json_out", type=click.Path(path_type=Path))
@click.option("--plot", "plot_out", type=click.Path(path_type=Path))
def bench(bundle, backend, device, trt_ep, draft_len, prompts, max_new_tokens, repeats, no_chat, threads, json_out,
          plot_out):
    """Latency profile of BUNDLE: plain vs each draft length, measured and predicted speedup."""
    from specdeploy.runtime.tools.bench import bench as run_bench, format_report, plot, read_prompts, write_json

    if prompts is not None and not prompts.is_file():
        raise InputError(f"--prompts {prompts}: no such file")
    _writable_file("--json", json_out)
    _writable_file("--plot", plot_out)
    texts = read_prompts(prompts) if prompts else None
    if backend == "ort":
        _share_threads(threads)
    report = run_bench(bundle, backend, draft_len, texts, max_new_tokens, repeats, chat=not no_chat,
                       threads=threads, log=lambda m: click.echo(m, err=True), device=device, trt_ep=trt_ep)
    click.echo(format_report(report))
    if json_out:
        write_json(report, json_out)
    if plot_out:
        plot(report, plot_out)


@main.command("check-trt")
@click.argument("bundle", type=click.Path(path_type=Path))
def check_trt(bundle):
    """List every node of BUNDLE's graphs that TensorRT's ONNX parser would refuse."""
    from specdeploy.export.trt_ops import check_bundle, load_table

    problems, table = check_bundle(bundle), load_table()
    for p in problems:
        click.echo(str(p))
    if problems:
        raise InputError(f"{len(problems)} node(s) in {bundle} are not supported by {table.label}")
    click.echo(f"{bundle}: every node passes {table.label} (table: {table.source['url']})")


@main.command("build")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--workspace-gb", type=click.FloatRange(min=0, min_open=True), default=4.0, show_default=True, help="TensorRT builder workspace limit.")
@click.option("--timing-cache", type=click.Path(path_type=Path), help="Default: beside the bundle.")
@click.option("--role", "roles", multiple=True, help="target / draft (default: every model).")
def build(bundle, workspace_gb, timing_cache, roles):
    """Build TensorRT engines (.plan) for BUNDLE's models (needs TensorRT and a GPU)."""
    from specdeploy.export.trt_build import build_engines

    build_engines(bundle, workspace_gb, list(roles) or None, timing_cache, log=lambda m: click.echo(m, err=True))


def _digest_option(ctx, param, value: str | None) -> str | None:
    if value is None:
        return None
    digits = value.removeprefix("sha256:")
    if digits == value or len(digits) != 64 or not set(digits) <= set("0123456789abcdef"):
        raise click.BadParameter(f"{value[:80]!r} is not a bundle digest (sha256: and 64 hex digits, as "
                                 "`specdeploy inspect` prints it)")
    return value


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Loopback by default; 0.0.0.0 exposes it.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="0: any free port.")
@click.option("--workers", type=POSITIVE, default=None,
              help="A pool of N sessions instead of a batch, each generating alone (each owns its KV buffers).")
@click.option("--batch", type=POSITIVE, default=None,
              help="Continuous batching of up to N requests in one pass per round (a bundle exported with --max-batch "
                   ">= N; ONNX Runtime on the CPU).  [default: up to 8 where the bundle batches, else 1 session]")
@click.option("--max-queue", default=8, show_default=True, help="Requests allowed to wait; past it: 503.")
@click.option("--threads", type=THREADS, help="ONNX Runtime intra-op threads per session (one pool for target and draft "
                                         "when --workers is 1).")
@click.option("--model-name", help="Model name reported by the API (default: the bundle folder name).")
@click.option("--max-body-bytes", default=4 << 20, show_default=True, help="Larger request bodies get 413 unread.")
@click.option("--max-prompt-chars", type=int,
              help="Longer prompts get 400 before tokenizing (default: max_seq x the longest token, at least 64).")
@click.option("--queue-timeout", type=float, help="Seconds a request may wait for a session; then 503 (default: no limit).")
@click.option("--graceful-seconds", default=10.0, show_default=True,
              help="On SIGTERM / Ctrl-C: how long requests in flight may finish; then each ends with an error "
                   "(a stream's last event, else a 503).")
@click.option("--digest", callback=_digest_option,
              help="sha256:... as `specdeploy inspect` prints it: serve that bundle only; another is refused before "
                   "listening.")
@_device_options
def serve(bundle, host, port, workers, batch, max_queue, threads, model_name, max_body_bytes, max_prompt_chars,
          queue_timeout, graceful_seconds, digest, device, trt_ep):
    """Serve BUNDLE over OpenAI-compatible HTTP (completions, chat, SSE streaming, /metrics)."""
    from specdeploy.core.manifest import load_bundle
    from specdeploy.runtime.serving.server import running, serve as run_server

    if max_queue < 0:
        raise InputError("--max-queue must be >= 0")
    if batch is not None and (workers is not None or trt_ep):
        raise InputError("--batch runs every request in one batch: leave out --workers and --trt-ep")
    if max_body_bytes < 1 or (max_prompt_chars is not None and max_prompt_chars < 1):
        raise InputError("--max-body-bytes and --max-prompt-chars must be >= 1")
    if (queue_timeout is not None and not queue_timeout > 0) or not 0 <= graceful_seconds < float("inf"):
        raise InputError("--queue-timeout must be > 0 and --graceful-seconds a finite number >= 0")
    _port_free(host, port)
    manifest = load_bundle(bundle, verify=False, digest=digest)  # its manifest alone: another bundle is one line, at once
    workers, batch, plan = running(manifest, workers, batch, device, trt_ep)
    if workers == 1 and batch is None:  # several sessions at once keep pools of their own: none waits on another's threads
        _share_threads(threads)
    pinned = {} if digest is None else {"digest": digest}  # serve's default unless --digest: any bundle
    click.echo(f"serving {bundle}{f' ({digest})' if digest else ''} on http://{host}:{port} ({plan}, "
               f"queue {max_queue})", err=True)
    run_server(str(bundle), host, port, workers, max_queue, threads, model_name, max_body_bytes=max_body_bytes,
               graceful_seconds=graceful_seconds, queue_timeout=queue_timeout, max_prompt_chars=max_prompt_chars,
               device=device, trt_ep=trt_ep, batch=batch, **pinned)


@main.command("triton-repo")
@click.argument("bundle", required=False, type=click.Path(path_type=Path))
@click.argument("out", required=False, type=click.Path(path_type=Path))
@click.option("--name", help="Model name (default: the bundle folder name).")
@click.option("--instances", default=1, show_default=True,
              help="Model instances: processes, each with the bundle loaded and its own KV buffers.")
@click.option("--max-queue", default=8, show_default=True,
              help="Requests allowed to wait while every instance is busy; Triton refuses the ones past it.")
@click.option("--backend", type=click.Choice(BACKENDS), default="ort", show_default=True,
              help="ort on the CPU; torch or trt on each instance's GPU.")
@click.option("--threads", type=THREADS, help="ONNX Runtime intra-op threads per instance (default: all cores).")
@click.option("--reference", is_flag=True, help="State the bundle's absolute path in config.pbtxt instead of copying it.")
@click.option("--batch", type=click.IntRange(min=0), default=None,
              help="Continuous batching in each instance: up to N requests in one pass per round; 0: one request at a "
                   "time.  [default: up to 8 where the bundle batches, else 0]")
@click.option("--replace", is_flag=True,
              help="Replace an OUT/NAME that specdeploy wrote (anything else there is never touched).")
@click.option("--check", "check_dir", type=click.Path(path_type=Path),
              help="Check the repository at this path instead: config.pbtxt against Triton's ModelConfig, model.py, bundle.")
def triton_repo(bundle, out, name, instances, max_queue, backend, threads, reference, batch, replace, check_dir):
    """Write a Triton Inference Server model repository that serves BUNDLE (streaming, over
    gRPC or HTTP): OUT/NAME/config.pbtxt, OUT/NAME/1/model.py and OUT/NAME/1/bundle/ (the files
    BUNDLE's manifest lists), written whole or not at all."""
    from specdeploy.runtime.serving import triton

    if check_dir is not None:
        if bundle is not None:
            raise InputError("--check takes the repository's path; give no BUNDLE or OUT with it")
        problems, summaries = triton.check_repository(check_dir)
        for line in problems:
            click.echo(line)
        if problems:
            raise InputError(f"{len(problems)} problem(s) in {check_dir}")
        for line in summaries:
            click.echo(f"ok: {line}")
        return
    if bundle is None or out is None:
        raise InputError("give BUNDLE and OUT (or --check REPOSITORY)")
    if batch is None:  # chosen here to be said below; a bundle that does not load is write_repository's to refuse
        from specdeploy.core.manifest import load_bundle
        from specdeploy.runtime.serving.pool import default_batch

        with contextlib.suppress(SpecdeployError):
            batch = default_batch(load_bundle(bundle, verify=False), backend)[0] or 0
    model_dir = triton.write_repository(bundle, out, name, instances, max_queue, backend, threads, reference, replace,
                                        batch=batch)
    batching = f", batches of up to {batch}" if batch else ""
    click.echo(f"wrote {model_dir} ({instances} instance(s){batching}, queue {max_queue}); serve it with "
               f"tritonserver --model-repository {out}", err=True)


@main.command("eval")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_file", required=True, type=click.Path(path_type=Path), help="One prompt per line.")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--draft-len", default="auto", show_default=True, help="Draft length of the greedy check (the sampling check pins 1).")
@click.option("--samples", type=click.IntRange(min=0), default=300, show_default=True, help="Seeded samples for the distribution test (0: skip it).")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=1e-3, show_default=True, help="Significance of the chi-square test: a correct sampler fails it with at most this probability.")
@click.option("--near-tie", type=click.FloatRange(min=0), default=1e-3, show_default=True, help="Logit margin under which a flip counts as a near tie.")
@click.option("--strict", is_flag=True, help="Fail on near-tie flips too.")
@click.option("--chat/--no-chat", default=None,
              help="Send the prompts through the bundle's chat template, or as plain text.  [default: chat when the bundle has a template]")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Write the full report here.")
def eval_cmd(bundle, prompts_file, max_new_tokens, draft_len, samples, alpha, near_tie, strict, chat, json_out):
    """Check the quality contract of BUNDLE: speculation changes speed, not output.

    Greedy: speculative vs plain output on every prompt. Sampling: at the position (a
    prompt's end or a point of its greedy continuation) where the drafter proposes a token
    that the verifier accepts with probability closest to 1/2, draft length pinned to 1,
    chi-square tests of the first token against the target's distribution and of the
    (verdict, token) pairs against the rejection sampler's law, at alpha/2 each; it reports
    the draft tokens it saw proposed, accepted and rejected.

    \b
    Exit status:
      0  the contract holds (every check ran over proposed draft tokens)
      1  a usage error (the message says which)
      3  the contract is broken: a wrong accept, or the distribution test failed
      4  not tested: no draft token was proposed where a check needed one (nothing certified)
    """
    from specdeploy.runtime.tools.bench.inputs import read_prompts
    from specdeploy.runtime.tools.evaluate import evaluate
    from specdeploy.runtime.decoding.session import Session

    if not prompts_file.is_file():
        raise InputError(f"--prompts {prompts_file}: no such file")
    _writable_file("--json", json_out)
    prompts = read_prompts(prompts_file)
    if not prompts:
        raise InputError(f"--prompts {prompts_file}: no prompts in it")
    _share_threads(None)
    session = Session(bundle)
    if chat and not session.tokenizer.chat_template:
        raise InputError(f"{bundle}: the bundle's tokenizer has no chat template; drop --chat or pass --no-chat")
    report = evaluate(session, prompts, max_new_tokens, draft_len, near_tie, samples, alpha, strict, chat=chat)
    g = report["greedy"]
    for row in g["rows"]:
        extra = "" if row["match"] else f"  first difference at {row['first_difference']}, margin {row['margin']:.4f}: {row['verdict']}"
        click.echo(f"{'ok  ' if row['match'] else 'DIFF'} {row['tokens']:>4} tokens  acceptance {row['acceptance_rate']:.2f}  {row['prompt']!r}{extra}")
    click.echo(f"greedy: {g['exact_match_rate']:.1%} exact ({g['prompts']} prompts), {g['near_ties']} near-tie flips, "
               f"{g['wrong_accepts']} wrong accepts; draft tokens {g['drafted']} proposed, {g['accepted']} accepted, "
               f"{g['rejected']} rejected")
    d = report["sampling"]
    if d is None:
        click.echo("sampling: skipped (--samples 0)")
    else:
        seen = f"draft tokens {d['drafted']} proposed, {d['accepted']} accepted, {d['rejected']} rejected"
        if "prompt" in d:
            click.echo(f"sampling: at {d['prompt']!r} + {d['position']} generated tokens ({d['proposing']} of "
                       f"{d['scanned']} positions had a draft token; this one is accepted with probability "
                       f"{d['accept_probability']:.2f})")
        if "output_pvalue" in d:
            click.echo(f"sampling: first token chi-square p = {d['output_pvalue']:.3g} over {d['cells']} cells; "
                       f"(verdict, first token) p = {d['verdict_pvalue']:.3g} over {d['verdict_cells']} cells; "
                       f"{d['samples']} samples, {seen}; alpha {d['alpha']} ({d['alpha'] / 2:g} each): "
                       f"{'ok' if d['ok'] else 'FAILED'}")
        if "reason" in d:
            click.echo(f"sampling: {'FAILED' if 'pvalue' in d else 'not tested'}: {d['reason']} ({seen})")
    verdict = report["verdict"]
    if verdict == "holds":
        click.echo("contract holds" + (" (greedy only: sampling skipped)" if d is None else ""))
    elif verdict == "broken":
        click.echo("contract BROKEN")
    else:
        click.echo(f"contract NOT TESTED: {'; '.join(report['not_tested'])}")
    if json_out:
        json_out.write_text(json.dumps(report, indent=2))
    if verdict != "holds":
        sys.exit(3 if verdict == "broken" else 4)


@main.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("engines/smollm2"), show_default=True)
@click.option("--draft", default="ngram", show_default=True,
              help="As for `export` (self:dtype=int4 with --dtype fp32: the quantized self-draft); distilled: a "
                   "draft `specdeploy distill` trains on the first run (about 17 minutes here) and keeps in OUT-draft/; "
                   "eagle3: an EAGLE-3 head `specdeploy distill --kind eagle3` trains on the first run (about an hour "
                   "here) and keeps in OUT-eagle3/.")
@click.option("--prompt", default=DEFAULT_PROMPT, show_default=True, help="The chat prompt.")
@click.option("--grounded-prompt", default=None,
              help="A prompt whose answer repeats its input (default: a spelling fix of given text); '' skips it.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--draft-len", default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default="int4", show_default=True,
              help="Target weights; int4 imports the GGUF's own 4-bit blocks exactly.")
@click.option("--repeats", default=3, show_default=True, help="Timed runs of plain and speculative decoding, alternating.")
@click.option("--rebuild", is_flag=True, help="Export again even if the bundle exists.")
def demo(out, draft, prompt, grounded_prompt, max_new_tokens, draft_len, dtype, repeats, rebuild):
    """The main job on the embedded default: export SmolLM2-135M-Instruct (once), answer a
    chat prompt and an input-grounded prompt with speculative decoding, then time each against
    plain decoding."""
    from specdeploy.cli.demo import GROUNDED_PROMPT, run_demo

    if repeats < 1:
        raise InputError(f"--repeats {repeats}: expected at least 1")
    _share_threads(None)
    run_demo(out, draft, prompt, max_new_tokens, draft_len, rebuild, dtype, repeats,
             GROUNDED_PROMPT if grounded_prompt is None else grounded_prompt)


if __name__ == "__main__":
    run()
