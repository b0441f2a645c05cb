"""What the model inside Triton runs besides the runtime (runtime/serving/triton_model.py, written
as a repository's model.py): its settings as config.pbtxt gives them and the rules they keep
(the repository writer in triton.py refuses what breaks them, its check reports it), its inputs
and outputs, and the request schema's Triton form: requests in, responses out.

Only numpy and the runtime's request schema here: the model imports this module inside Triton.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from specdeploy.core.choices import BACKENDS, GPU_BACKENDS  # ort runs on the CPU here; torch and trt on the instance's GPU
from specdeploy.core.errors import InputError
from specdeploy.runtime.decoding.request import (
    SETTINGS, STRINGS, Limits, Request, validate, wire_labels, wire_names,
)

MAX_INSTANCES = 256
DIGEST_TAG = "bundle_digest"  # config.pbtxt's metric_tags: the digest of the bundle the repository was written for


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


# -- the writer's rules: the writer refuses the first broken one, the check reports each ---------

KIND = {backend: "KIND_GPU" if backend in GPU_BACKENDS else "KIND_CPU" for backend in BACKENDS}
FLAGS = {"name": "--name", "instances": "--instances", "max_queue": "--max-queue", "backend": "--backend", "batch": "--batch",
         "threads": "--threads", "kind": "instance kind"}
CONFIG_FIELDS = {"name": "name", "instances": "instance_group count",
                 "max_queue": "dynamic_batching { default_queue_policy { max_queue_size } }",
                 "backend": "parameter 'backend'", "threads": "parameter 'threads'", "kind": "instance_group kind",
                 "batch": "parameter 'batch'"}


def setting_problems(name: str, instances: tuple[int, ...], max_queue: int | None, backend: str,
                     threads: int | str | None, say: dict[str, str] = FLAGS,
                     kinds: tuple[str, ...] | None = None) -> list[str]:
    """Every rule a repository's settings break, one line each naming the setting as `say`
    calls it (the writer's options, or config.pbtxt's fields).

    `instances`: each instance group's count; `max_queue` None: no queue bound is stated;
    `threads`: a count, or a parameter's text ("" for all cores); `kinds`: each instance
    group's kind (None: the writer's own, from the backend)."""
    problems = []
    if not name or name in (".", "..") or "/" in name or "\\" in name or '"' in name:
        problems.append(f"{say['name']} {name!r}: a model name is one folder name (no '/', '\\' or '\"')")
    if not instances:
        problems.append(f"{say['instances']} is missing: state one instance_group with a count in [1, {MAX_INSTANCES}]")
    for count in instances:
        if not 1 <= count <= MAX_INSTANCES:
            problems.append(f"{say['instances']} {count} is outside [1, {MAX_INSTANCES}]")
    if len(instances) > 1 and sum(instances) > MAX_INSTANCES:
        problems.append(f"{say['instances']}s add up to {sum(instances)}, more than {MAX_INSTANCES}")
    if max_queue is None:
        problems.append(f"{say['max_queue']} is missing: with no bound Triton queues requests without limit")
    elif max_queue < 1:  # Triton reads max_queue_size 0 as no bound at all
        problems.append(f"{say['max_queue']} {max_queue} must be >= 1 (Triton reads 0 as an unbounded queue)")
    problems += runtime_problems(backend, threads, say)
    if backend in BACKENDS:
        for kind in kinds or ():
            if kind != KIND[backend]:
                problems.append(f"{say['kind']} {kind} with backend {backend!r}: {backend} runs as {KIND[backend]}")
    return problems


def runtime_problems(backend: str, threads: int | str | None, say: dict[str, str] = FLAGS) -> list[str]:
    """The rules for what model.py reads besides the bundle: the backend and the threads."""
    problems = []
    if backend not in BACKENDS:
        problems.append(f"{say['backend']} {backend!r}: choose from {', '.join(BACKENDS)}")
    if isinstance(threads, str) and threads.strip() and not threads.strip().isdigit():
        problems.append(f"{say['threads']} {threads!r}: an integer >= 1, or empty for all cores")
    elif _threads(threads) is not None and _threads(threads) < 1:
        problems.append(f"{say['threads']} {_threads(threads)} must be >= 1")
    return problems


def _threads(threads: int | str | None) -> int | None:
    """A thread count from an option or a parameter's text (None: all cores)."""
    if isinstance(threads, str):
        threads = threads.strip()
        return int(threads) if threads.isdigit() else None
    return threads


def batch_problems(batch: str, backend: str, say: dict[str, str] | None = None) -> list[str]:
    """What is wrong with a `batch` setting ("" or an integer 1..64 as text): one line each."""
    name = (say or {}).get("batch", "--batch")
    if batch == "":
        return []
    if not batch.isdigit() or not 1 <= int(batch) <= 64:
        return [f"{name} {batch!r:.20}: expected an integer in [1, 64] (or empty: one request at a time)"]
    if backend not in ("ort", "torch"):
        return [f"{name} {batch}: batched passes run on the ort or torch backend, not {backend}"]
    return []


# -- the model's settings, read from config.pbtxt's parameters ------------------------------

@dataclass(frozen=True)
class ModelSettings:
    bundle: Path
    backend: str = "ort"
    threads: int | None = None
    digest: str = ""  # the bundle's, recorded when the repository was written: model.py loads no other
    batch: int | None = None  # continuous batching of up to this many requests per instance (None: one at a time)

    @classmethod
    def from_parameters(cls, parameters: dict[str, str], version_dir: Path, digest: str = "") -> "ModelSettings":
        """From config.pbtxt's parameters (key -> string value) and its recorded digest; a wrong
        one is an InputError."""
        path = parameters.get("bundle", "")
        if not path:
            raise InputError("parameter 'bundle' is missing: the bundle's path, relative to the version folder")
        backend = parameters.get("backend", "ort") or "ort"
        threads = parameters.get("threads", "")
        batch = parameters.get("batch", "")
        problems = runtime_problems(backend, threads, CONFIG_FIELDS) + batch_problems(batch, backend, CONFIG_FIELDS)
        if problems:
            raise InputError(problems[0])
        if not digest.startswith("sha256:"):
            raise InputError(f'metric_tags "{DIGEST_TAG}" {digest!r} is not a bundle digest (sha256:...); '
                             "write the repository again")
        return cls(Path(version_dir) / path, backend, _threads(threads), digest, int(batch) if batch else None)

    @classmethod
    def from_model_config(cls, config: dict, version_dir: Path) -> "ModelSettings":
        """From the model configuration as JSON (what Triton hands the Python backend's `initialize`)."""
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        return cls.from_parameters(parameters, version_dir, config.get("metric_tags", {}).get(DIGEST_TAG, ""))


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
        if value is not None and s.triton == "TYPE_STRING" and s.kind is not STRINGS:
            value = _text(value, s.wire)  # a string scalar (a structure's JSON text)
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
