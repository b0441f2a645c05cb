"""Engine backends, one module each, registered by name. A backend is a class with
`from_bundle(bundle, spec, threads=None)` that returns an `Engine` (see runtime/engine.py).

Modules import lazily: choosing `ort` never imports torch, and the others' heavy imports
happen only when chosen. Adding a backend is adding a module and a line to `BACKENDS`.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module

from specdeploy.core.errors import InputError
from specdeploy.runtime.engine import Engine


@dataclass(frozen=True)
class Backend:
    module: str  # inside this package
    cls: str
    install: str  # what to install when its module cannot be imported


BACKENDS = {
    "ort": Backend(".ort", "OrtEngine", "pip install onnxruntime"),
    # imports torch and the export stage: the source model is rebuilt
    "torch": Backend(".torch_engine", "TorchEngine", "pip install 'specdeploy[export]'"),
    # importing the module does not import tensorrt; building an engine does
    "trt": Backend(".trt", "TrtEngine", "pip install 'specdeploy[trt]'"),
}


def engine_class(backend: str) -> type:
    entry = BACKENDS.get(backend)
    if entry is None:
        raise InputError(f"backend {backend!r} is not available (choose from {', '.join(BACKENDS)})")
    try:
        module = import_module(entry.module, __name__)
    except ImportError as e:
        raise InputError(f"backend {backend!r} needs a package that is not installed ({e}): {entry.install}") from None
    return getattr(module, entry.cls)


def make_engine(backend: str, bundle, spec, threads: int | None = None) -> Engine:
    """One engine for one graph of `bundle`."""
    return engine_class(backend).from_bundle(bundle, spec, threads=threads)


__all__ = ["BACKENDS", "Backend", "Engine", "engine_class", "make_engine"]
