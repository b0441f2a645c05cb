"""A property-based fuzzer over the Python API's and the CLI's arguments: whatever values and
types are thrown at `Session.stream` or `specdeploy generate`, the answer is a generation or a
one-line InputError, never another exception; and the session is free afterwards."""
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdeploy.cli import main
from specdeploy.runtime import InputError, Session

ANY = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True) \
    | st.text(max_size=8) | st.lists(st.integers(-5, 400), max_size=4) | st.just("auto")
FIELDS = ["max_new_tokens", "draft_len", "speculate", "temperature", "top_k", "top_p", "seed", "stop", "tree_nodes",
          "private", "chat", "prompt_ids"]


@pytest.fixture(scope="module")
def session(bundles):
    return Session(bundles("llama-suffix"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kwargs=st.dictionaries(st.sampled_from(FIELDS), ANY, max_size=4), text=st.text(max_size=20) | st.none())
def test_stream_arguments_generate_or_fail_in_one_line(session, kwargs, text):
    kwargs = {"max_new_tokens": 3, **kwargs}
    prompt = None if "prompt_ids" in kwargs else (text or "hi")
    try:
        session.generate(prompt, **kwargs)
    except InputError as e:
        assert str(e) and "\n" not in str(e), str(e)
    assert len(session.generate(prompt_ids=[1, 2, 3], max_new_tokens=2).token_ids) == 2  # never left busy


OPTIONS = {"--max-new-tokens": st.integers(-3, 200).map(str) | st.text(max_size=4),
           "--draft-len": st.sampled_from(["auto", "0", "1", "9", "-1", "x", "99999999999999999999"]),
           "--temperature": st.sampled_from(["0", "0.5", "-1", "3", "nan", "inf", "x"]),
           "--top-k": st.integers(-2, 10**6).map(str), "--top-p": st.sampled_from(["0", "0.5", "1", "1.5", "nan"]),
           "--seed": st.integers(-(2**65), 2**65).map(str), "--stop": st.text(max_size=3),
           "--tree-nodes": st.sampled_from(["auto", "1", "2", "0", "10000"]),
           "--threads": st.integers(-1, 3000).map(str), "--prompt-ids": st.sampled_from(["1,2", "1.5", "", "x", "-1",
                                                                                       "999999"])}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chosen=st.dictionaries(st.sampled_from(sorted(OPTIONS)), st.none(), max_size=4), data=st.data())
def test_generate_options_run_or_fail_in_one_line(bundles, chosen, data):
    args = ["generate", str(bundles("llama-suffix"))]
    for option in chosen:
        args += [option, data.draw(OPTIONS[option])]
    if "--prompt-ids" not in chosen:
        args += ["--prompt", "hi"]
    if "--max-new-tokens" not in chosen:
        args += ["--max-new-tokens", "3"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code in (0, 1, 2), (args, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, repr(result.exception))
    if result.exit_code:
        errors = [line for line in result.output.splitlines() if line.startswith(("error: ", "Error: "))]
        assert len(errors) == 1, (args, result.output)
