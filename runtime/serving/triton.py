"""A Triton Inference Server model repository for a bundle: write it, check it, and the
request schema its Python-backend model (runtime/triton_model.py, written as model.py) serves.

    OUT/NAME/config.pbtxt        the model's configuration: decoupled (streaming), instances, queue bound
    OUT/NAME/1/model.py          loads the bundle once per instance with the lean runtime
    OUT/NAME/1/bundle/           the bundle (or a path config.pbtxt states instead)

Each instance is a process of its own (the Python backend's stub) with one Session: it loads
the bundle's weights, owns its KV buffers and runs one request at a time; Triton queues the
rest, up to `max_queue_size`, and refuses requests past it. Inputs and outputs follow
Triton's LLM conventions (`text_input` in, `text_output` out, `stream`), the sampling fields
keep the names `specdeploy serve` gives them, and the last response of every request carries
the token counts and the speculative statistics.

Only numpy and the runtime here: model.py imports this module inside Triton. The static check
imports tritonclient's `model_config_pb2` and protobuf when it runs.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from specdeploy.core.errors import InputError, SpecdeployError
from specdeploy.core.manifest import load_bundle

from specdeploy.runtime.decoding.request import (
    SETTINGS, STRINGS, Limits, Request, validate, wire_labels, wire_names,
)

BACKENDS = ("ort", "torch", "trt")  # ort runs on the CPU here; torch and trt on the instance's GPU
GPU_BACKENDS = ("torch", "trt")
DEFAULT_MAX_QUEUE = 8
MAX_INSTANCES = 256
MODEL_FILE = "model.py"
VERSION = "1"
BUNDLE_DIR = "bundle"  # inside the version folder, beside model.py


@dataclass(frozen=True)
class Tensor:
    """One input or output of the model, as config.pbtxt declares it."""

    name: str
    data_type: str  # Triton's TYPE_*
    dims: tuple[int, ...]
    optional: bool = False
    doc: str = ""


# The prompt and how the answer is sent, then one optional input per setting of the request
# schema (its names and data types are declared there).
INPUTS = (
    Tensor("text_input", "TYPE_STRING", (1,), False, "the prompt (UTF-8)"),
    Tensor("chat", "TYPE_BOOL", (1,), True, "wrap text_input in the bundle's chat template as a user message"),
    Tensor("stream", "TYPE_BOOL", (1,), True, "a response per round (default false: one response at the end)"),
) + tuple(
    Tensor(s.wire, s.triton, (-1,) if s.kind is STRINGS else (1,), True, s.doc)
    for s in SETTINGS.values() if s.wire is not None
)
OUTPUTS = (
    Tensor("text_output", "TYPE_STRING", (-1,), doc="the text of this response (whole characters)"),
    Tensor("token_ids", "TYPE_INT64", (-1,), doc="the token ids of this response"),
    Tensor("finish_reason", "TYPE_STRING", (1,), doc="last response only: eos, length, stop or cancelled"),
    Tensor("stats", "TYPE_STRING", (1,), doc="last response only: JSON, as `specdeploy generate --json` prints"),
)


# -- writing a repository ------------------------------------------------------------------

def config_text(name: str, instances: int, max_queue: int, backend: str, bundle_path: str,
                threads: int | None = None, source: str = "") -> str:
    """config.pbtxt for a specdeploy model (protobuf text format of Triton's ModelConfig)."""
    kind = "KIND_GPU" if backend in GPU_BACKENDS else "KIND_CPU"

    def tensors(items: tuple[Tensor, ...]) -> str:
        rows = []
        for i, t in enumerate(items):
            optional = " optional: true" if t.optional else ""
            comma = "," if i < len(items) - 1 else ""
            rows.append(f'  {{ name: "{t.name}" data_type: {t.data_type} dims: [ {", ".join(map(str, t.dims))} ]'
                        f'{optional} }}{comma}  # {t.doc}')
        return "\n".join(rows)

    bundle_value = json.dumps(bundle_path, ensure_ascii=False)  # a quoted string protobuf's text format reads
    return f"""# A specdeploy bundle served by Triton's Python backend{f' (from {source})' if source else ''}.
# Check a hand-edited copy with `specdeploy triton-repo --check REPOSITORY`.
name: "{name}"
backend: "python"
max_batch_size: 0  # one request per execution: each instance owns one set of KV buffers
model_transaction_policy {{ decoupled: true }}  # responses stream: one per round with stream=true

# Each instance is a process that loads the bundle once and runs one request at a time.
instance_group [ {{ count: {instances} kind: {kind} }} ]

# Requests wait while every instance is busy; past max_queue_size they are refused at once.
dynamic_batching {{
  default_queue_policy {{ max_queue_size: {max_queue} }}
}}

input [
{tensors(INPUTS)}
]
output [
{tensors(OUTPUTS)}
]

parameters [
  {{ key: "bundle" value: {{ string_value: {bundle_value} }} }},  # relative to the version folder, or absolute
  {{ key: "backend" value: {{ string_value: "{backend}" }} }},  # ort (CPU), torch or trt (the instance's GPU)
  {{ key: "threads" value: {{ string_value: "{threads or ''}" }} }}  # intra-op threads per instance ("": all cores)
]
"""


def write_repository(bundle: str | Path, out: str | Path, name: str | None = None, instances: int = 1,
                     max_queue: int = DEFAULT_MAX_QUEUE, backend: str = "ort", threads: int | None = None,
                     reference: bool = False) -> Path:
    """Write OUT/NAME/{config.pbtxt, 1/model.py, 1/bundle/}; returns OUT/NAME.

    `reference`: config.pbtxt states the bundle's absolute path instead of a copy (a repository
    for this machine only). The bundle is checked (checksums included) before anything is written.
    """
    bundle, out = Path(bundle), Path(out)
    name = name if name is not None else bundle.resolve().name
    _check_settings(name, instances, max_queue, backend, threads)
    load_bundle(bundle, verify=True)  # a broken bundle never becomes a repository
    model_dir = out / name
    if model_dir.exists():
        raise InputError(f"{model_dir} already exists; remove it or choose another --name or OUT")
    version = model_dir / VERSION
    version.mkdir(parents=True)
    (version / MODEL_FILE).write_text(template())
    if reference:
        bundle_path = str(bundle.resolve())
    else:
        shutil.copytree(bundle, version / BUNDLE_DIR)
        bundle_path = BUNDLE_DIR
    (model_dir / "config.pbtxt").write_text(
        config_text(name, instances, max_queue, backend, bundle_path, threads, source=str(bundle)))
    return model_dir


def _check_settings(name: str, instances: int, max_queue: int, backend: str, threads: int | None) -> None:
    if not name or name in (".", "..") or "/" in name or "\\" in name or '"' in name:
        raise InputError(f"--name {name!r}: a model name is one folder name (no '/', '\\' or '\"')")
    if not 1 <= instances <= MAX_INSTANCES:
        raise InputError(f"--instances {instances} is outside [1, {MAX_INSTANCES}]")
    if max_queue < 1:  # Triton reads max_queue_size 0 as no bound at all
        raise InputError(f"--max-queue {max_queue} must be >= 1 (Triton reads 0 as an unbounded queue)")
    if backend not in BACKENDS:
        raise InputError(f"--backend {backend!r}: choose from {', '.join(BACKENDS)}")
    if threads is not None and threads < 1:
        raise InputError(f"--threads {threads} must be >= 1")


# -- the model's settings, read from config.pbtxt's parameters ------------------------------

@dataclass(frozen=True)
class ModelSettings:
    bundle: Path
    backend: str = "ort"
    threads: int | None = None

    @classmethod
    def from_parameters(cls, parameters: dict[str, str], version_dir: Path) -> "ModelSettings":
        """From config.pbtxt's parameters (key -> string value); a wrong one is an InputError."""
        path = parameters.get("bundle", "")
        if not path:
            raise InputError("parameter 'bundle' is missing: the bundle's path, relative to the version folder")
        backend = parameters.get("backend", "ort") or "ort"
        if backend not in BACKENDS:
            raise InputError(f"parameter 'backend' {backend!r}: choose from {', '.join(BACKENDS)}")
        threads = parameters.get("threads", "").strip()
        if threads and not (threads.isdigit() and int(threads) >= 1):
            raise InputError(f"parameter 'threads' {threads!r}: an integer >= 1, or empty for all cores")
        return cls(Path(version_dir) / path, backend, int(threads) if threads else None)

    @classmethod
    def from_model_config(cls, config: dict, version_dir: Path) -> "ModelSettings":
        """From the model configuration as JSON (what Triton hands the Python backend's `initialize`)."""
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        return cls.from_parameters(parameters, version_dir)


def select_gpu(device_id: int) -> None:
    """Before any CUDA work in this instance's process: make the instance's GPU the only one
    visible, so the backend's default device (cuda:0) is the GPU Triton gave the instance."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",")] if visible else None
    os.environ["CUDA_VISIBLE_DEVICES"] = devices[device_id] if devices and device_id < len(devices) else str(device_id)


# -- requests -------------------------------------------------------------------------------

NAMES = wire_names("text_input")  # a request field -> the input that carries it
LABELS = wire_labels("text_input")


@dataclass(frozen=True)
class TritonRequest:
    """A validated Triton request: the schema's request, and whether its answer streams."""

    request: Request
    stream: bool = False

    @property
    def prompt(self) -> str:
        return self.request.prompt

    @property
    def chat(self) -> bool:
        return self.request.chat

    @property
    def max_tokens(self) -> int | None:
        return self.request.max_new_tokens  # None: the default, capped to what fits after the prompt

    @property
    def options(self) -> dict:
        """The sampling settings, the stop strings and the draft length, by their input names."""
        r = self.request
        return {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "seed": r.seed,
                "stop": list(r.stop), "draft_len": r.draft_len}


def parse_request(get: Callable[[str], np.ndarray | None], limits: Limits) -> TritonRequest:
    """The request's inputs (`get(name)`: the array, or None when absent) read into the request
    schema's fields and checked by its one `validate`, as `specdeploy serve` checks a body, each
    error naming its input. Triton has already checked each input's data type and shape
    against config.pbtxt.

    >>> inputs = {"text_input": np.array([b"Hi"], dtype=object), "temperature": np.array([0.0])}
    >>> parse_request(inputs.get, Limits(128, 8, 8192)).request.temperature
    0.0
    >>> parse_request({**inputs, "top_p": np.array([0.0])}.get, Limits(128, 8, 8192))
    Traceback (most recent call last):
    ...
    specdeploy.runtime.decoding.request.RequestError: 'top_p' 0.0 is outside (0, 1]
    """
    given = {"prompt": _text(_scalar(get, "text_input"), "text_input"), "chat": _flag(get, "chat")}
    for name, s in SETTINGS.items():
        if s.wire is None:
            continue
        value = _strings(get, s.wire) if s.kind is STRINGS else _scalar(get, s.wire)
        if value is not None:  # absent: the default
            given[name] = value
    return TritonRequest(validate(given, limits, LABELS), stream=_flag(get, "stream"))


def encode(session, req: TritonRequest) -> Request:
    """The request with its prompt's token ids (through the chat template when asked) and its
    new tokens resolved, after the length checks that need the token count (as `specdeploy
    serve`): what `Session.start` runs."""
    return session.prepare(req.request, LABELS)


def _scalar(get, name: str):
    value = get(name)
    if value is None:
        return None
    flat = value.reshape(-1)
    if flat.size != 1:
        raise InputError(f"'{name}' must hold one value, got {flat.size}")
    return flat[0].item() if isinstance(flat[0], np.generic) else flat[0]


def _flag(get, name: str) -> bool:
    value = _scalar(get, name)
    return bool(value) if value is not None else False


def _strings(get, name: str) -> list[str] | None:
    value = get(name)
    return None if value is None else [_text(v, name) for v in value.reshape(-1)]


def _text(value, name: str):
    """A string input's text (its UTF-8 decoded; the schema checks the text)."""
    if value is None:
        raise InputError(f"'{name}' is missing")
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"'{name}' is not valid UTF-8 (byte {e.start})") from None
    return value


# -- responses ------------------------------------------------------------------------------

def piece_outputs(text: str, token_ids: list[int]) -> dict[str, np.ndarray]:
    """The outputs of one streamed response."""
    return {"text_output": np.array([text.encode("utf-8")], dtype=np.object_),
            "token_ids": np.asarray(token_ids, dtype=np.int64)}


def final_outputs(text: str, token_ids: list[int], stats) -> dict[str, np.ndarray]:
    """The outputs of a request's last response: its text and ids (the rest of a stream, or the
    whole answer), why it ended, and its statistics."""
    return {**piece_outputs(text, token_ids),
            "finish_reason": np.array([stats.finish_reason.encode()], dtype=np.object_),
            "stats": np.array([json.dumps(stats.as_dict()).encode()], dtype=np.object_)}


# -- the static check -----------------------------------------------------------------------

@functools.cache
def model_config_module():
    """tritonclient's `model_config_pb2` (protobuf only), loaded from its file so that grpcio
    need not be installed."""
    spec = importlib.util.find_spec("tritonclient")
    path = Path(list(spec.submodule_search_locations)[0]) / "grpc" / "model_config_pb2.py" if spec else None
    if path is None or not path.is_file():
        raise InputError("the check needs tritonclient and protobuf: pip install 'specdeploy[triton]'")
    module_spec = importlib.util.spec_from_file_location("specdeploy_triton_model_config_pb2", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except ImportError as e:
        raise InputError(f"the check needs protobuf ({e}): pip install 'specdeploy[triton]'") from None
    return module


def parse_config(path: Path):
    """config.pbtxt as Triton's ModelConfig; a misspelt field or enum value is an InputError
    naming the file, line and column."""
    from google.protobuf import text_format

    pb2 = model_config_module()
    try:
        return text_format.Parse(Path(path).read_text(), pb2.ModelConfig())
    except text_format.ParseError as e:
        raise InputError(f"{path}:{str(e).splitlines()[0]}") from None
    except UnicodeDecodeError:
        raise InputError(f"{path}: not UTF-8 text") from None


def template() -> str:
    """The model.py a repository's version folder holds (runtime/triton_model.py)."""
    return Path(__file__).with_name("triton_model.py").read_text()


def check_model(model_dir: Path) -> tuple[list[str], str]:
    """(problems, summary) of one specdeploy model folder: its config parses as Triton's
    ModelConfig and declares what model.py reads and writes, its model.py is this version's,
    and its bundle loads (checksums included)."""
    config_path = model_dir / "config.pbtxt"
    try:
        config = parse_config(config_path)
    except InputError as e:
        return [str(e)], ""
    pb2 = model_config_module()
    problems: list[str] = []

    def problem(message: str) -> None:
        problems.append(f"{config_path}: {message}")

    if config.name and config.name != model_dir.name:
        problem(f'name "{config.name}" differs from its folder "{model_dir.name}" (Triton requires them equal)')
    if config.backend != "python":
        problem(f'backend "{config.backend}": model.py runs on Triton\'s Python backend (backend: "python")')
    if config.max_batch_size != 0:
        problem(f"max_batch_size {config.max_batch_size}: model.py reads unbatched inputs (max_batch_size: 0)")
    if not config.model_transaction_policy.decoupled:
        problem("model_transaction_policy must be { decoupled: true }: the responses stream")
    for group in config.instance_group:
        if group.count < 0:
            problem(f"instance_group count {group.count} must be >= 1")
    for what, declared, expected in (("input", config.input, INPUTS), ("output", config.output, OUTPUTS)):
        verb = "reads" if what == "input" else "writes"
        wanted, seen = {t.name: t for t in expected}, set()
        for t in declared:
            seen.add(t.name)
            want = wanted.get(t.name)
            if want is None:
                problem(f'{what} "{t.name}" is not one model.py {verb} (it {verb} {", ".join(wanted)})')
                continue
            dtype = pb2.DataType.Name(t.data_type)
            if dtype != want.data_type or tuple(t.dims) != want.dims:
                problem(f'{what} "{t.name}" is {dtype} {list(t.dims)}; model.py expects {want.data_type} '
                        f"{list(want.dims)}")
            if what == "input" and t.optional and not want.optional:
                problem(f'{what} "{t.name}" is optional; model.py needs it')
        for name, want in wanted.items():
            if name not in seen and (what == "output" or not want.optional):
                problem(f'{what} "{name}" is missing: model.py {verb} it')
    versions = sorted(p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())
    if not versions:
        problem(f"no version folder (such as {VERSION}/) holds {MODEL_FILE}")
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    summary = ""
    for version in versions:
        model_file = version / MODEL_FILE
        if not model_file.is_file():
            problem(f"{model_file} is missing")
            continue
        if model_file.read_text(errors="replace") != template():
            problem(f"{model_file} is not the model.py this specdeploy writes (write the repository again)")
        try:
            settings = ModelSettings.from_parameters(parameters, version)
            bundle = load_bundle(settings.bundle, verify=True)
        except SpecdeployError as e:
            problem(str(e))
            continue
        queue = config.dynamic_batching.default_queue_policy.max_queue_size  # 0 (or no dynamic_batching): unbounded
        instances = sum(max(g.count, 1) for g in config.instance_group) or 1
        summary = (f"{model_dir.name}: bundle {bundle.path} (max_seq {bundle.max_seq}), backend {settings.backend}, "
                   f"{instances} instance(s), queue {queue or 'unbounded'}")
    return problems, summary


def _is_specdeploy_model(model_dir: Path) -> bool:
    """A model folder specdeploy wrote: a version folder holds its model.py, or (that file
    gone or edited) its config states a bundle."""
    for version in model_dir.iterdir():
        if version.is_dir() and version.name.isdigit() and (version / MODEL_FILE).is_file():
            text = (version / MODEL_FILE).read_text(errors="replace")
            if "specdeploy" in text:
                return True
    return '"bundle"' in (model_dir / "config.pbtxt").read_text(errors="replace")


def check_repository(out: str | Path) -> tuple[list[str], list[str]]:
    """(problems, summaries) of every specdeploy model in a repository (or of one model folder);
    other models in the repository are named as skipped."""
    out = Path(out)
    if not out.is_dir():
        raise InputError(f"{out}: no such folder (a Triton model repository)")
    models = [out] if (out / "config.pbtxt").is_file() else sorted(
        p for p in out.iterdir() if p.is_dir() and (p / "config.pbtxt").is_file())
    if not models:
        raise InputError(f"{out}: no model folder with a config.pbtxt")
    problems, summaries = [], []
    for model_dir in models:
        if not _is_specdeploy_model(model_dir):
            summaries.append(f"{model_dir.name}: skipped (not a specdeploy model)")
            continue
        found, summary = check_model(model_dir)
        problems += found
        if not found:
            summaries.append(summary)
    return problems, summaries
