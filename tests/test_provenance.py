"""Every saved benchmark report says where it came from: command, date, commit and machine
(benchmarks/provenance.py for the scripts, `write_json` for `specdeploy bench`: one function)."""
import json
import shlex
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from benchmarks.provenance import CHECKOUT, provenance
from specdeploy.runtime.tools.bench.report import provenance as package_provenance, write_json

MACHINE = {"platform", "cpu", "logical_cores", "onnxruntime", "numpy"}


def _check(p: dict) -> None:
    assert set(p) == {"command", "date", "commit", "machine"}
    assert p["command"] == shlex.join(sys.argv)
    assert datetime.fromisoformat(p["date"]).utcoffset().total_seconds() == 0
    assert set(p["machine"]) == MACHINE
    assert p["machine"]["logical_cores"] >= 1 and p["machine"]["cpu"]


def test_provenance_fields_and_commit():
    p = provenance()
    _check(p)
    head = subprocess.run(["git", "-C", str(CHECKOUT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert p["commit"] in (head.stdout.strip(), head.stdout.strip() + "-dirty")
    else:
        assert p["commit"] == "unknown"


def test_outside_a_checkout_the_commit_is_unknown(tmp_path):
    assert package_provenance(tmp_path)["commit"] == "unknown"


def test_bench_json_carries_provenance(tmp_path):
    report = {"bundle": "engines/x", "plain": {"tokens_per_second": 1.0}, "configs": [{"draft_len": 1}]}
    write_json(report, tmp_path / "bench.json")
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["configs"] == [{"draft_len": 1}] and "provenance" not in report
    _check(saved["provenance"])
