"""Export never loses a user's files: it writes only into a missing or empty folder or a bundle
it recognises by its manifest's format field, never the folder it runs in, and every way out of
an export (a failure, SIGTERM; SIGKILL at the next export) removes its work folder."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from specdeploy.cli import main
from specdeploy.core.errors import ExportError
from specdeploy.export import build_bundle
from specdeploy.export.build import atomic_folder, check_out, is_bundle


def user_folder(path):
    """A browser extension: a manifest.json that is not ours, and code beside it."""
    (path / "src").mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"manifest_version": 3, "name": "mine"}))
    (path / "background.js").write_text("chrome.runtime.onInstalled.addListener(() => {});\n")
    (path / "src" / "app.js").write_text("console.log('hi');\n")
    return sorted(p.relative_to(path) for p in path.rglob("*"))


def test_a_folder_with_someone_elses_manifest_is_refused_and_kept(tmp_path):
    out = tmp_path / "ext"
    before = user_folder(out)
    with pytest.raises(ExportError, match=r"^--out .*ext: exists, is not empty and is not a specdeploy bundle"):
        build_bundle(tmp_path / "no-such-model", "ngram", out)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    result = CliRunner().invoke(main, ["export", "--target", str(tmp_path / "no-such-model"), "--out", str(out)])
    assert result.exit_code == 1 and "is not a specdeploy bundle" in result.output and "Traceback" not in result.output
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_the_folder_it_runs_in_is_never_replaced(tmp_path, monkeypatch):
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps({"format": "specdeploy-bundle"}))
    (bundle / "notes.txt").write_text("mine")
    monkeypatch.chdir(bundle)
    for out in (".", "..", str(bundle)):
        with pytest.raises(ExportError, match=r"the folder this export runs in \(or one above it\)"):
            check_out(type(bundle)(out))
    assert (bundle / "notes.txt").read_text() == "mine"


def test_a_file_or_a_folder_under_a_file_is_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ExportError, match=r": is a file; choose a folder$"):
        check_out(tmp_path / "f")
    with pytest.raises(ExportError, match=r": lies under the file .*f; choose a folder$"):
        check_out(tmp_path / "f" / "b")


def test_only_a_manifest_of_ours_makes_a_bundle(tmp_path):
    for text, ours in [('{"format": "specdeploy-bundle"}', True), ('{"format": "other"}', False), ("[1]", False),
                       ("not json", False), ("[" * 100_000, False)]:
        (tmp_path / "manifest.json").write_text(text)
        assert is_bundle(tmp_path) is ours, text[:20]


@pytest.mark.parametrize("chunk", [0, -4, 10**6])
def test_a_prefill_chunk_out_of_range_stops_before_any_work(tmp_path, chunk):
    with pytest.raises(ExportError, match=rf"^--prefill-chunk {chunk}: expected 1\.\.2048 \(--max-seq\)$"):
        build_bundle(tmp_path / "no-such-model", "ngram", tmp_path / "out", max_seq=2048, prefill_chunk=chunk)
    assert not (tmp_path / "out").exists()


def test_a_killed_exports_work_folder_goes_at_the_next_export_and_nothing_else(tmp_path):
    out = tmp_path / "b"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = tmp_path / f".b.export-{dead.stdout.strip()}-abcd1234"
    abandoned.mkdir()
    (abandoned / "target.onnx").write_bytes(b"\0" * 1000)
    unrelated = tmp_path / ".b.notes"  # not a name export gives its work folders
    unrelated.mkdir()
    alive = tmp_path / f".b.export-{os.getpid()}-abcd1234"  # an export still running (here: this process)
    alive.mkdir()
    seen = []
    with atomic_folder(out, seen.append) as work:
        (work / "manifest.json").write_text("{}")
    assert not abandoned.exists() and unrelated.is_dir() and alive.is_dir() and (out / "manifest.json").is_file()
    assert seen == [f"removed {abandoned}: the work folder of an export that was killed"]


SIGTERM_CHILD = """
import sys, time
from pathlib import Path
from specdeploy.export.build import atomic_folder
out = Path(sys.argv[1])
with atomic_folder(out) as work:
    (work / "started").write_text("1")
    time.sleep(60)
"""


def test_sigterm_removes_the_work_folder(tmp_path):
    out = tmp_path / "b"
    child = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, str(out)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".b.*/started")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob(".b.*/started")), "the child never started its work folder"
    os.kill(child.pid, signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode != 0 and "export stopped by SIGTERM" in err
    assert list(tmp_path.iterdir()) == []
