"""specdeploy export: source model -> graph -> ONNX -> bundle (heavy dependencies).

Each step is a function of its own: `load_source`, `SpecGraph`, `export_onnx`,
`check_parity`, `build_bundle`. Names load lazily, so the static TensorRT check
(`specdeploy.export.trt_ops`) runs without importing torch.
"""
from importlib import import_module

_NAMES = {
    "build_bundle": ".build",
    "parse_draft": ".drafts",
    "rebuild_graph": ".build",
    "source_graph": ".build",
    "Source": ".load",
    "embedded_default": ".load",
    "load_source": ".load",
}

__all__ = sorted(_NAMES)


def __getattr__(name):
    if name in _NAMES:
        return getattr(import_module(_NAMES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
