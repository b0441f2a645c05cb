"""The real Triton Inference Server from the nvidia-pytriton wheel, on loopback, and a gRPC
streaming client for a specdeploy model: for the tests and benchmarks/triton_roundtrip.py.

The wheel ships `tritonserver` (2.51), its Python backend and one backend stub per Python
version. Three things make it run a specdeploy repository from this interpreter:
- a backend folder holding the Python backend with the stub built for this Python;
- LD_LIBRARY_PATH: the interpreter's own lib folder first (the stub links libpython3.X.so,
  which must be this interpreter's patch release: another one's fails to load models with an
  `_thread.RLock ... _recursion_count` error), then the wheel's bundled libraries;
- PATH: this interpreter's bin folder first, so the stub's embedded Python finds it (and, in
  a virtual environment, its pyvenv.cfg) and imports what this environment has installed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PY = f"{sys.version_info[0]}.{sys.version_info[1]}"
# the datatype of each input config.pbtxt declares, and numpy's for it
DTYPES = {"text_input": "BYTES", "stop": "BYTES", "chat": "BOOL", "stream": "BOOL", "max_tokens": "INT32",
          "top_k": "INT32", "draft_len": "INT32", "temperature": "FP64", "top_p": "FP64", "seed": "UINT64",
          "structure": "BYTES", "min_p": "FP64", "presence_penalty": "FP64", "frequency_penalty": "FP64",
          "repetition_penalty": "FP64"}
NUMPY = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "FP64": np.float64, "UINT64": np.uint64}


def wheel_folder() -> Path | None:
    """pytriton/tritonserver of the installed wheel, found without importing pytriton."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


def unavailable() -> str | None:
    """Why the server cannot run here, or None."""
    folder = wheel_folder()
    if folder is None:
        return ("nvidia-pytriton is not installed: its wheels exist for Linux x86_64 and aarch64 with glibc "
                "2.35+ only (docs/serving.md, Triton)")
    if not (folder / "python_backend_stubs" / PY / "triton_python_backend_stub").is_file():
        return f"nvidia-pytriton 0.7.0 ships no Python backend stub for Python {PY} (it has 3.8-3.13)"
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return f"this Python ({sys.executable}) has no shared libpython for the backend stub to load"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Running (a zombie has exited: only its entry is left for its parent to read)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class TritonServer:
    """`tritonserver --model-repository REPO` with HTTP, gRPC and metrics on 127.0.0.1."""

    def __init__(self, repository: Path, workdir: Path, exit_timeout: int = 30):
        self.repository, self.workdir, self.exit_timeout = Path(repository), Path(workdir), exit_timeout
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self.log = self.workdir / "tritonserver.log"
        self.process: subprocess.Popen | None = None
        self.stubs: set[int] = set()

    def command(self) -> tuple[list[str], dict[str, str]]:
        folder = wheel_folder()
        backends = self.workdir / "backends"
        python_backend = backends / "python"
        python_backend.mkdir(parents=True, exist_ok=True)
        for f in (folder / "backends" / "python").iterdir():
            if f.is_file():
                shutil.copy2(f, python_backend / f.name)
        shutil.copy2(folder / "python_backend_stubs" / PY / "triton_python_backend_stub", python_backend)
        env = dict(os.environ)
        libs = [sysconfig.get_config_var("LIBDIR"), str(folder.parent.parent / "nvidia_pytriton.libs")]
        env["LD_LIBRARY_PATH"] = ":".join(libs + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        argv = [
            str(folder / "bin" / "tritonserver"), "--model-repository", str(self.repository),
            "--backend-directory", str(backends), "--cache-directory", str(folder / "caches"),
            "--http-address", "127.0.0.1", "--http-port", str(self.http_port),
            "--grpc-address", "127.0.0.1", "--grpc-port", str(self.grpc_port),
            "--metrics-address", "127.0.0.1", "--metrics-port", str(self.metrics_port),
            "--allow-gpu-metrics", "false", "--exit-timeout-secs", str(self.exit_timeout),
        ]
        return argv, env

    def start(self, within: float = 120) -> float:
        """Seconds until the server and every model are ready."""
        argv, env = self.command()
        t0 = time.perf_counter()
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while not self.ready():
                if self.process.poll() is not None or time.perf_counter() - t0 > within:
                    raise RuntimeError(f"tritonserver did not become ready:\n{self.log_tail()}")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise
        seconds = time.perf_counter() - t0
        self.stubs = descendants(self.process.pid)
        return seconds

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.http_url + "/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> tuple[float, int | None, set[int]]:
        """SIGTERM, then wait (Triton lets requests in flight finish, unloads the models and
        their stubs exit): (seconds, exit status, processes still alive afterwards)."""
        if self.process is None:
            return 0.0, None, set()
        process, self.process = self.process, None
        watched = self.stubs | descendants(process.pid)
        t0 = time.perf_counter()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            status = process.wait(timeout=self.exit_timeout + 30)
        except subprocess.TimeoutExpired:
            process.kill()
            status = process.wait()
        seconds = time.perf_counter() - t0
        deadline = time.monotonic() + 10
        while any(alive(p) for p in watched) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {p for p in watched if alive(p)}
        for pid in left:  # never leave a stub behind, even when a test failed
            os.kill(pid, signal.SIGKILL)
        return seconds, status, left

    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# -- the client ------------------------------------------------------------------------------

@dataclass
class Answer:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    responses: int = 0
    stats: dict | None = None
    finish_reason: str | None = None
    error: str | None = None
    first_seconds: float | None = None  # request sent -> the first response with tokens
    first_tokens: int = 0  # the tokens that response carried (a round's)
    last_seconds: float | None = None  # request sent -> the last response


def _inputs(grpc, fields: dict):
    inputs = []
    for name, value in fields.items():
        dtype = DTYPES.get(name, "INT32")
        if isinstance(value, tuple):  # (value, datatype): a type config.pbtxt does not declare
            value, dtype = value
        array = np.array(value if isinstance(value, list) else [value], dtype=NUMPY[dtype])
        if dtype == "BYTES":
            array = np.array([v.encode() if isinstance(v, str) else v for v in array.tolist()], dtype=np.object_)
        tensor = grpc.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _read(result, answer: Answer, seconds: float) -> bool:
    """Adds one response, `seconds` after its request was sent, to `answer`; True when it was
    the request's last."""
    answer.responses += 1
    answer.text += "".join(b.decode() for b in result.as_numpy("text_output").tolist())
    token_ids = result.as_numpy("token_ids").tolist()
    if token_ids and answer.first_seconds is None:
        answer.first_seconds, answer.first_tokens = seconds, len(token_ids)
    answer.token_ids += token_ids
    answer.last_seconds = seconds
    if result.as_numpy("stats") is not None:
        answer.stats = json.loads(result.as_numpy("stats")[0])
        answer.finish_reason = result.as_numpy("finish_reason")[0].decode()
    return result.get_response().parameters["triton_final_response"].bool_param


def generate(url: str, model: str, requests: list[dict], timeout: float = 60) -> list[Answer]:
    """Sends every request at once over one gRPC stream; each answer as its responses came."""
    import tritonclient.grpc as grpc

    answers = [Answer() for _ in requests]
    done: queue.Queue = queue.Queue()
    with grpc.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: done.put((result, error, time.perf_counter())))
        try:
            started = time.perf_counter()
            for i, fields in enumerate(requests):
                client.async_stream_infer(model, _inputs(grpc, fields), request_id=str(i))
            pending = set(range(len(requests)))
            while pending:
                result, error, at = done.get(timeout=timeout)
                if error is not None:  # Triton's or the model's error: the request's only response
                    tagged = re.search(r"\[request id: (\d+)\]", error.message())  # Triton's errors name it
                    assert tagged or len(pending) == 1, f"an error for which request? {error.message()}"
                    i = int(tagged[1]) if tagged else next(iter(pending))
                    answers[i].error = error.message()
                    pending.discard(i)
                    continue
                i = int(result.get_response().id)
                if _read(result, answers[i], at - started):
                    pending.discard(i)
        finally:
            client.stop_stream()
    return answers


def one(url, model, **fields) -> Answer:
    return generate(url, model, [fields])[0]
