"""A bundle's TensorRT plan: the checks it must pass, and its loading.

- `check_engine_compat`: an engine loads only into the TensorRT version that built it, on the
  kind of GPU it was built for; a mismatch is a BundleError that says how to rebuild.
- `load_engine`: deserialize the plan and check its I/O against the manifest's graph contract
  (the staged inputs, the KV pairs TensorRT must alias in place, the argmax output when the
  manifest records one, the KV dtype and shape, the number of optimization profiles).
- `LoadedEngine`: the deserialized engine and its I/O dtypes, shared by an engine's forks.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specdeploy.core.errors import BundleError
from specdeploy.core.manifest import ModelSpec

from .trt_layout import STAGED_INPUTS


def check_engine_compat(where: str, entry: dict, tensorrt_version: str, gpu: tuple[str, str]) -> None:
    """A TensorRT engine loads only into the TensorRT version that built it, on the kind of
    GPU it was built for; say so, and how to fix it, instead of failing inside TensorRT."""
    built = entry.get("tensorrt_version")
    if built != tensorrt_version:
        raise BundleError(
            f"{where}: engine built with TensorRT {built}, this machine has TensorRT {tensorrt_version}; "
            "engines do not load across TensorRT versions: rebuild it with `specdeploy build BUNDLE`"
        )
    name, cc = gpu
    if (entry.get("gpu_name"), entry.get("compute_capability")) != (name, cc):
        raise BundleError(
            f"{where}: engine built on {entry.get('gpu_name')} (compute capability {entry.get('compute_capability')}), "
            f"this machine has {name} (compute capability {cc}); rebuild it here with `specdeploy build BUNDLE`"
        )


class LoadedEngine:
    """One deserialized engine and what was checked about it, shared by forks."""

    def __init__(self, runtime, engine, dtypes: dict[str, np.dtype]):
        self.runtime, self.engine, self.dtypes = runtime, engine, dtypes


def load_engine(trt, plan_path: Path, spec: ModelSpec, entry: dict, max_seq: int) -> LoadedEngine:
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(plan_path.read_bytes())
    if engine is None:
        raise BundleError(f"{plan_path}: TensorRT could not deserialize the engine; rebuild it with `specdeploy build BUNDLE`")
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = {n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
    argmax = entry.get("argmax_output")  # absent from engines built before it existed
    want_in = set(STAGED_INPUTS) | {i for i, _ in spec.kv_names}
    want_out = {"logits"} | {o for _, o in spec.kv_names} | ({argmax} if argmax else set())
    if inputs != want_in or set(names) - inputs != want_out:
        raise BundleError(
            f"{plan_path}: engine I/O {sorted(names)} does not match the manifest's graph contract; rebuild the engine"
        )
    for past, present in spec.kv_names:
        # The KV-cache update layer writes in place. ICudaEngine::getAliasedInputTensor names the
        # input an output "should alias with" (NvInferRuntime.h, TensorRT 10.15), and both must be
        # bound to one address: "If different addresses are assigned, TensorRT reports an API
        # error" (TensorRT developer guide, KV Cache).
        aliased = engine.get_aliased_input_tensor(present)
        if aliased != past:
            raise BundleError(
                f"{plan_path}: TensorRT aliases {present} to {aliased!r}, not {past}: the KV cache would not be "
                "written in place; rebuild with TensorRT >= 10.15 from an opset-24 TensorScatter graph"
            )
    dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
    if argmax and dtypes[argmax] != dtypes["input_ids"]:
        raise BundleError(
            f"{plan_path}: output {argmax} is {dtypes[argmax]}, input_ids is {dtypes['input_ids']}; a draft step's "
            "argmax is copied byte for byte into the next step's input_ids: rebuild the engine"
        )
    for i, (kv_in, _) in enumerate(spec.kv_names):
        kv_shape = spec.kv_shape(i, 1, max_seq)
        got = tuple(engine.get_tensor_shape(kv_in))
        if dtypes[kv_in] != np.dtype(spec.kv_dtype) or (got[:1] not in ((1,), (-1,))) or got[1:] != kv_shape[1:]:
            raise BundleError(
                f"{plan_path}: KV tensor {kv_in} is {dtypes[kv_in]} {got}, the manifest "
                f"says {spec.kv_dtype} {kv_shape}; rebuild the engine"
            )
    if engine.num_optimization_profiles != len(entry["profiles"]):
        raise BundleError(
            f"{plan_path}: engine has {engine.num_optimization_profiles} optimization profiles, the manifest "
            f"records {len(entry['profiles'])}; rebuild the engine"
        )
    return LoadedEngine(runtime, engine, dtypes)


__all__ = ["LoadedEngine", "check_engine_compat", "load_engine"]
