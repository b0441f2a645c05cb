"""Bundle ONNX -> TensorRT engines: one `<role>.plan` per model, recorded in the manifest.

    static op check -> OnnxParser -> strongly typed network -> argmax output -> optimization
    profiles over T -> workspace limit -> timing cache (beside the bundle) -> serialized plan
    -> manifest

Written against the documented TensorRT Python API (10.15+, 11.x) and not run in this
project's CI (no TensorRT, no GPU here). The pure parts, which profiles a manifest asks for
and where the files go, are functions of their own and tested without TensorRT.
TensorRT is imported only when an engine is built.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Callable

import numpy as np

from specdeploy.core.errors import BundleError, ExportError, InputError
from specdeploy.core.graph_io import LOGITS_ROWS, bypass_nodes
from specdeploy.core.manifest import Manifest, load_bundle, sha256_file, verify_files, write_manifest
from specdeploy.core.trt_profiles import ARGMAX, Profile, batch_inputs, profiles_for

from .trt_ops import check_bundle

# The first TensorRT whose ONNX parser takes TensorScatter (onnx-tensorrt 10.15 changelog).
MIN_TENSORRT = (10, 15)


def build_profiles(manifest: Manifest) -> list[Profile]:
    """The optimization profiles a bundle's engines get: a draft step (T = 1), a verify pass
    (T up to max_draft + 1) and a prefill chunk (T up to prefill_chunk), L up to max_seq."""
    batched = any(batch_inputs(m) for m in getattr(manifest, "models", {}).values())  # graphs with a batch dimension
    return profiles_for(manifest.max_seq, manifest.max_draft, manifest.prefill_chunk,
                        getattr(manifest, "max_batch", 1) if batched else 1)


def profile_shapes(manifest: Manifest, role: str | None = None) -> list[dict[str, tuple]]:
    """Per profile, {input name: (min, opt, max)}, exactly as passed to `set_shape`.

    >>> from types import SimpleNamespace  # the three fields of a Manifest it reads
    >>> profile_shapes(SimpleNamespace(max_seq=128, max_draft=4, prefill_chunk=16))[0]["attention_mask"]
    ((1, 1, 1, 1), (1, 1, 1, 64), (1, 1, 1, 128))
    """
    batched = batch_inputs(manifest.models[role]) if role is not None else None
    return [p.shapes(batched) for p in build_profiles(manifest)]


def plan_file(role: str) -> str:
    return f"{role}.plan"


def default_timing_cache(bundle_dir: str | Path) -> Path:
    """Beside the bundle, not in it: a timing cache belongs to a GPU and a TensorRT version, not
    to the bundle's contract, and it speeds up every rebuild of it on this machine."""
    bundle_dir = Path(bundle_dir)
    return bundle_dir.parent / f"{bundle_dir.name}.trt-timing.cache"


def version_tuple(version: str) -> tuple[int, ...]:
    """The numbers of a version string.

    >>> version_tuple("10.15.1.29")
    (10, 15, 1, 29)
    """
    return tuple(int(x) for x in re.findall(r"\d+", version))


def _import_tensorrt():
    from specdeploy.runtime.backends.cuda import import_modules

    try:
        trt, cudart = import_modules("`specdeploy build`")
    except InputError as e:
        raise ExportError(str(e)) from None
    if version_tuple(trt.__version__)[:2] < MIN_TENSORRT:
        raise ExportError(
            f"TensorRT {trt.__version__} is too old: its ONNX parser has no TensorScatter (the in-place KV write); "
            f"TensorRT >= {'.'.join(map(str, MIN_TENSORRT))} is needed"
        )
    return trt, cudart


def every_row(model):
    """The graph with every row's logits and no `logits_rows` input (format 1's contract),
    in place: what a plan is built from. The engines' staging, profiles and fused draft
    chains are laid out for that contract, and a plan's passes want every row but a prefill
    chunk's. `logits_rows` reaches, through the exporter's Reshape to 1-D, only Gathers along
    the rows (SpecGraph.forward's index_select before the head): those nodes go, each
    Gather's readers read its data instead, and the dim R becomes T. Returns the model
    (unchanged where it has no such input)."""
    graph = model.graph
    if not any(i.name == LOGITS_ROWS for i in graph.input):
        return model
    rows, drop, readers = {LOGITS_ROWS}, [], {}
    for node in graph.node:  # in topological order: a Reshape of the rows before what reads it
        if not rows.intersection(node.input):
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type in ("Reshape", "Identity") and node.input[0] in rows:
            rows.add(node.output[0])
        elif node.op_type == "Gather" and node.input[1] in rows and node.input[0] not in rows and axis == 1:
            readers[node.output[0]] = node.input[0]
        else:
            raise ExportError(f"{LOGITS_ROWS} reaches a {node.op_type} node ({node.name}), not a Gather along the rows")
        drop.append(node)
    if {o.name for o in graph.output} & (rows | set(readers)):
        raise ExportError(f"{LOGITS_ROWS}: a graph output is computed from it directly")
    bypass_nodes(graph, drop, readers)
    for info in [v for v in graph.value_info if v.name in rows | set(readers)]:
        graph.value_info.remove(info)
    graph.input.remove(next(i for i in graph.input if i.name == LOGITS_ROWS))
    for value in list(graph.output) + list(graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == "R":
                dim.dim_param = "T"
    return model


def _parse(trt, builder, logger, onnx_path: Path):
    import onnx

    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    # Strongly typed: the ONNX's own dtypes decide the precision (TensorRT 11 removed the FP16/BF16
    # builder flags and keeps STRONGLY_TYPED only as an ignored, always-on flag).
    network = builder.create_network(0 if flag is None else 1 << int(flag))
    parser = trt.OnnxParser(network, logger)
    model = every_row(onnx.load(str(onnx_path), load_external_data=False))  # weights stay where they are
    if not parser.parse(model.SerializeToString(), str(onnx_path)):  # the path: external weights beside it
        errors = []
        for i in range(parser.num_errors):
            err = parser.get_error(i)
            node = getattr(err, "node_name", lambda: "")() or err.node()
            errors.append(f"node {node} ({getattr(err, 'node_operator', lambda: '?')()}): {err.desc()}")
        raise ExportError(f"{onnx_path}: TensorRT's ONNX parser refused the graph: {'; '.join(errors) or 'no detail'}")
    return network, parser


def add_argmax_output(trt, network, vocab_size: int) -> list[np.ndarray]:
    """Mark ARGMAX, each logits row's argmax [1, T, 1] in the dtype of input_ids, as an extra
    output: what lets a draft step feed the next one, and a verify pass report its tokens,
    without the logits leaving the device (TrtEngine.draft_chain / verify_chain).

    The first index of the maximum, as numpy's argmax on the host: min over {j : logits[j] ==
    max}. TopK (k = 1) documents no order among equal values, and a tie broken otherwise would
    make a fused round's token differ from the per-pass round's (fp16 logits do tie). The
    layers, per TensorRT's operator pages (10.x): Reduce MAX/MIN with keep_dims over an axes
    bitmask (int64 included), ElementWise EQUAL (float in, bool out, size-1 axes broadcast),
    Select on a bool condition (int64 branches, broadcast), Constant weights of int64.

    Returns the constants' arrays, to keep until the build: "The weights are held by reference
    until the engine has been built" (nvinfer1::Weights, NvInferRuntime.h, 10.15).
    """
    outputs = {network.get_output(i).name: network.get_output(i) for i in range(network.num_outputs)}
    inputs = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    logits, ids_dtype = outputs["logits"], inputs["input_ids"].dtype
    last_axis = 1 << (len(logits.shape) - 1)  # logits [1, T, V]
    index = np.arange(vocab_size, dtype=trt.nptype(ids_dtype)).reshape(1, 1, vocab_size)
    past_end = np.full((1, 1, 1), vocab_size, dtype=index.dtype)  # never the minimum when a row has a maximum
    best = network.add_reduce(logits, trt.ReduceOperation.MAX, last_axis, True).get_output(0)
    is_best = network.add_elementwise(logits, best, trt.ElementWiseOperation.EQUAL).get_output(0)
    candidates = network.add_select(
        is_best,
        network.add_constant(index.shape, trt.Weights(index)).get_output(0),
        network.add_constant(past_end.shape, trt.Weights(past_end)).get_output(0),
    ).get_output(0)
    first = network.add_reduce(candidates, trt.ReduceOperation.MIN, last_axis, True).get_output(0)
    first.name = ARGMAX
    network.mark_output(first)
    return [index, past_end]


def _use_timing_cache(config, cache, path: Path, log: Callable[[str], None]):
    """Set the timing cache on `config`: the one given, else the file at `path`, else a new one.

    One cache object serves every build of the run ("it can be shared by multiple builder
    instances", create_timing_cache) and is saved once at the end; a cache from another device
    makes set_timing_cache(cache, ignore_mismatch=False) return False, and a fresh one is used."""
    if cache is None:
        data = path.read_bytes() if path.is_file() else b""
        cache = config.create_timing_cache(data)
        if data and (cache is None or not config.set_timing_cache(cache, False)):
            log(f"  timing cache {path} does not fit this TensorRT or GPU; starting a new one")
            cache = config.create_timing_cache(b"")
    config.set_timing_cache(cache, False)
    return cache


def build_engines(
    bundle_dir: str | Path,
    workspace_gb: float = 4.0,
    roles: list[str] | None = None,
    timing_cache: str | Path | None = None,
    log: Callable[[str], None] = lambda _: None,
    modules=None,
) -> Manifest:
    """Build one TensorRT engine per model of the bundle (or per `roles`), write `<role>.plan`
    beside the ONNX, record each under models[role]["trt"] with the TensorRT version, GPU name
    and compute capability, add the plans' sha256 to manifest["files"]; returns the manifest."""
    bundle_dir = Path(bundle_dir)
    bundle = load_bundle(bundle_dir, verify=False)
    manifest = bundle.manifest
    if manifest.draft.kind == "eagle3":  # its graphs take hidden states no optimization profile here covers
        raise ExportError(f"{bundle_dir}: an EAGLE-3 bundle runs on --backend ort for now; TensorRT plans of its "
                          "graphs are not built (check-trt still checks every node)")
    _verify_sources(bundle)
    problems = check_bundle(bundle_dir)
    if problems:
        raise ExportError(
            f"{bundle_dir}: {len(problems)} node(s) TensorRT's ONNX parser would refuse, first {problems[0]} "
            f"(see `specdeploy check-trt {bundle_dir}`)"
        )
    trt, cudart = modules or _import_tensorrt()
    from specdeploy.runtime.backends.cuda import Cuda

    gpu_name, cc = Cuda(cudart).device()
    roles = list(manifest.models) if roles is None else roles
    cache_path = Path(timing_cache) if timing_cache is not None else default_timing_cache(bundle_dir)
    profiles = build_profiles(manifest)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    cache = None
    constants: list[np.ndarray] = []  # weights TensorRT reads when it builds, kept until then
    for role in roles:
        entry = manifest.models.get(role)
        if entry is None:
            raise ExportError(f"{bundle_dir}: no {role} model in the manifest (it has {', '.join(manifest.models)})")
        onnx_path = bundle.file(entry.graph)
        t0 = time.perf_counter()
        log(f"  {role}: parsing {onnx_path.name} (dtype {entry.dtype}; the engine keeps the ONNX's types)")
        network, _parser = _parse(trt, builder, logger, onnx_path)
        constants += add_argmax_output(trt, network, entry.vocab_size)
        config = builder.create_builder_config()
        workspace = int(workspace_gb * (1 << 30))
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
        tf32 = entry.dtype in ("fp16", "bf16")
        if not tf32:
            # An fp32 bundle (or an int8/int4 one exported --for tensorrt: float32 activations
            # around its dequantized weights) asks for fp32 arithmetic; BuilderFlag.TF32 is "enabled by default" and
            # would round matmul inputs to 10-bit mantissas (NvInfer.h, BuilderFlag::kTF32, 10.15 and 11.1).
            config.clear_flag(trt.BuilderFlag.TF32)
        for p in profiles:
            profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in p.shapes(batch_inputs(entry)).items():
                profile.set_shape(name, lo, opt, hi)
            config.add_optimization_profile(profile)
        cache = _use_timing_cache(config, cache, cache_path, log)
        log(f"  {role}: building ({len(profiles)} profiles: {', '.join(f'{p.name} T={p.t_min}..{p.t_max}' for p in profiles)})")
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise ExportError(f"{onnx_path}: TensorRT could not build an engine (see its log above)")
        plan_path = bundle.file(plan_file(role))
        _write_atomic(plan_path, plan)
        record = {
            "plan": plan_path.name,
            "tensorrt_version": trt.__version__,
            "gpu_name": gpu_name,
            "compute_capability": cc,
            "strongly_typed": True,
            "argmax_output": ARGMAX,  # engines without it run every round pass by pass
            "tf32": tf32,  # whether fp32 tensors may use TF32 math
            "workspace_bytes": workspace,
            "profiles": [p.as_dict() for p in profiles],
            "onnx_sha256": manifest.files[entry.graph],
            "timing_cache": str(cache_path),
            "build_seconds": round(time.perf_counter() - t0, 1),
        }
        manifest = manifest.replace(
            models={**manifest.models, role: entry.replace(trt=record)},
            files={**manifest.files, plan_path.name: sha256_file(plan_path)},
            sizes={**manifest.sizes, plan_path.name: plan_path.stat().st_size},
        )
        log(f"  {role}: {plan_path.name} written in {record['build_seconds']:.0f}s")
    if cache is not None:
        _write_atomic(cache_path, cache.serialize())
    write_manifest(bundle_dir, manifest)
    return manifest


def _verify_sources(bundle) -> None:
    """Check every file's sha256 but the engines', which are about to be rebuilt (a missing or
    stale plan is a reason to build, not an error)."""
    plans = {m.trt["plan"] for m in bundle.manifest.models.values() if m.trt}
    files = {name: sha for name, sha in bundle.manifest.files.items() if name not in plans}
    try:
        verify_files(bundle.path, files, sizes={n: s for n, s in bundle.manifest.sizes.items() if n in files})
    except BundleError as e:
        raise ExportError(str(e)) from None


def _write_atomic(path: Path, data) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)  # TensorRT's IHostMemory has the buffer protocol
    os.replace(tmp, path)


__all__ = ["MIN_TENSORRT", "add_argmax_output", "build_engines", "build_profiles", "default_timing_cache", "every_row", "plan_file",
           "profile_shapes"]
