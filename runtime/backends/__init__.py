"""Engine backends, one module each, registered by name. A backend is a class with
`from_bundle(bundle, spec, threads=None, ...)` that returns an `Engine` (see runtime/engine.py).

Modules import lazily: choosing `ort` never imports torch, and the others' heavy imports
happen only when chosen. Adding a backend is adding a module and a line to `BACKENDS`.

Where an engine runs is a `BackendChoice`: the backend's name, a `Device` (or None: the
backend's own default) and, for `ort` on CUDA, the TensorRT execution provider. It is checked
once, against what each backend declares it takes, before any engine is built; the loop and
the drafters pass it on unread.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module

from specdeploy.core.choices import BACKENDS as CHOICES
from specdeploy.core.errors import InputError
from specdeploy.runtime.decoding.engine import Engine

from . import devices
from .devices import Device, DeviceError


@dataclass(frozen=True)
class Backend:
    module: str  # inside this package
    cls: str
    install: str  # what to install when its module cannot be imported
    devices: tuple[str, ...] = ()  # device kinds its `from_bundle(device=...)` takes; () = it picks its own
    trt_ep: bool = False  # takes `from_bundle(trt_ep=True)`: ONNX Runtime's TensorRT execution provider
    checks_gpu: bool = False  # says itself, in one line, what a CUDA device it is given lacks (else checked here)


BACKENDS = {
    "ort": Backend(".ort", "OrtEngine", "pip install onnxruntime (or onnxruntime-gpu for --device cuda)",
                   devices=("cpu", "cuda"), trt_ep=True, checks_gpu=True),
    # imports torch and the export stage: the source model is rebuilt (default: CUDA when torch sees a GPU)
    "torch": Backend(".torch_engine", "TorchEngine", "pip install 'specdeploy[export]'", devices=("cpu", "cuda")),
    # importing the module does not import tensorrt; building an engine does (on the current CUDA device)
    "trt": Backend(".trt", "TrtEngine", "pip install 'specdeploy[trt]'"),
}
assert tuple(BACKENDS) == CHOICES, "core/choices.py names the backends this registry holds"


@dataclass(frozen=True)
class BackendChoice:
    """A backend by name, on `device` (None: the backend's default), with ONNX Runtime's
    TensorRT execution provider (`trt_ep`, ort on CUDA only). Built through `of`, which checks it."""

    name: str = "ort"
    device: Device | None = None
    trt_ep: bool = False

    @classmethod
    def of(cls, backend: "str | BackendChoice", device: "str | Device | None" = None,
           trt_ep: bool = False) -> "BackendChoice":
        """Checked: the backend exists, takes the device, and `trt_ep` only with ort on CUDA.

        >>> str(BackendChoice.of("ort", "cuda:1", trt_ep=True))
        'ort on cuda:1 (TensorRT EP)'
        """
        if isinstance(backend, BackendChoice):
            return backend
        entry = BACKENDS.get(backend)
        if entry is None:
            raise InputError(f"backend {backend!r} is not available (choose from {', '.join(BACKENDS)})")
        device = None if device is None else Device.parse(device)
        if device is not None and not entry.devices:
            raise InputError(f"backend {backend!r} runs on the current CUDA device and takes no --device "
                             f"(--device is for the {', '.join(n for n, b in BACKENDS.items() if b.devices)} backends)")
        if device is not None and device.kind not in entry.devices:
            raise InputError(f"backend {backend!r} does not run on {device.kind} (it takes {', '.join(entry.devices)})")
        if trt_ep and not (entry.trt_ep and device is not None and device.kind == "cuda"):
            raise InputError("--trt-ep (ONNX Runtime's TensorRT execution provider) needs --backend ort --device cuda[:N]")
        if device is not None and device.kind == "cuda" and not entry.checks_gpu:
            devices.require_cuda(device)  # the GPU's absence as one line, not as the backend's traceback
        return cls(backend, device, trt_ep)

    def engine_options(self) -> dict:
        """The keyword arguments this choice adds to the backend's `from_bundle`."""
        options: dict = {} if self.device is None else {"device": str(self.device)}
        if self.trt_ep:
            options["trt_ep"] = True
        return options

    def __str__(self) -> str:
        where = "" if self.device is None else f" on {self.device}"
        return f"{self.name}{where}{' (TensorRT EP)' if self.trt_ep else ''}"


def engine_class(backend: str) -> type:
    entry = BACKENDS.get(backend)
    if entry is None:
        raise InputError(f"backend {backend!r} is not available (choose from {', '.join(BACKENDS)})")
    try:
        module = import_module(entry.module, __name__)
    except ImportError as e:
        raise InputError(f"backend {backend!r} needs a package that is not installed ({e}): {entry.install}") from None
    return getattr(module, entry.cls)


def make_engine(backend: "str | BackendChoice", bundle, spec, threads: int | None = None) -> Engine:
    """One engine for one graph of `bundle`, on the backend (and device) chosen."""
    choice = BackendChoice.of(backend)
    return engine_class(choice.name).from_bundle(bundle, spec, threads=threads, **choice.engine_options())


def make_batch_engine(backend: str, bundle, batch: int, threads: int | None = None, device: str | None = None,
                      role: str = "target"):
    """The bundle's target (or draft graph) over `batch` KV slots (runtime/decoding/batch.py):
    ONNX Runtime on the CPU, or the torch backend (CPU or CUDA)."""
    choice = BackendChoice.of(backend, device)
    if choice.name == "ort" and choice.device is not None and choice.device.kind != "cpu":
        raise InputError("batched passes on ONNX Runtime run on the CPU; on a GPU use --backend torch")
    if choice.name in ("ort", "torch"):
        return engine_class(choice.name).from_bundle(bundle, bundle.model(role), threads=threads, batch=batch,
                                                     **choice.engine_options())
    raise InputError(f"backend {choice.name!r} runs one sequence per pass; batched serving takes --backend ort or torch")


__all__ = ["BACKENDS", "Backend", "BackendChoice", "Device", "DeviceError", "Engine", "engine_class", "make_batch_engine", "make_engine"]
