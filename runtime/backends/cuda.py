"""The CUDA runtime as the TensorRT backend and `specdeploy build` use it, through cuda-python.

- `import_modules`: (tensorrt, cuda-python's runtime module), imported only when TensorRT is
  chosen, with a one-line InputError saying what to install when either is missing.
- `Cuda`: the few cudart calls made, each checked (a failure raises `CudaError` naming the
  call and the CUDA error), the current GPU's name and compute capability, and numpy views
  of pinned host memory.

No torch, and no TensorRT or cuda-python import at module load: the runtime imports this
module wherever it runs, and tests hand `Cuda` a fake cudart.
"""
from __future__ import annotations

import ctypes

import numpy as np

from specdeploy.core.errors import InputError

_INSTALL = "pip install 'specdeploy[trt]' (TensorRT >= 10.15 and cuda-python, on a machine with an NVIDIA GPU)"


def import_modules(what: str = "backend 'trt'"):
    """(tensorrt, cuda-python's runtime module), imported only when TensorRT is chosen."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise InputError(f"{what} needs TensorRT's Python package, which is not installed ({e}): {_INSTALL}") from None
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python
        except ImportError as e:
            raise InputError(f"{what} needs cuda-python, which is not installed ({e}): {_INSTALL}") from None
    return trt, cudart


class CudaError(RuntimeError):
    pass


class Cuda:
    """The few CUDA runtime calls the backend makes, through cuda-python, each checked.

    cuda-python returns (cudaError_t, *results) from every call."""

    def __init__(self, cudart):
        self.rt = cudart

    def call(self, name: str, *args):
        result = getattr(self.rt, name)(*args)
        err, rest = result[0], result[1:]
        if err != self.rt.cudaError_t.cudaSuccess:
            what = self.rt.cudaGetErrorName(err)[1]
            raise CudaError(f"{name}: {what.decode() if isinstance(what, bytes) else what}")
        return rest[0] if len(rest) == 1 else rest

    def device(self) -> tuple[str, str]:
        """(GPU name, compute capability "major.minor") of the current device."""
        prop = self.call("cudaGetDeviceProperties", self.call("cudaGetDevice"))
        name = prop.name
        if isinstance(name, (bytes, bytearray)):
            name = bytes(name).split(b"\0", 1)[0].decode(errors="replace")
        return str(name).strip(), f"{prop.major}.{prop.minor}"

    def host_view(self, address: int, nbytes: int) -> np.ndarray:
        """A numpy uint8 view of host memory at `address` (pinned memory from cudaMallocHost)."""
        return np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=np.uint8)


__all__ = ["Cuda", "CudaError", "import_modules"]
