"""What assistants send on every request, through `serve` over loopback HTTP and the real
`openai` client: structured output (`response_format`, vLLM's `structured_outputs`), logprobs
(chat's and completions' forms), the penalties and min-p, `max_completion_tokens`,
`stream_options.include_usage`; each answer equal to what a Session alone gives for the same
request, and each bad field a 400 that names it."""
import json

import httpx
import pytest

from specdeploy.runtime import Session
from specdeploy.runtime.decoding.batch import BatchSession
from loopback import Server
from tiny import PROMPTS

openai = pytest.importorskip("openai")
PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.6)


@pytest.fixture(scope="module")
def server(bundles):
    batch = BatchSession(bundles("llama-ngram"), batch=4, max_queue=8)  # what `serve` runs by default
    with Server(batch) as s:
        yield s
    batch.close()


@pytest.fixture(scope="module")
def session(bundles):
    return Session(bundles("llama-ngram"))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def _alone(session, **kw):
    pieces = list(session.stream(**kw))
    return [t for p in pieces for t in p.token_ids], [e for p in pieces for e in (p.logprobs or [])]


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
          "required": ["a", "b"], "additionalProperties": False}


def test_response_format_json_schema_and_object_as_a_session_constrains_them(client, session):
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": PROMPTS[4]}]
    ids = session.encode_messages(messages)
    for fmt, structure in (
        ({"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA, "strict": True}}, {"json": SCHEMA}),
        ({"type": "json_object"}, {"json_object": True}),
    ):
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                             response_format=fmt)
        want = session.generate(prompt_ids=ids, max_new_tokens=60, structure=structure)
        assert out.choices[0].message.content == want.text
        if out.choices[0].finish_reason == "stop":  # finished within the tokens: it parses, and validates
            jsonschema.validate(json.loads(want.text), SCHEMA if "json" in structure else {"type": "object"})
        streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=60, temperature=0,
                                                  response_format=fmt, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.text


def test_structured_outputs_regex_choice_and_grammar(client, session):
    for structure in ({"regex": "[a-c]{3}-[0-9]{2}"}, {"choice": ["red", "green", "blue"]},
                      {"grammar": 'start: "x" ("," "x")*'}):
        out = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=12, temperature=0,
                                        extra_body={"structured_outputs": structure})
        assert out.choices[0].text == session.generate(PROMPTS[3], max_new_tokens=12, structure=structure).text


def test_chat_logprobs_equal_a_sessions(client, session):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12, temperature=0,
                                         logprobs=True, top_logprobs=3, **PENALTIES)
    ids = session.encode_messages(messages)
    tokens, logprobs = _alone(session, prompt_ids=ids, max_new_tokens=12, logprobs=3, **PENALTIES)
    content = out.choices[0].logprobs.content
    assert out.usage.completion_tokens == len(tokens) == len(content)
    text = session.tokenizer.decode
    for got, want in zip(content, logprobs):
        assert got.token == text([want.token], skip_special_tokens=False)
        assert got.logprob == want.logprob and got.bytes == list(got.token.encode())
        assert [(t.token, t.logprob) for t in got.top_logprobs] == [
            (text([t], skip_special_tokens=False), lp) for t, lp in want.top]
    # streamed: the same entries, chunk by chunk
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True, **PENALTIES)
    entries = [e for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
               for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs_in_the_legacy_form(client, session):
    out = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0, logprobs=2)
    tokens, logprobs = _alone(session, prompt=PROMPTS[1], max_new_tokens=10, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == [e.logprob for e in logprobs]
    assert [list(d) for d in lp.top_logprobs] == [
        [session.tokenizer.decode([t], skip_special_tokens=False) for t, _ in e.top] for e in logprobs]
    assert "".join(lp.tokens) == out.choices[0].text  # byte-level pieces of this text decode alone
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_penalties_and_min_p_change_the_answer_as_they_change_a_sessions(client, session):
    for settings in (PENALTIES, dict(frequency_penalty=-0.6, presence_penalty=0.4), dict(min_p=0.2, seed=4)):
        extra = {k: v for k, v in settings.items() if k in ("min_p",)}
        known = {k: v for k, v in settings.items() if k not in extra}
        temperature = 0.9 if "seed" in settings else 0
        out = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=20, temperature=temperature,
                                        extra_body=extra, **known)
        want = session.generate(PROMPTS[2], max_new_tokens=20, temperature=temperature, **settings)
        assert out.choices[0].text == want.text, settings
    plain = session.generate(PROMPTS[2], max_new_tokens=20).text
    assert session.generate(PROMPTS[2], max_new_tokens=20, **PENALTIES).text != plain


def test_n_choices_are_lanes_each_as_a_session_alone(client, session):
    """n = 3 sampled: three answers, choice i with seed + i, each what a Session gives alone."""
    out = client.completions.create(model="tiny", prompt=PROMPTS[5], max_tokens=16, temperature=0.9, seed=5, n=3,
                                    logprobs=1)
    want = [session.generate(PROMPTS[5], max_new_tokens=16, temperature=0.9, seed=5 + i, logprobs=1) for i in range(3)]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [w.text for w in want]
    assert len({c.text for c in out.choices}) > 1  # the seeds differ: so do the answers
    assert out.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    assert out.choices[2].logprobs.text_offset[0] == 0  # each choice's offsets are its own
    # one prefill: the later choices' lanes copied the prompt's K/V from the first's slot
    fresh = "A prompt no request gave before: " + PROMPTS[7]  # so no slot held it already
    raw = httpx.post(str(client.base_url.join("completions")), json={
        "prompt": fresh, "max_tokens": 4, "n": 3, "temperature": 0.9, "seed": 5}).json()["specdeploy"]
    assert [s["cached_tokens"] for s in raw] == [0] + [raw[0]["prompt_tokens"] - 1] * 2
    streamed = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[6]}], max_tokens=12, temperature=0.9, seed=2, n=3,
        stream=True, stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    ids = session.encode_messages([{"role": "user", "content": PROMPTS[6]}])
    assert texts == [session.generate(prompt_ids=ids, max_new_tokens=12, temperature=0.9, seed=2 + i).text
                     for i in range(3)]
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 36


def test_stream_options_include_usage_sends_the_usage_last(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


@pytest.mark.parametrize("path, body, param, fragment", [
    ("chat", {"top_logprobs": 2}, "top_logprobs", "'top_logprobs' needs 'logprobs': true"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "'top_logprobs' 21 is outside [0, 20]"),
    ("chat", {"logprobs": 1}, "logprobs", "'logprobs' must be a boolean"),
    ("completions", {"logprobs": -1}, "logprobs", "'logprobs' -1 is outside [0, 20]"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty", "'presence_penalty' 2.5 is outside [-2, 2]"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty", "'repetition_penalty' 0.0 is outside (0, 2]"),
    ("completions", {"min_p": 1.5}, "min_p", "'min_p' 1.5 is outside [0, 1]"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens", "'max_completion_tokens' 0 is outside [1, 128]"),
    ("chat", {"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens", "not two different values"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options", "only allowed with 'stream': true"),
    ("chat", {"stream": True, "stream_options": {"include_usage": 1}}, "include_usage", "must be a boolean"),
    ("chat", {"n": 5}, "n", "'n' 5 is more than the batch's 4 slots"),
    ("chat", {"n": 9}, "n", "'n' 9 is outside [1, 8]"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"type": "foo"}}}, "response_format",
     "'response_format.json_schema.schema' must be a JSON schema object"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     "response_format", "does not compile"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format", "'response_format' must be"),
    ("completions", {"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", "does not compile"),
    ("completions", {"structured_outputs": {"regex": 5}}, "structured_outputs", "'regex' must be non-empty text"),
    ("completions", {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "structured_outputs", "give one of 'response_format', 'structured_outputs'"),
])
def test_bad_fields_get_a_400_that_names_them(server, path, body, param, fragment):
    base = {"messages": [{"role": "user", "content": "hi"}]} if path == "chat" else {"prompt": "hi"}
    r = httpx.post(f"{server.url}/v1/{'chat/completions' if path == 'chat' else 'completions'}",
                   content=json.dumps({**base, **body}), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["param"] == param
