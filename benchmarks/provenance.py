"""Where a benchmark's figures came from, written into every JSON a script here saves.

    from benchmarks.provenance import provenance
    report["provenance"] = provenance()

command (sys.argv), date (UTC, ISO 8601), commit of this checkout ("-dirty" when tracked files
differ from it; "unknown" outside a git checkout) and machine (platform, CPU model, logical
cores, onnxruntime and numpy versions). One implementation: the one `specdeploy bench` uses.
"""
from __future__ import annotations

from pathlib import Path

from specdeploy.runtime.tools.bench.report import provenance as _package_provenance

CHECKOUT = Path(__file__).resolve().parent.parent  # the checkout that holds benchmarks/


def provenance() -> dict:
    """command, date, commit and machine of this run (see the module docstring)."""
    return _package_provenance(CHECKOUT)
