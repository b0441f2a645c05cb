"""specdeploy export: source model -> graph -> ONNX -> bundle (heavy dependencies).

Each step is a function of its own: `load_source`, `SpecGraph`, `export_onnx`,
`check_parity`, `build_bundle`.
"""
from .build import build_bundle, parse_draft
from .load import Source, embedded_default, load_source

__all__ = ["Source", "build_bundle", "embedded_default", "load_source", "parse_draft"]
