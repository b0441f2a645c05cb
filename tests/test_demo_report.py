"""The demo's speedup line states a speedup only where the alternating pairs show one that
speculation could have made (the docstring examples in runtime/tools/report.py cover a real
speedup and one above what the tokens per pass allow)."""
from specdeploy.runtime.decoding.stats import Stats
from specdeploy.runtime.tools.report import speedup_line


def run(seconds: float, passes: int = 11) -> Stats:
    s = Stats()
    s.new_tokens, s.seconds, s.first_token_seconds, s.first_round_tokens, s.target_passes = 33, seconds, 0.0, 1, passes
    return s


def test_pairs_on_both_sides_of_one_are_no_speedup():
    line = speedup_line([run(1.0)] * 3, [run(1.1), run(0.9), run(1.2)])
    assert line.startswith("speedup      none measurable") and "both sides of 1.0" in line


def test_every_pair_slower_is_a_slowdown():
    assert speedup_line([run(1.0)] * 3, [run(0.9), run(0.8), run(0.95)]).startswith("slowdown     0.90x decoding")


def test_too_few_pairs_tell_nothing():
    line = speedup_line([run(1.0)] * 2, [run(1.5), run(1.5)])
    assert "none measurable" in line and "at least 3 pairs" in line


def test_a_speedup_within_the_bound_is_stated():
    assert speedup_line([run(1.0)] * 3, [run(2.0), run(2.1), run(1.9)]).startswith("speedup      2.00x decoding")


def test_the_demo_races_a_chat_and_a_grounded_prompt_on_one_bundle(bundles):
    from click.testing import CliRunner

    from specdeploy.cli import main

    out = CliRunner().invoke(main, ["demo", "--out", str(bundles("llama-ngram")), "--draft", "ngram", "--dtype", "fp32",
                                    "--max-new-tokens", "12", "--repeats", "3", "--prompt", "Tell me about the sea.",
                                    "--grounded-prompt", "Repeat: the cat sat on the mat."])
    assert out.exit_code == 0, out.output
    assert "[chat] > Tell me about the sea." in out.output and "[grounded] > Repeat: the cat" in out.output
    assert out.output.count("identical    yes: token for token, every run") == 2
    assert out.output.count("median of 3 alternating pairs") == 2
    skipped = CliRunner().invoke(main, ["demo", "--out", str(bundles("llama-ngram")), "--draft", "ngram", "--dtype",
                                        "fp32", "--max-new-tokens", "120", "--repeats", "1", "--prompt", "Hi."])
    assert skipped.exit_code == 0 and "[grounded]" in skipped.output and "skipped: its" in skipped.output
