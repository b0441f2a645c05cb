"""Where an engine runs: `Device` ("cpu", "cuda", "cuda:N"), and the GPUs the NVIDIA driver
shows this process, asked through the driver itself (ctypes on libcuda), so that naming a GPU
or finding none imports neither torch nor any CUDA Python package.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from specdeploy.core.errors import InputError, SpecdeployError

KINDS = ("cpu", "cuda")


class DeviceError(SpecdeployError):
    """The device asked for, or the package or provider that runs on it, is not there."""


@dataclass(frozen=True)
class Device:
    kind: str  # one of KINDS
    index: int = 0  # which GPU (CUDA's ordinal, after CUDA_VISIBLE_DEVICES); 0 on the CPU

    @classmethod
    def parse(cls, text: "str | Device") -> "Device":
        """`cpu`, `cuda` (the first GPU) or `cuda:N`; anything else is a one-line InputError.

        >>> Device.parse("cuda:1"), str(Device.parse("cuda")), str(Device.parse("cpu"))
        (Device(kind='cuda', index=1), 'cuda:0', 'cpu')
        """
        if isinstance(text, Device):
            return text
        kind, _, index = str(text).strip().lower().partition(":")
        if kind in KINDS and (not index or (index.isdigit() and kind == "cuda")):
            return cls(kind, int(index or 0))
        raise InputError(f"device {text!r}: expected cpu, cuda or cuda:N")

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"


def _driver() -> ctypes.CDLL | None:
    for name in ("nvcuda.dll",) if os.name == "nt" else ("libcuda.so.1", "libcuda.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def cuda_devices() -> list[str] | None:
    """The names of the GPUs the NVIDIA driver shows this process, by CUDA ordinal; None when
    there is no NVIDIA driver at all (no libcuda to load), [] when it sees no device."""
    lib = _driver()
    if lib is None:
        return None
    if lib.cuInit(0) != 0:  # CUDA_ERROR_NO_DEVICE and kin: a driver but nothing it can use
        return []
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return []
    names = []
    for i in range(count.value):
        handle, name = ctypes.c_int(0), ctypes.create_string_buffer(256)
        ok = lib.cuDeviceGet(ctypes.byref(handle), i) == 0 and lib.cuDeviceGetName(name, 256, handle) == 0
        names.append(name.value.decode(errors="replace") if ok else f"CUDA device {i}")
    return names


def cuda_problem(device: Device) -> str | None:
    """Why `device` is not there (one clause), or None when the driver shows it."""
    names = cuda_devices()
    if names is None:
        return "no NVIDIA driver on this machine (libcuda could not be loaded), so no CUDA device"
    if not names:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return "the NVIDIA driver sees no CUDA device" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
    if device.index >= len(names):
        listed = ", ".join(f"cuda:{i} {n}" for i, n in enumerate(names))
        return f"this machine shows {len(names)} CUDA device(s): {listed}"
    return None


def require_cuda(device: Device) -> None:
    """A one-line DeviceError unless the NVIDIA driver shows `device`."""
    problem = cuda_problem(device)
    if problem is not None:
        raise DeviceError(f"device {device}: {problem}")


def device_name(device: "str | Device") -> str:
    """A device in words for reports: the GPU's name from the driver, or 'CPU'."""
    device = Device.parse(str(device))
    if device.kind == "cpu":
        return "CPU"
    names = cuda_devices() or []
    return names[device.index] if device.index < len(names) else str(device)


__all__ = ["Device", "DeviceError", "cuda_devices", "cuda_problem", "device_name", "require_cuda"]
