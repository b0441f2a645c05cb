"""Ordinary mistakes on the command line are one line before any work: nothing runs for minutes
and then fails on an output path, and no option takes a value outside its range."""
import socket

import pytest
from click.testing import CliRunner

from specdeploy.cli import main


def one_line(result, *fragments, code=1):
    assert result.exit_code == code, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    error = [line for line in result.output.splitlines() if line.startswith(("error: ", "Error: "))]
    assert len(error) == 1, result.output
    for fragment in fragments:
        assert fragment in error[0], error[0]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("hello\n")
    return path


def test_eval_and_bench_check_their_output_files_before_the_run(tmp_path, prompts):
    missing = tmp_path / "missing" / "x.json"
    one_line(CliRunner().invoke(main, ["eval", str(tmp_path / "no-bundle"), "--prompts", str(prompts), "--json",
                                       str(missing)]), f"--json {missing}: no folder")
    one_line(CliRunner().invoke(main, ["bench", str(tmp_path / "no-bundle"), "--json", str(missing)]), "no folder")
    one_line(CliRunner().invoke(main, ["bench", str(tmp_path / "no-bundle"), "--plot", str(tmp_path)]), "is a folder")


def test_prompts_that_are_not_utf8_are_one_line(tmp_path):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"caf\xe9\n")
    one_line(CliRunner().invoke(main, ["eval", str(tmp_path / "no-bundle"), "--prompts", str(bad)]),
             "not UTF-8 text (byte 3)")


@pytest.mark.parametrize("args, option", [
    (["bench", "B", "--repeats", "0"], "--repeats"),
    (["serve", "B", "--port", "99999"], "--port"),
    (["generate", "B", "--prompt", "x", "--threads", "2000"], "--threads"),
    (["generate", "B", "--prompt", "x", "--threads", "-1"], "--threads"),
    (["eval", "B", "--prompts", "p", "--alpha", "0"], "--alpha"),
    (["eval", "B", "--prompts", "p", "--alpha", "2"], "--alpha"),
    (["export", "--target", "t", "--out", "o", "--prefill-chunk", "0"], "--prefill-chunk"),
])
def test_values_outside_their_range_are_refused_by_the_option(args, option):
    one_line(CliRunner().invoke(main, args), option, code=2)


def test_a_port_in_use_is_one_line_before_the_bundle_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line(CliRunner().invoke(main, ["serve", str(tmp_path / "no-bundle"), "--port", str(port)]),
                 f"--port {port}: cannot listen there")
