"""The docstring examples (`>>>`) run: every module of the package whose source has one is
doctested, found by walking the packages, so a new or split module is covered without a list.

A module that cannot be imported fails its test (modules needing optional packages, such as
tensorrt, import them lazily and must still import without them)."""
import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

PACKAGES = ("specdeploy.core", "specdeploy.export", "specdeploy.runtime", "specdeploy.cli")


def _package_dir(name: str) -> Path:
    """The folder of a top-level package, without importing it (its __init__ may be heavy)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not an importable package"
    return Path(list(spec.submodule_search_locations)[0])


def _walk(folder: Path, prefix: str):
    """(module name, source file) of every module under `folder`, subpackages included,
    found by pkgutil without importing anything."""
    for info in pkgutil.iter_modules([str(folder)]):
        name = f"{prefix}.{info.name}"
        if info.ispkg:
            yield name, folder / info.name / "__init__.py"
            yield from _walk(folder / info.name, name)
        else:
            yield name, folder / f"{info.name}.py"


def modules_with_examples() -> list[str]:
    found = []
    for package in PACKAGES:
        folder = _package_dir(package)
        for name, source in [(package, folder / "__init__.py"), *_walk(folder, package)]:
            if source.is_file() and ">>>" in source.read_text(encoding="utf-8"):
                found.append(name)
    return sorted(found)


MODULES = modules_with_examples()


def test_discovery_finds_the_known_examples():
    """The walk reaches every half and nested subpackages (a broken walk would pass vacuously)."""
    assert "specdeploy.core.analytic" in MODULES
    assert "specdeploy.runtime.decoding.sampling" in MODULES
    assert "specdeploy.runtime.decoding.drafters.ngram" in MODULES  # a subpackage's module
    assert any(m.startswith("specdeploy.export.") for m in MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)  # an ImportError here fails the test: no skipping
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(module, name):
        runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0, f"{name} has '>>>' in its source but no docstring example doctest runs"
    assert results.failed == 0, "".join(report)
