"""`export --cache DIR`: a graph exported once is reused by later exports that would make the same.

Trying drafts means exporting one target again and again (`--draft ngram`, then a model draft,
then `self:layers=4`): the target's graph, its quantization and its parity check are the same
each time, and for a real model they are most of an export's minutes. With a cache folder,
each exported model (target or draft graph) is kept there with its manifest entry under a key
that covers everything its bytes depend on:

- the source's sha256 (every file of a folder, or the .gguf),
- every choice that reaches the graph: role, dtype, layers kept, attention, quantization
  scheme and zero form, device, KV dtype, the states an EAGLE-3 head reads, max_seq,
  max_draft, prefill chunk, max batch, whether the source's forward was the parity reference,
- the code that makes graphs (a digest of this package's and specdeploy.core's sources) and the
  versions of torch, transformers, onnx, onnxscript and onnxruntime.

A later export with the same key copies the graph (a copy, never a link: a bundle's files are
its own) and its entry, parity figures included, instead of exporting it again; anything else is a
miss, and the graph is exported and checked as always. The entry's `source` is the path given
this time. An entry is written to a temporary folder and renamed, so exports running at once
may share a cache: the last to finish keeps its copy, which is the same graph.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from specdeploy.core.errors import BundleError
from specdeploy.core.manifest import ModelSpec, graph_files

SPEC = "entry.json"


@functools.lru_cache(maxsize=1)
def _environment() -> dict:
    """What the graph bytes depend on beyond the request: our graph-making code and the libraries."""
    import importlib.metadata as metadata

    import specdeploy.core

    h = hashlib.sha256()
    for folder in (Path(__file__).resolve().parent, Path(specdeploy.core.__file__).resolve().parent):
        for f in sorted(folder.glob("*.py")) + sorted(folder.glob("*.json")):
            h.update(f"{f.name}\0".encode() + f.read_bytes())
    versions = {}
    for name in ("torch", "transformers", "onnx", "onnxscript", "onnxruntime"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"code": h.hexdigest(), **versions}


def cache_key(source_sha256: str, **choices) -> str:
    """The key of a graph: its source's digest, the choices that reach it, and _environment()."""
    material = {"source": source_sha256, "choices": choices, "environment": _environment()}
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:32]


class GraphCache:
    def __init__(self, root: str | Path, log: Callable[[str], None] = lambda _: None):
        self.root = Path(root)
        self.log = log

    def get(self, key: str, work: Path, source: Path) -> ModelSpec | None:
        """The cached entry for `key`, its graph placed in `work`; None on a miss."""
        entry = self.root / key
        try:
            d = json.loads((entry / SPEC).read_text())
            spec = ModelSpec.from_dict(d["role"], d["spec"])
            for name in graph_files(entry, spec.graph):
                shutil.copyfile(entry / name, work / name)
        except (OSError, ValueError, KeyError, TypeError, BundleError):
            # absent, or not whole (entries appear whole, by a rename: this one was damaged since):
            # export it again, and let this export keep its graph there
            shutil.rmtree(entry, ignore_errors=True)
            return None
        checked = (spec.parity or {}).get("max_rel_diff_ort_vs_eager")
        self.log(f"  {spec.role}: the graph exported before with the same source and choices, from the cache "
                 f"{self.root}" + (f" (parity as checked then: {checked:.1e})" if checked is not None else ""))
        return spec.replace(source=str(Path(source).resolve()))

    def put(self, key: str, work: Path, spec: ModelSpec) -> None:
        """Keep `spec` and its graph (in `work`) under `key`. A cache that cannot be written is said
        and skipped: the bundle is what was asked for, the cache only saves time."""
        staging = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.root))
            for name in graph_files(work, spec.graph):
                shutil.copyfile(work / name, staging / name)
            (staging / SPEC).write_text(json.dumps({"role": spec.role, "spec": spec.as_dict()}))
        except OSError as e:
            self.log(f"  {spec.role}: not kept in the cache {self.root} ({e})")
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            return
        try:
            os.rename(staging, self.root / key)
        except OSError:  # another export kept the same graph first
            shutil.rmtree(staging, ignore_errors=True)


__all__ = ["GraphCache", "cache_key"]
