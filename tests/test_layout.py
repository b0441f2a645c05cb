"""Imports go one way: core <- export, core <- runtime, cli above both (docs/design.md, "Layout").

Read from the source with `ast`, so an import hidden inside a function counts too."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"core": "specdeploy.core", "export": "specdeploy.export", "runtime": "specdeploy.runtime", "cli": "specdeploy.cli"}
# The only crossings between the halves, each through a public name.
ALLOWED = {
    ("runtime/backends/torch_engine.py", "specdeploy.export"),  # the torch backend runs the export-stage module
    ("export/onnx_export.py", "specdeploy.runtime.backends.ort"),  # parity runs the graph on ONNX Runtime
    ("export/eagle3_export.py", "specdeploy.runtime.backends.ort"),  # and so does an EAGLE-3 head's
    ("export/assistant.py", "specdeploy.runtime.decoding.drafters.assistant"),  # and an assistant's, bound as it runs
    ("export/trt_build.py", "specdeploy.runtime.backends.cuda"),  # the GPU a TensorRT build is for
}


def _imports(path: Path, package: str) -> list[str]:
    """Every module `path` imports, relative imports resolved against its package."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                names.append(".".join(base + ([node.module] if node.module else [])))
            else:
                names.append(node.module)
    return names


def _modules():
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            is_package = path.name == "__init__.py"
            own = ".".join([package, *parts])
            yield path, (own if is_package else own.rsplit(".", 1)[0]), folder


MODULES = list(_modules())


@pytest.mark.parametrize("path,package,folder", MODULES, ids=[str(m[0].relative_to(ROOT)) for m in MODULES])
def test_imports_go_one_way(path, package, folder):
    rel = str(path.relative_to(ROOT))
    forbidden = {
        "core": ("specdeploy.export", "specdeploy.runtime", "specdeploy.cli"),
        "export": ("specdeploy.runtime", "specdeploy.cli"),
        "runtime": ("specdeploy.export", "specdeploy.cli"),
        "cli": (),
    }[folder]
    bad = [
        name for name in _imports(path, package)
        if name and name.startswith(forbidden) and not any(rel == f and name.startswith(m) for f, m in ALLOWED)
    ]
    assert not bad, f"{rel} imports {bad}"


def test_no_private_names_cross_the_halves():
    for path, package, folder in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdeploy."):
                other = node.module.split(".")[1]
                if other != folder and other != "core":
                    private = [a.name for a in node.names if a.name.startswith("_")]
                    assert not private, f"{path.relative_to(ROOT)} imports private {private} from {node.module}"


def test_every_package_is_installed():
    """A wheel (not an editable install) holds only the packages pyproject.toml lists: every
    folder with an __init__.py must be listed, mapped to its folder."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, dirs = set(config["packages"]), config["package-dir"]
    for folder, package in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            name = ".".join([package, *rel.parts])
            assert name in listed, f"{name} ({init.parent.relative_to(ROOT)}) is missing from pyproject.toml's packages"
            assert dirs.get(name) == str(init.parent.relative_to(ROOT)), f"{name}: package-dir does not map it"
