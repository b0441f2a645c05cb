"""Static check of a bundle's graphs against TensorRT's ONNX parser (runs everywhere).

The parser's published operator support table (onnx-tensorrt `docs/operators.md`) lives
beside this file as data, `trt_onnx_ops.json`, with the TensorRT version it describes and
where it came from. `check_graph` lists every node whose operator, data type or attribute
the parser does not take; our own graphs must come back clean, including the in-place KV
write (TensorScatter, lowered to TensorRT's KV-cache update layer) and the attention
pattern. Nothing here imports TensorRT: CI runs it. `check_bundle(DIR)` returning [] is
what `specdeploy check-trt DIR` reports as a pass.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

TABLE_FILE = Path(__file__).with_name("trt_onnx_ops.json")
ONNX_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class Problem:
    """One node TensorRT's ONNX parser would refuse, and why."""

    node: str
    op_type: str
    reason: str
    graph: str = ""  # file name, for a bundle's report

    def __str__(self) -> str:
        where = f"{self.graph}: " if self.graph else ""
        return f"{where}node {self.node!r} ({self.op_type}): {self.reason}"


@dataclass(frozen=True)
class OpTable:
    """The parser's support table: operator -> {supported, types, restrictions}."""

    tensorrt_version: str
    opset_min: int
    opset_max: int
    source: dict
    operators: dict
    kv_cache_update: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path = TABLE_FILE) -> "OpTable":
        doc = json.loads(Path(path).read_text())
        return cls(
            tensorrt_version=doc["tensorrt_version"],
            opset_min=doc["opset_min"],
            opset_max=doc["opset_max"],
            source=doc["source"],
            operators=doc["operators"],
            kv_cache_update=doc.get("kv_cache_update", {}),
        )

    @property
    def label(self) -> str:
        return f"TensorRT {self.tensorrt_version}'s ONNX parser"


@lru_cache(maxsize=None)
def load_table(path: str | Path = TABLE_FILE) -> OpTable:
    return OpTable.load(path)


# ONNX TensorProto element types under the names the support table uses.
_TYPE_NAMES = {
    1: "FP32", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16", 6: "INT32", 7: "INT64", 8: "STRING",
    9: "BOOL", 10: "FP16", 11: "DOUBLE", 12: "UINT32", 13: "UINT64", 14: "COMPLEX64", 15: "COMPLEX128",
    16: "BF16", 17: "FP8", 18: "FP8", 19: "FP8", 20: "FP8", 21: "UINT4", 22: "INT4", 23: "FP4",
}


class _Facts:
    """What the graph itself says about its tensors: element type, shape, constness."""

    def __init__(self, graph, outer: "_Facts | None" = None):
        self.dtype: dict[str, str] = dict(outer.dtype) if outer else {}
        self.shape: dict[str, list] = dict(outer.shape) if outer else {}
        self.constants: dict[str, object] = dict(outer.constants) if outer else {}  # name -> TensorProto or None
        self.graph_inputs = {v.name for v in graph.input}
        self.graph_outputs = {v.name for v in graph.output}
        self.producer: dict[str, str] = {}
        for v in list(graph.input) + list(graph.output) + list(graph.value_info):
            t = v.type.tensor_type
            if t.elem_type:
                self.dtype[v.name] = _TYPE_NAMES.get(t.elem_type, str(t.elem_type))
            if t.HasField("shape"):
                self.shape[v.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
        for init in graph.initializer:
            self.dtype[init.name] = _TYPE_NAMES.get(init.data_type, str(init.data_type))
            self.shape[init.name] = list(init.dims)
            self.constants[init.name] = init
        for node in graph.node:
            for out in node.output:
                self.producer[out] = node.name or node.op_type
            if node.op_type == "Constant" and node.domain in ONNX_DOMAINS and node.output:
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                self.constants[node.output[0]] = value

    def rank(self, name: str) -> int | None:
        shape = self.shape.get(name)
        return None if shape is None else len(shape)

    def is_constant(self, name: str) -> bool:
        return name in self.constants

    def value(self, name: str):
        """The numpy value of a constant input, or None when unknown."""
        from onnx import numpy_helper

        proto = self.constants.get(name)
        return None if proto is None else numpy_helper.to_array(proto)


def _attr(node, name: str, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


def _present(names, i: int) -> bool:
    return len(names) > i and bool(names[i])


# -- rules for the restrictions that matter for our graphs (and for the graphs people try next) --------
# Each returns the reasons the node breaks its operator's documented restriction, [] when it does not.

def _tensor_scatter(node, facts: _Facts) -> list[str]:
    """Table: `past_cache` and `update` must be 4D, `axis` must be -2. KV-cache update layer
    (TensorRT docs, operator KVCacheUpdate; NvInfer.h addKVCacheUpdate): the cache is a network
    input with a static sequence length, the output a network output sharing the cache's memory,
    LINEAR mode only, cache and update of one data type, int32/int64 write indices."""
    reasons = []
    cache, update = node.input[0], node.input[1] if len(node.input) > 1 else ""
    for role, name in (("past_cache", cache), ("update", update)):
        r = facts.rank(name)
        if r is not None and r != 4:
            reasons.append(f"`{role}` ({name}) is {r}-D; it must be 4D")
    axis = _attr(node, "axis", -2)
    if axis != -2:
        reasons.append(f"`axis` is {axis}; it must be -2")
    mode = _attr(node, "mode", "linear")
    if mode != "linear":
        reasons.append(f"mode {mode!r}: the KV-cache update layer supports only LINEAR (mode 'linear')")
    if cache not in facts.graph_inputs:
        reasons.append(
            f"`past_cache` ({cache}) is produced by node {facts.producer.get(cache, '?')!r}; "
            "the KV-cache update layer needs the cache to be a network input"
        )
    elif facts.rank(cache) == 4 and not isinstance(facts.shape[cache][2], int):
        reasons.append(f"`past_cache` ({cache}) has a dynamic sequence dimension; it must be static")
    if node.output and node.output[0] not in facts.graph_outputs:
        reasons.append(
            f"output {node.output[0]} is not a graph output; the KV-cache update layer's output must be a "
            "network output aliasing the cache input"
        )
    cache_type, update_type = facts.dtype.get(cache), facts.dtype.get(update)
    if cache_type and update_type and cache_type != update_type:
        reasons.append(f"`past_cache` is {cache_type} but `update` is {update_type}; they must have one data type")
    if _present(node.input, 2) and facts.dtype.get(node.input[2], "INT64") not in ("INT32", "INT64"):
        reasons.append(f"`write_indices` is {facts.dtype[node.input[2]]}; it must be INT32 or INT64")
    return reasons


def _constant_input(index: int, what: str, rule: str) -> Callable:
    def check(node, facts: _Facts) -> list[str]:
        if _present(node.input, index) and not facts.is_constant(node.input[index]):
            return [f"`{what}` ({node.input[index]}) is computed at run time; {rule}"]
        return []

    return check


def _topk(node, facts: _Facts) -> list[str]:
    reasons = [] if _attr(node, "sorted", 1) == 1 else ["`sorted` must be 1"]
    k = facts.value(node.input[1]) if _present(node.input, 1) else None
    if k is not None and int(k.reshape(-1)[0]) >= 3840:
        reasons.append(f"`K` is {int(k.reshape(-1)[0])}; it must be less than 3840")
    return reasons


def _dropout(node, facts: _Facts) -> list[str]:
    if not _present(node.input, 2):
        return []
    value = facts.value(node.input[2])
    if value is None or bool(value.reshape(-1)[0]):
        return ["`is_training` must be an initializer and evaluate to False"]
    return []


def _zero_point(index: int, what: str) -> Callable:
    def check(node, facts: _Facts) -> list[str]:
        if not _present(node.input, index):
            return []
        value = facts.value(node.input[index])
        if value is None or value.astype("float64").any():
            return [f"`{what}` must be zero (a constant of zeros)"]
        return []

    return check


def _unsupported_attrs(*names: str) -> Callable:
    def check(node, facts: _Facts) -> list[str]:
        return [f"attribute `{a.name}` is unsupported" for a in node.attribute if a.name in names]

    return check


def _only_first_output(node, facts: _Facts) -> list[str]:
    extra = [o for o in node.output[1:] if o]
    return [f"only the first output is supported; {', '.join(extra)} is used"] if extra else []


def _attention(node, facts: _Facts) -> list[str]:
    reasons = []
    for i, what in ((4, "past_key"), (5, "past_value"), (6, "nonpad_kv_seqlen")):
        if _present(node.input, i):
            reasons.append(f"input `{what}` is unsupported")
    for i, what in ((1, "present_key"), (2, "present_value"), (3, "qk_matmul_output")):
        if _present(node.output, i):
            reasons.append(f"output `{what}` is unsupported")
    for name in ("qk_matmul_output_mode", "softcap"):
        if _attr(node, name, 0):
            reasons.append(f"attribute `{name}` is unsupported")
    for i, what in ((0, "Q"), (1, "K"), (2, "V"), (3, "attn_mask")):
        r = facts.rank(node.input[i]) if _present(node.input, i) else None
        if r is not None and r != 4:
            reasons.append(f"`{what}` is {r}-D; it must be 4D")
    return reasons


def _dilations_ones(node, facts: _Facts) -> list[str]:
    d = _attr(node, "dilations", [])
    return [] if all(x == 1 for x in d) else [f"`dilations` {list(d)} must be empty or all ones"]


def _max_pool(node, facts: _Facts) -> list[str]:
    reasons = _dilations_ones(node, facts)
    if _present(node.output, 1):
        reasons.append("the `Indices` output is unsupported")
    return reasons


def _lstm(node, facts: _Facts) -> list[str]:
    return [f"`{a}` attribute must be 0" for a in ("input_forget", "layout") if _attr(node, a, 0) != 0]


def _scatter_nd(node, facts: _Facts) -> list[str]:
    r = _attr(node, "reduction", "none")
    return [] if r == "none" else [f"`reduction` {r!r}: only 'none' is supported"]


def _rotary(node, facts: _Facts) -> list[str]:
    if _present(node.input, 3) and facts.dtype.get(node.input[3], "INT64") != "INT64":
        return [f"`position_ids` is {facts.dtype[node.input[3]]}; it must be INT64"]
    return []


_AXES_INIT = "TensorRT's parser needs it as an initializer (or a Constant node)"
_BUILD_CONST = "TensorRT's parser needs a build-time constant"
RULES: dict[str, Callable] = {
    "TensorScatter": _tensor_scatter,
    **{op: _constant_input(1, "axes", _AXES_INIT) for op in (
        "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
        "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare")},
    "Squeeze": _constant_input(1, "axes", "TensorRT's parser needs it resolvable to a constant"),
    "Unsqueeze": _constant_input(1, "axes", "TensorRT's parser needs it resolvable to a constant"),
    "CumSum": _constant_input(1, "axis", _BUILD_CONST),
    "OneHot": _constant_input(1, "depth", _BUILD_CONST),
    "TopK": _topk,
    "Dropout": _dropout,
    "DequantizeLinear": _zero_point(2, "x_zero_point"),
    "QuantizeLinear": _zero_point(2, "y_zero_point"),
    "Constant": _unsupported_attrs("sparse_value", "value_string", "value_strings"),
    "LayerNormalization": _only_first_output,
    "Attention": _attention,
    "AveragePool": _dilations_ones,
    "LpPool": _dilations_ones,
    "MaxPool": _max_pool,
    "LSTM": _lstm,
    "ScatterND": _scatter_nd,
    "RotaryEmbedding": _rotary,
}
# The operand whose element type the table's "Supported Types" column constrains.
_TYPED_OUTPUT = {"Cast", "CastLike", "Constant", "ConstantOfShape"}


def _type_reason(node, facts: _Facts, types: list[str]) -> str | None:
    if not types:
        return None
    if node.op_type in _TYPED_OUTPUT:
        name = node.output[0] if node.output else ""
    else:
        name = node.input[0] if node.input else ""
    dtype = facts.dtype.get(name)
    if dtype is None or dtype in types:
        return None
    if dtype == "DOUBLE" and "FP32" in types:
        return None  # the parser casts DOUBLE down to FLOAT (table notes)
    return f"{name} is {dtype}; the parser takes {node.op_type} in {', '.join(types)} only"


def _nodes(graph, facts: _Facts) -> Iterator[tuple[object, _Facts]]:
    """Every node, subgraphs (If / Loop / Scan bodies) included, with the facts of its scope."""
    for node in graph.node:
        yield node, facts
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _nodes(sub, _Facts(sub, facts))


def _check_model(model, table: OpTable, where: str = "") -> tuple[list[Problem], dict[str, str]]:
    """Problems, and the in-place KV writes found: {output: cache input} of every TensorScatter."""
    problems: list[Problem] = []
    opset = next((o.version for o in model.opset_import if o.domain in ONNX_DOMAINS), None)
    if opset is not None and not table.opset_min <= opset <= table.opset_max:
        problems.append(Problem(
            "(model)", "opset", f"default-domain opset {opset} is outside {table.label}'s range "
            f"{table.opset_min}..{table.opset_max}", where,
        ))
    local = {(f.domain, f.name) for f in model.functions}
    scopes = [(model.graph, _Facts(model.graph))] + [(f, _Facts(_FunctionAsGraph(f))) for f in model.functions]
    writes: dict[str, str] = {}
    for graph, facts in scopes:
        for node, scope in _nodes(graph, facts):
            name = node.name or f"<unnamed {node.op_type}>"
            for reason in _node_reasons(node, scope, table, local):
                problems.append(Problem(name, node.op_type, reason, where))
            if node.op_type == "TensorScatter" and node.domain in ONNX_DOMAINS and node.output:
                writes[node.output[0]] = node.input[0]
    return problems, writes


def _node_reasons(node, facts: _Facts, table: OpTable, local: set) -> list[str]:
    if (node.domain, node.op_type) in local:
        return []  # a model-local function: the parser expands it, its body is checked
    if node.domain not in ONNX_DOMAINS:
        return [f"domain {node.domain!r} is not ONNX's; {table.label} takes standard ONNX operators (and registered plugins)"]
    entry = table.operators.get(node.op_type)
    if entry is None:
        return [f"{node.op_type} is not in {table.label}'s support table"]
    if not entry["supported"]:
        note = f" ({entry['restrictions']})" if entry["restrictions"] else ""
        return [f"{node.op_type} is not supported by {table.label}{note}"]
    reasons = []
    type_reason = _type_reason(node, facts, entry["types"])
    if type_reason:
        reasons.append(type_reason)
    rule = RULES.get(node.op_type)
    if rule is not None:
        reasons += rule(node, facts)
    return reasons


class _FunctionAsGraph:
    """A model-local function seen as a graph: its formal inputs/outputs carry no types."""

    def __init__(self, function):
        self.node = function.node
        self.input, self.output, self.value_info, self.initializer = [], [], list(function.value_info), []


def _load(onnx_path: str | Path):
    import onnx

    # Weights stored beside the graph are never read: the check needs the graph only.
    return onnx.load(str(onnx_path), load_external_data=False)


def check_graph(onnx_path: str | Path, table: OpTable | None = None) -> list[Problem]:
    """Every node of the ONNX file at `onnx_path` that TensorRT's ONNX parser would refuse."""
    table = table or load_table()
    path = Path(onnx_path)
    return _check_model(_load(path), table, path.name)[0]


def check_bundle(bundle_dir: str | Path, table: OpTable | None = None) -> list[Problem]:
    """`check_graph` over every graph in the bundle's manifest, plus the KV contract TensorRT
    relies on: each manifest alias (present_* -> past_*) is a TensorScatter writing that very
    input, so `engine.get_aliased_input_tensor` will name the buffer the runtime binds to both."""
    from specdeploy.core.manifest import load_bundle

    table = table or load_table()
    bundle = load_bundle(bundle_dir, verify=False)
    problems: list[Problem] = []
    for role, entry in bundle.manifest.models.items():
        path = bundle.file(entry.graph)
        found, writes = _check_model(_load(path), table, path.name)
        problems += found
        for output, cache in entry.kv_aliases.items():
            if writes.get(output) != cache:
                got = f"TensorScatter writes {writes[output]!r}" if output in writes else "no TensorScatter produces it"
                problems.append(Problem(
                    output, "TensorScatter",
                    f"the manifest binds {output} in place over {cache}, but {got}: TensorRT would not alias them",
                    path.name,
                ))
    return problems


__all__ = ["OpTable", "Problem", "RULES", "TABLE_FILE", "check_bundle", "check_graph", "load_table"]
