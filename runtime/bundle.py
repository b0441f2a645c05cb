"""The bundle: the contract between export and runtime (DESIGN.md section 2).

A folder with `manifest.json`, one ONNX graph per model and the tokenizer. The manifest
records everything the runtime needs, so no build flag is ever repeated at run time.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BundleError

FORMAT = "specdeploy-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class ModelSpec:
    """One graph of the bundle and the numbers needed to drive it."""

    role: str  # "target" or "draft"
    graph: str  # file name inside the bundle
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: str  # numpy dtype name of the KV buffers
    sliding_window: int | None

    @classmethod
    def from_manifest(cls, role: str, entry: dict[str, Any]) -> "ModelSpec":
        return cls(
            role=role,
            graph=entry["graph"],
            num_layers=entry["num_layers"],
            num_kv_heads=entry["num_kv_heads"],
            head_dim=entry["head_dim"],
            vocab_size=entry["vocab_size"],
            kv_dtype=entry["kv_dtype"],
            sliding_window=entry.get("sliding_window"),
        )

    @property
    def kv_names(self) -> list[tuple[str, str]]:
        """(input, output) names of the KV buffers, in layer order: key then value."""
        return [
            (f"past_{kind}_{i}", f"present_{kind}_{i}")
            for i in range(self.num_layers)
            for kind in ("key", "value")
        ]


@dataclass(frozen=True)
class Bundle:
    path: Path
    manifest: dict[str, Any]

    @property
    def max_seq(self) -> int:
        return self.manifest["max_seq"]

    @property
    def max_draft(self) -> int:
        return self.manifest["max_draft"]

    @property
    def prefill_chunk(self) -> int:
        return self.manifest["prefill_chunk"]

    @property
    def draft_kind(self) -> str:
        return self.manifest["draft"]["kind"]

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.manifest["tokenizer"]

    def model(self, role: str) -> ModelSpec | None:
        entry = self.manifest["models"].get(role)
        return None if entry is None else ModelSpec.from_manifest(role, entry)

    def file(self, name: str) -> Path:
        return self.path / name


def load_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Read and check a bundle: format version, and (by default) the sha256 of every file."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise BundleError(f"{path}: no such bundle folder")
    if not manifest_path.is_file():
        raise BundleError(f"{manifest_path}: missing; {path} is not a specdeploy bundle (run `specdeploy export`)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{manifest_path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{manifest_path}: not a specdeploy manifest (no \"format\": \"{FORMAT}\")")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise BundleError(
            f"{manifest_path}: format version {version!r} is not supported "
            f"(this specdeploy reads version {FORMAT_VERSION}); re-export the bundle"
        )
    bundle = Bundle(path, manifest)
    if verify:
        verify_files(bundle)
    return bundle


def verify_files(bundle: Bundle) -> None:
    for name, expected in bundle.manifest["files"].items():
        f = bundle.path / name
        if not f.is_file():
            raise BundleError(f"bundle file {f} is missing; re-export the bundle")
        actual = sha256_file(f)
        if actual != expected:
            raise BundleError(
                f"bundle file {f} failed its checksum (sha256 {actual[:12]}..., manifest says {expected[:12]}...): "
                "it was altered after export; re-export the bundle"
            )
