"""The one request schema (runtime/decoding/request.py): its rules, and the property that the
HTTP server, the Triton model and Session accept and refuse exactly the same requests.

No bundle: the limits are built directly, and Session is checked through `Session.stream` on a
stand-in whose `start` hands back the validated request."""
import json
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdeploy.runtime.decoding import request as schema
from specdeploy.runtime.decoding.request import (
    DEFAULTS, SETTINGS, WORDS, Limits, Message, Request, RequestError, check_setting, fit, validate, wire_labels,
)
from specdeploy.runtime.decoding.sampling import SamplingParams
from specdeploy.runtime.decoding.session import Session
from specdeploy.runtime.serving import server, triton, triton_io

LIMITS = Limits(max_seq=16, max_draft=4, max_chars=40, vocab=100, max_tree_nodes=8)
HTTP = wire_labels("prompt")


def refused(given, labels=WORDS, limits=LIMITS) -> RequestError:
    with pytest.raises(RequestError) as e:
        validate(given, limits, labels)
    assert "\n" not in str(e.value)
    return e.value


# -- the schema's rules ---------------------------------------------------------------------------

def test_defaults_are_those_of_a_request_that_gives_none():
    req = validate({"prompt": "hi"}, LIMITS)
    assert req == Request(prompt="hi")
    assert (req.max_new_tokens, req.temperature, req.top_p, req.top_k, req.seed, req.stop, req.draft_len,
            req.tree_nodes, req.private, req.speculate) == (None, 1.0, 1.0, 0, None, (), "auto", "auto", False, True)
    assert Limits(128, 8).max_chars == 128 * schema.CHARS_PER_TOKEN


@pytest.mark.parametrize("field, value, words, wire", [
    ("max_new_tokens", 0, "max new tokens 0 is outside [1, 16]", "'max_tokens' 0 is outside [1, 16]"),
    ("max_new_tokens", 10**30, "is outside [1, 16]", "'max_tokens' 10000000000000000000... is outside"),
    ("temperature", 2.5, "temperature 2.5 is outside [0, 2]", "'temperature' 2.5 is outside [0, 2]"),
    ("temperature", float("nan"), "temperature nan is outside [0, 2]", "'temperature' nan is outside"),
    ("temperature", 10**400, "temperature 1000000000", "'temperature' 1000000000"),
    ("top_p", 0, "top-p 0 is outside (0, 1]", "'top_p' 0 is outside (0, 1]"),
    ("top_k", -1, "top-k -1 must be >= 0 (0: off)", "'top_k' -1 must be >= 0"),
    ("seed", -1, "seed -1 is outside [0, 2**64)", "'seed' -1 is outside [0, 2**64)"),
    ("seed", 2**64, "seed 18446744073709551616 is outside", "'seed' 18446744073709551616"),
    ("stop", ["a", ""], "stop must be at most 4 non-empty strings", "'stop' must be at most 4 non-empty strings"),
    ("stop", ["a"] * 5, "stop must be at most 4", "'stop' must be at most 4"),
    ("stop", ["x" * 41], "stop strings are longer than 40 characters in all", "'stop' strings are longer than 40"),
    ("stop", ["a\ud800"], "stop is not valid Unicode text", "'stop' is not valid Unicode text"),
    ("draft_len", 5, "draft length 5 is outside [0, 4] (the bundle's max draft)", "'draft_len' 5 is outside [0, 4]"),
    ("draft_len", -1, "draft length -1 is outside", "'draft_len' -1 is outside"),
    ("tree_nodes", 0, "tree nodes 0 is outside [1, 8] (1: chains)", "'tree_nodes' 0 is outside [1, 8]"),
    ("max_new_tokens", True, "max new tokens must be an integer, got true", "'max_tokens' must be an integer"),
    ("temperature", "hot", "temperature must be a number", "'temperature' must be a number, got \"hot\""),
    ("draft_len", 2.0, "draft length must be an integer or 'auto'", "'draft_len' must be an integer or 'auto'"),
    ("draft_len", "x", "draft length must be an integer or 'auto'", "'draft_len' must be an integer or 'auto'"),
    ("private", 1, "private must be a boolean, got 1", "'private' must be a boolean"),
    ("stop", 5, "stop must be a string or an array of strings", "'stop' must be a string or an array"),
])
def test_each_setting_is_refused_by_its_rule_naming_it_in_each_vocabulary(field, value, words, wire):
    for labels, message in ((WORDS, words), (HTTP, wire)):
        e = refused({"prompt": "hi", field: value}, labels)
        assert e.field == field and message in str(e), (str(e), message)


def test_values_are_kept_in_the_schemas_types():
    req = validate({"prompt": "hi", "temperature": 1, "top_k": np.int32(3), "stop": "end", "seed": 2**64 - 1,
                    "draft_len": None, "tree_nodes": 1, "private": np.bool_(True), "max_new_tokens": 16}, LIMITS)
    assert (type(req.temperature), type(req.top_k), req.stop, req.draft_len) == (float, int, ("end",), "auto")
    assert (req.tree_nodes, req.private, req.seed) == (1, True, 2**64 - 1) and type(req.private) is bool


def test_the_prompt_forms():
    assert refused({}).field == "prompt"
    assert refused({"prompt": "a", "prompt_ids": [1]}).field == "prompt_ids"
    assert "has 41 characters; at most 40 can fit in the bundle's max sequence of 16 tokens" in str(
        refused({"prompt": "x" * 41}, HTTP))
    assert "'prompt' is not valid Unicode text (a lone surrogate at character 1)" in str(
        refused({"prompt": "a\udfff"}, HTTP))
    assert validate({"prompt_ids": [1, 99]}, LIMITS).prompt_ids == (1, 99)
    for ids, message in [([], "prompt is empty"), ([1, True], "must be an array of token ids"),
                         ([1] * 16, "prompt of 16 tokens is longer than the bundle's max sequence of 16 (at most 15"),
                         ([5, 100], "prompt: token id 100 at prompt position 1 is outside the vocabulary [0, 100)"),
                         ([3, 10**23], "prompt token ids must be integers in [0, the vocabulary size)"),
                         ([-3], "token id -3 at prompt position 0")]:
        e = refused({"prompt_ids": ids})
        assert e.field == "prompt_ids" and message in str(e), str(e)
    turns = (Message("system", "be brief"), Message("user", "hi"))
    assert validate({"messages": turns}, LIMITS).messages == turns
    assert "'messages' holds 16 turns; at most 15 fit" in str(refused({"messages": (Message("u", "x"),) * 16}, HTTP))
    assert "'messages' hold 41 characters" in str(refused({"messages": (Message("user", "x" * 37),)}, HTTP))
    assert refused({"messages": [{"role": "user", "content": "hi"}]}).field == "messages"  # Message pairs only
    with pytest.raises(TypeError, match="not fields of a request: max_tokens"):
        validate({"prompt": "hi", "max_tokens": 3}, LIMITS)  # the wire's name is the front end's to map


def test_fit_resolves_the_new_tokens_and_checks_the_length():
    chat = validate({"messages": (Message("user", "hi"),)}, LIMITS)
    assert fit(chat, [1] * 10, LIMITS).max_new_tokens == 6  # the chat default (256), capped to fit
    plain = fit(validate({"prompt": "hi"}, LIMITS), [1, 2], LIMITS)
    assert (plain.prompt, plain.prompt_ids, plain.max_new_tokens) == (None, (1, 2), 14)
    assert fit(validate({"prompt": "hi"}, Limits(128, 8)), [1] * 3, Limits(128, 8)).max_new_tokens == 16
    given = validate({"prompt": "hi", "max_new_tokens": 8}, LIMITS)
    for ids, field, message in [
        ([], "prompt", "'prompt' is empty: it gives no tokens"),
        ([1] * 16, "prompt", "'prompt' of 16 tokens is longer than the bundle's max sequence of 16"),
        ([1] * 9, "max_new_tokens", "'max_tokens': prompt of 9 tokens + 8 new tokens exceeds the bundle's max "
                                    "sequence of 16 (at most 7 new tokens fit)"),
    ]:
        with pytest.raises(RequestError) as e:
            fit(given, ids, LIMITS, HTTP)
        assert e.value.field == field and message in str(e.value)


def test_sampling_params_are_checked_by_the_same_rules():
    assert SamplingParams(0.7, top_k=4, top_p=0.9, seed=3).temperature == 0.7
    for kwargs, message in [({"temperature": 3.0}, "temperature 3.0 is outside [0, 2]"),
                            ({"top_p": 0}, "top-p 0 is outside (0, 1]"), ({"top_k": -2}, "top-k -2 must be >= 0"),
                            ({"seed": -1}, "seed -1 is outside [0, 2**64)")]:
        with pytest.raises(RequestError, match=re.escape(message)):
            SamplingParams(**{"temperature": 1.0, **kwargs})
    with pytest.raises(RequestError) as e:
        check_setting("top_p", 0.0, None, HTTP)
    assert str(e.value) == "'top_p' 0.0 is outside (0, 1]"


def test_every_wire_setting_is_a_triton_input_the_config_declares():
    inputs = {t.name: t for t in triton_io.INPUTS}
    for name, s in SETTINGS.items():
        if s.wire is None:
            assert name not in inputs
            continue
        assert inputs[s.wire].optional and inputs[s.wire].data_type == s.triton, name
    assert {"tree_nodes", "private"} <= set(inputs)
    text = triton.config_text("m", 1, 4, "ort", "bundle")
    for t in triton_io.INPUTS:
        assert f'name: "{t.name}" data_type: {t.data_type}' in text


# -- the three ways in accept and refuse the same requests ----------------------------------------

def via_server(case: dict, chat: bool = False):
    """The HTTP path: a JSON body with OpenAI's names, through server.parse_request."""
    body = {server.NAMES[k]: v for k, v in case.items() if k != "chat"}
    if chat:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    body = json.loads(json.dumps(body, allow_nan=True))  # what arrives: JSON's own types
    try:
        return server.parse_request(body, chat, LIMITS)[0]
    except server.BadRequest as e:
        return {v: k for k, v in server.NAMES.items() if k != "prompt_ids"}.get(e.param, e.param)


TRITON_TYPES = {"max_new_tokens": np.int32, "temperature": np.float64, "top_p": np.float64, "top_k": np.int32,
                "seed": np.uint64, "draft_len": np.int32, "tree_nodes": np.int32, "private": np.bool_, "chat": np.bool_}


def via_triton(case: dict):
    """The Triton path: the inputs as the model's tensors, through triton_io.parse_request."""
    inputs = {"text_input": np.array([case["prompt"].encode()], dtype=np.object_)}
    for k, v in case.items():
        if k == "prompt" or v is None or v == "auto":
            continue
        name = SETTINGS[k].wire if k in SETTINGS else k
        if k == "stop":
            stops = [v] if isinstance(v, str) else v
            inputs[name] = np.array([s.encode() for s in stops], dtype=np.object_).reshape(-1)
        else:
            inputs[name] = np.array([v], dtype=TRITON_TYPES[k])
    try:
        return triton_io.parse_request(inputs.get, LIMITS).request
    except RequestError as e:
        return e.field


def via_session(case: dict):
    """The library path: Session.stream's own arguments (every field given: its defaults are its
    own), stopped where the validated request would start."""
    stand_in = object.__new__(Session)
    stand_in.__dict__["limits"] = LIMITS
    stand_in.start = lambda req: req
    kwargs = {k: DEFAULTS[k] if case.get(k) is None else case[k] for k in SETTINGS}  # None: not given
    prompt = case.get("prompt")
    try:
        return Session.stream(stand_in, prompt, prompt_ids=case.get("prompt_ids"), chat=case.get("chat", False),
                              **kwargs)
    except RequestError as e:
        return e.field


text = st.text(st.characters(exclude_categories=["Cs"]), max_size=60)  # what UTF-8 (and so Triton) carries
triton_case = st.fixed_dictionaries({"prompt": text}, optional={
    "max_new_tokens": st.none() | st.integers(-3, 20) | st.integers(-(2**31), 2**31 - 1),
    "temperature": st.none() | st.floats(-1, 3) | st.sampled_from([0.0, 2.0, float("nan"), float("inf")]),
    "top_p": st.none() | st.floats(-0.5, 1.5) | st.sampled_from([0.0, 1.0, float("nan")]),
    "top_k": st.none() | st.integers(-3, 3) | st.integers(-(2**31), 2**31 - 1),
    "seed": st.none() | st.integers(0, 2**64 - 1),
    "stop": st.none() | text | st.lists(text, max_size=6),
    "draft_len": st.none() | st.just("auto") | st.integers(-2, 7),
    "tree_nodes": st.none() | st.just("auto") | st.integers(-2, 10),
    "private": st.none() | st.booleans(),
})


def _not_integer_text(s: str) -> bool:  # Session reads integers given as text (a command line's)
    try:
        int(s)
    except ValueError:
        return True
    return False


junk = st.booleans() | st.text(max_size=4).filter(_not_integer_text) | st.lists(st.integers(0, 3), max_size=2)
http_case = st.fixed_dictionaries({"prompt": text | st.lists(st.integers(-2, 110) | st.integers(-(2**70), 2**70),
                                                             min_size=1, max_size=18)}, optional={
    "max_new_tokens": st.none() | st.integers(-3, 20) | st.integers(-(2**70), 2**70) | junk,
    "temperature": st.none() | st.floats(allow_nan=True, allow_infinity=True) | st.integers(-3, 3)
    | st.integers(10**300, 10**400) | junk,
    "top_p": st.none() | st.floats(allow_nan=True) | st.integers(-1, 2) | junk,
    "top_k": st.none() | st.integers(-(2**70), 2**70) | junk,
    "seed": st.none() | st.integers(-(2**65), 2**65) | junk,
    "stop": st.none() | text | st.lists(text | st.integers(), max_size=6) | st.integers(),
    "draft_len": st.none() | st.just("auto") | st.integers(-3, 2**40) | junk,
    "tree_nodes": st.none() | st.just("auto") | st.integers(-3, 2**40) | junk,
    "private": st.none() | st.booleans() | st.integers(0, 1) | st.text(max_size=3),
})


@settings(max_examples=200, deadline=None)
@given(case=triton_case, chat=st.booleans())
def test_server_triton_and_session_accept_and_refuse_the_same_requests(case, chat):
    """Each answer is the validated request, or the field its refusal names."""
    at_server, at_triton, at_session = via_server(case), via_triton({**case, "chat": chat}), via_session(
        {**case, "chat": chat})
    if isinstance(at_triton, Request):
        assert at_triton.chat == chat and at_session.chat == chat
        at_triton, at_session = (replace(r, chat=False) for r in (at_triton, at_session))
    assert at_server == at_triton == at_session, case


@settings(max_examples=200, deadline=None)
@given(case=http_case)
def test_server_and_session_agree_past_what_tritons_types_carry(case):
    """Token-id prompts, huge integers, booleans for numbers, text for integers: values Triton's
    data types cannot carry, which the server and Session still judge alike."""
    if isinstance(case["prompt"], list):
        case = {("prompt_ids" if k == "prompt" else k): v for k, v in case.items()}
    at_server, at_session = via_server(case), via_session(case)
    # refused by both: Session reads integers given as text before the schema checks the rest,
    # so where several fields are wrong the two may name different ones
    assert type(at_server) is type(at_session), (case, at_server, at_session)
    if isinstance(at_server, Request):
        assert at_server == at_session, case


def test_a_chat_body_and_a_chat_turn_are_one_request():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tree_nodes": 2, "private": True}
    req, stream = server.parse_request(body, True, LIMITS)[:2]
    assert (req.messages, req.max_new_tokens, req.tree_nodes, req.private, stream) == (
        (Message("user", "hi"),), 4, 2, True, False)
    with pytest.raises(server.BadRequest) as e:
        server.parse_request({**body, "tree_nodes": 9}, True, LIMITS)
    assert e.value.param == "tree_nodes" and "'tree_nodes' 9 is outside [1, 8] (1: chains)" in str(e.value)
