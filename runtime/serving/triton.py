"""A Triton Inference Server model repository for a bundle: write it and check it. What its
Python-backend model (runtime/serving/triton_model.py, written as model.py) runs besides the
runtime, its settings' rules and its requests and responses, is triton_io.py.

    OUT/NAME/config.pbtxt        the model's configuration: decoupled (streaming), instances, queue bound
    OUT/NAME/1/model.py          loads the bundle once per instance with the lean runtime
    OUT/NAME/1/bundle/           the bundle's listed files (or a path config.pbtxt states instead)

config.pbtxt records the bundle's digest (`metric_tags { key: "bundle_digest" }`): model.py
loads only that bundle, and the check verifies it. The repository is written whole into a
folder beside OUT and moved into place, or not at all.

Each instance is a process of its own (the Python backend's stub) that loads the bundle's
weights and owns its KV buffers: a batch of up to `batch` requests in one pass per round (by
default as many as `serve` batches), or with `batch` empty one Session running one request at
a time; Triton queues the rest, up to `max_queue_size`, and refuses requests past it. Inputs and outputs follow
Triton's LLM conventions (`text_input` in, `text_output` out, `stream`), the sampling fields
keep the names `specdeploy serve` gives them, and the last response of every request carries
the token counts and the speculative statistics.

The static check imports tritonclient's `model_config_pb2` and protobuf when it runs.
"""
from __future__ import annotations

import errno
import functools
import importlib.util
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from specdeploy.core.errors import BundleError, InputError, SpecdeployError
from specdeploy.core.manifest import MANIFEST, Bundle, load_bundle

from specdeploy.runtime.serving.pool import default_batch
from specdeploy.runtime.serving.triton_io import (
    CONFIG_FIELDS, DIGEST_TAG, INPUTS, KIND, OUTPUTS, ModelSettings, Tensor, batch_problems, setting_problems,
)

DEFAULT_MAX_QUEUE = 8
MODEL_FILE = "model.py"
VERSION = "1"
BUNDLE_DIR = "bundle"  # inside the version folder, beside model.py


# -- writing a repository ------------------------------------------------------------------

def config_text(name: str, instances: int, max_queue: int, backend: str, bundle_path: str,
                threads: int | None = None, source: str = "", digest: str = "", batch: int | None = None) -> str:
    """config.pbtxt for a specdeploy model (protobuf text format of Triton's ModelConfig);
    `digest`: the bundle's, as `specdeploy inspect` prints it."""
    kind = KIND.get(backend, "KIND_CPU")  # (this writes what it is given: write_repository checks first)

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
  {{ key: "threads" value: {{ string_value: "{'' if threads is None else threads}" }} }},  # intra-op threads per instance ("": all cores)
  {{ key: "batch" value: {{ string_value: "{'' if batch is None else batch}" }} }}  # "": one request at a time; N: up to N in one pass per round
]

# The bundle this repository was written for (its digest, as `specdeploy inspect` prints it):
# model.py loads no other, so a bundle edited here is refused when the model loads.
metric_tags [ {{ key: "{DIGEST_TAG}" value: "{digest}" }} ]
"""


def write_repository(bundle: str | Path, out: str | Path, name: str | None = None, instances: int = 1,
                     max_queue: int = DEFAULT_MAX_QUEUE, backend: str = "ort", threads: int | None = None,
                     reference: bool = False, replace: bool = False, batch: int | None = None) -> Path:
    """Write OUT/NAME/{config.pbtxt, 1/model.py, 1/bundle/}; returns OUT/NAME.

    `reference`: config.pbtxt states the bundle's absolute path instead of a copy (a repository
    for this machine only). The bundle is checked (checksums included) before anything is
    written; the copy holds exactly the files its manifest lists, each a regular file, and is
    checked again against the bundle's digest. The model folder is written whole into a
    temporary folder beside OUT and moved into place, or not at all. `replace`: an OUT/NAME
    that is a model folder specdeploy wrote is replaced; anything else there is never touched.
    `batch` N: each instance runs continuous batching (runtime/decoding/batch.py), up to N
    requests in one pass per round, the rest of its queue waiting for a slot; 0: one request at
    a time; None: as `serve` chooses (pool.default_batch).
    """
    bundle, out = Path(bundle), Path(out)
    name = name if name is not None else bundle.resolve().name
    problems = setting_problems(name, (instances,), max_queue, backend, threads) + batch_problems(
        "" if not batch else str(batch), backend)
    if problems:
        raise InputError(problems[0])
    _check_out(out)
    source = load_bundle(bundle, verify=True)  # a broken bundle never becomes a repository
    batch = default_batch(source, backend)[0] if batch is None else batch or None
    if batch is not None and batch > source.max_batch:
        raise InputError(f"--batch {batch}: {bundle}'s graphs carry at most {source.max_batch} sequences a pass "
                         f"(re-export with --max-batch {batch})")
    model_dir = out / name
    if model_dir.exists() or model_dir.is_symlink():
        if not replace:
            raise InputError(f"{model_dir} already exists; remove it, choose another --name or OUT, or --replace it")
        if not is_written_model(model_dir):
            raise InputError(f"{model_dir} is not a model folder specdeploy wrote; --replace leaves it alone")
    made = [p for p in (out, *out.parents) if not (p.exists() or p.is_symlink())]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name or 'repository'}.{name}.", suffix=".partial",
                                    dir=_staging_parent(out)))
    try:
        staged = staging / name
        version = staged / VERSION
        version.mkdir(parents=True)
        (version / MODEL_FILE).write_text(template())
        if reference:
            bundle_path = str(bundle.resolve())
        else:
            copy_bundle(source, version / BUNDLE_DIR)
            bundle_path = BUNDLE_DIR
        # with batching, Triton's queue also holds the requests a batch is about to take
        (staged / "config.pbtxt").write_text(config_text(
            name, instances, max_queue + (batch or 0), backend, bundle_path, threads, source=str(bundle),
            digest=source.digest, batch=batch))
        _move_into_place(staging, staged, out, model_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in made[1:]:  # OUT's missing parents, made for the staging folder, nearest first
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return model_dir


def copy_bundle(source: Bundle, into: Path) -> None:
    """Copy the files `source`'s manifest lists (manifest.json and `files`) into the new folder
    `into`, each as a regular file; nothing else of the bundle's folder is read. A listed file
    that is a symbolic link is copied only when it resolves to a regular file inside the bundle;
    the copy is checked against the bundle's digest and checksums."""
    into.mkdir()
    inside = source.path.resolve()
    for name in dict.fromkeys([MANIFEST, *source.manifest.files]):
        path = source.path / name  # a plain name: the manifest refuses folders and '..'
        target = path.resolve() if path.is_symlink() else path
        if path.is_symlink() and inside not in target.parents:
            raise BundleError(f"bundle file {path} links to {target}, outside the bundle folder; not copied")
        try:  # O_NOFOLLOW: a link swapped in since is refused; O_NONBLOCK: a FIFO does not block the open
            fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise BundleError(f"bundle file {path} cannot be read ({e.strerror}); not copied") from None
        with open(fd, "rb") as src:
            if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
                raise BundleError(f"bundle file {path} is not a regular file; not copied")
            with open(into / name, "xb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
    load_bundle(into, verify=True, digest=source.digest)  # the copy is the bundle that was checked


def _check_out(out: Path) -> None:
    """OUT is a folder, or a path whose nearest existing part is one."""
    for part in (out, *out.parents):
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                where = "is" if part == out else f"lies under {part}, which is"
                raise InputError(f"OUT {out} {where} a file, not a folder (a Triton model repository)")
            return


def _staging_parent(out: Path) -> Path:
    """Beside OUT, on OUT's file system (OUT itself where it is a mount point), so that the
    finished model folder moves into place with one rename."""
    if out.is_dir() and out.stat().st_dev != out.parent.stat().st_dev:
        return out
    return out.parent


def _move_into_place(staging: Path, staged: Path, out: Path, model_dir: Path) -> None:
    """Rename the whole model folder to OUT/NAME (an old one specdeploy wrote set aside first,
    and removed once the new one is in place)."""
    if not out.exists():
        try:
            os.rename(staging, out)  # staging holds NAME only: it becomes OUT
            return
        except OSError as e:  # OUT appeared meanwhile: move NAME into it
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    old = staging / ".replaced"
    if model_dir.exists() or model_dir.is_symlink():
        os.rename(model_dir, old)
    try:
        os.rename(staged, model_dir)
    except OSError as e:
        if old.exists():
            os.rename(old, model_dir)
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise InputError(f"{model_dir} appeared while the repository was written; nothing was changed") from None
        raise
    shutil.rmtree(staging)


def is_written_model(model_dir: Path) -> bool:
    """A model folder specdeploy wrote, finished or not: a real folder holding only
    config.pbtxt and the version folder, which holds specdeploy's model.py and (at most) the
    bundle. Only such a folder is ever replaced."""
    version = model_dir / VERSION
    model_file = version / MODEL_FILE
    if model_dir.is_symlink() or not model_dir.is_dir() or version.is_symlink() or model_file.is_symlink():
        return False
    if not {p.name for p in model_dir.iterdir()} <= {"config.pbtxt", VERSION}:
        return False
    if not version.is_dir() or not {p.name for p in version.iterdir()} <= {MODEL_FILE, BUNDLE_DIR, "__pycache__"}:
        return False
    if not model_file.is_file():
        return False
    with open(model_file, errors="replace") as f:
        return f.readline().rstrip("\n") == template().splitlines()[0]


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
    ModelConfig, keeps every rule the writer keeps (setting_problems) and declares what
    model.py reads and writes, its model.py is this version's, and its bundle loads
    (checksums included) and is the one whose digest the config records."""
    config_path = model_dir / "config.pbtxt"
    try:
        config = parse_config(config_path)
    except InputError as e:
        return [str(e)], ""
    pb2 = model_config_module()
    problems: list[str] = []

    def problem(message: str) -> None:
        line = f"{config_path}: {message}"
        if line not in problems:  # a rule model.py also applies is said once
            problems.append(line)

    if config.name and config.name != model_dir.name:
        problem(f'name "{config.name}" differs from its folder "{model_dir.name}" (Triton requires them equal)')
    if config.backend != "python":
        problem(f'backend "{config.backend}": model.py runs on Triton\'s Python backend (backend: "python")')
    if config.max_batch_size != 0:
        problem(f"max_batch_size {config.max_batch_size}: model.py reads unbatched inputs (max_batch_size: 0)")
    if not config.model_transaction_policy.decoupled:
        problem("model_transaction_policy must be { decoupled: true }: the responses stream")
    parameters = {k: v.string_value for k, v in config.parameters.items()}
    bounded = config.HasField("dynamic_batching")
    queue = config.dynamic_batching.default_queue_policy.max_queue_size if bounded else None
    backend = parameters.get("backend", "ort") or "ort"
    for message in setting_problems(
            config.name or model_dir.name, tuple(g.count for g in config.instance_group), queue, backend,
            parameters.get("threads", ""), CONFIG_FIELDS,
            kinds=tuple(pb2.ModelInstanceGroup.Kind.Name(g.kind) for g in config.instance_group)):
        problem(message)
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
    digest = config.metric_tags.get(DIGEST_TAG, "")
    summary = ""
    for version in versions:
        model_file = version / MODEL_FILE
        if not model_file.is_file():
            problem(f"{model_file} is missing")
            continue
        if model_file.read_text(errors="replace") != template():
            problem(f"{model_file} is not the model.py this specdeploy writes (write the repository again)")
        try:
            settings = ModelSettings.from_parameters(parameters, version, digest)
            bundle = load_bundle(settings.bundle, verify=True, digest=settings.digest)
        except SpecdeployError as e:
            problem(str(e))
            continue
        instances = sum(g.count for g in config.instance_group)
        summary = (f"{model_dir.name}: bundle {bundle.path} (max_seq {bundle.max_seq}, {bundle.digest}), "
                   f"backend {settings.backend}, {instances} instance(s), "
                   f"{f'batches of up to {settings.batch}, ' if settings.batch else ''}queue {queue}")
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
