"""Tool calls through `serve` and the real `openai` client: tools rendered through the bundle's
chat template (a tiny model whose template takes tools in the Hermes form), `tool_choice`
"required" or a named function enforced by the grammar, the calls parsed back into
`tool_calls` (whole and streamed), a round trip whose follow-up carries the tool's result,
each the same under speculation as plain; a template with no tool format refused in one line."""
import json

import httpx
import pytest

import tiny
from specdeploy.runtime import Session
from specdeploy.runtime.decoding.batch import BatchSession
from specdeploy.runtime.decoding.request import message_of
from specdeploy.runtime.decoding.tools import (call_grammar, call_id, check_tools, content_before_calls, parse_calls,
                                               tool_format)
from loopback import Server

openai = pytest.importorskip("openai")

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Call one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA_TEMPLATE = (
    "{%- if tools %}<|im_start|>user\nGiven the following functions, please respond with a JSON for a function call "
    "with its proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
    "\"parameters\": dictionary of argument name and its value}. Do not use variables.\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for call in message.tool_calls %}"
    "{\"name\": \"{{ call.function.name }}\", \"parameters\": {{ call.function.arguments | tojson }}}"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role in ('tool', 'ipython') %}<|im_start|>ipython\n{{ message.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Mistral 7B v0.3's form (its template abridged): the tools before the last user turn, calls as a
# JSON array after [TOOL_CALLS], each with its 9-character id, which the template insists on.
MISTRAL_TEMPLATE = (
    "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last %}[AVAILABLE_TOOLS] [{%- for tool in tools %}{{ tool | tojson }}"
    "{%- if not loop.last %}, {% endif %}{%- endfor %}][/AVAILABLE_TOOLS]{%- endif %}"
    "[INST] {{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] ["
    "{%- for call in message.tool_calls %}"
    "{%- if call.id is not defined or call.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}, "
    "\"id\": \"{{ call.id }}\"}{%- if not loop.last %}, {% endif %}{%- endfor %}]</s>"
    "{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "[TOOL_RESULTS] {\"content\": {{ message.content | tojson }}, \"call_id\": \"{{ message.tool_call_id }}\"}"
    "[/TOOL_RESULTS]"
    "{%- else %} {{ message.content }}</s>{%- endif %}"
    "{%- endfor %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": 0, "maximum": 23}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _bundle(root, template):
    from specdeploy.export import build_bundle

    tiny.make_model(root / "m", "llama", seed=3, layers=2)
    (root / "m" / "chat_template.jinja").write_text(template)
    build_bundle(root / "m", "ngram", root / "b", max_seq=1024, max_draft=8, prefill_chunk=64)
    return root / "b"


@pytest.fixture(scope="module")
def tool_bundle(tmp_path_factory):
    return _bundle(tmp_path_factory.mktemp("tools"), HERMES_TEMPLATE)


@pytest.fixture(scope="module")
def llama_bundle(tmp_path_factory):
    return _bundle(tmp_path_factory.mktemp("llama_tools"), LLAMA_TEMPLATE)


@pytest.fixture(scope="module")
def mistral_bundle(tmp_path_factory):
    return _bundle(tmp_path_factory.mktemp("mistral_tools"), MISTRAL_TEMPLATE)


@pytest.fixture(scope="module")
def server(tool_bundle):
    batch = BatchSession(tool_bundle, batch=3)
    with Server(batch) as s:
        yield s
    batch.close()


def test_the_template_decides_the_format_and_calls_parse_back():
    assert tool_format(HERMES_TEMPLATE) == "hermes" and tool_format(LLAMA_TEMPLATE) == "llama"
    assert tool_format(tiny.CHAT_TEMPLATE) is None
    assert parse_calls('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "llama")[1][0].arguments == '{"a": 1}'
    assert parse_calls('Sure, {"name": "f"} is a call', "llama") == ('Sure, {"name": "f"} is a call', [])
    assert content_before_calls(' {"na', "llama") == 0 and content_before_calls("Hello", "llama") == 5
    assert tool_format(MISTRAL_TEMPLATE) == "mistral"
    assert tool_format("{% for t in tools %}[TOOL_CALLS]{{ t.name }}[ARGS]{% endfor %}") == ""  # Mistral's later form
    assert tool_format("{% for t in tools %}<|channel|>commentary{% endfor %}") == ""  # harmony
    text = 'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call> <tool_call>{"bad json</tool_call>'
    content, calls = parse_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    assert content == 'ok  <tool_call>{"bad json</tool_call>'
    assert content_before_calls("Sure. <tool_call>\n{") == len("Sure. ")
    assert content_before_calls("Sure. <tool_") == len("Sure. ")  # may be the marker's beginning
    assert content_before_calls("caf\ufffd") == 3 and content_before_calls("no call") == 7
    grammar = call_grammar(check_tools([WEATHER, TIME]), "get_time", "hermes", set())
    assert "get_time" in grammar and "get_weather" not in grammar
    # Mistral's: an array after the marker, an id kept out of the arguments, text around it content
    text = 'Let me look. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}, "id": "abcDEF123"}, {"name": "g"}] done'
    content, calls = parse_calls(text, "mistral")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}), ("g", {})]
    assert content == "Let me look.  done"
    assert parse_calls("[TOOL_CALLS] [{oops", "mistral") == ("[TOOL_CALLS] [{oops", [])
    assert content_before_calls("Sure [TOOL_", "mistral") == len("Sure ")
    assert content_before_calls("Sure [TOOL_CALLS] [", "mistral") == len("Sure ")
    # a marker the tokenizer holds as a special token is named by its id (llguidance's <[id]>)
    assert call_grammar(check_tools([TIME]), "required", "mistral", {5: "[TOOL_CALLS]"}).startswith("start: <[5]> ")
    assert call_grammar(check_tools([TIME]), "required", "mistral", {}).startswith('start: "[TOOL_CALLS]" ')
    assert call_grammar(check_tools([TIME]), "required", "hermes", {7: "<tool_call>", 8: "</tool_call>"}).startswith(
        "start: <tool_call> ")
    assert len(call_id("mistral")) == 9 and call_id("mistral").isalnum() and call_id("hermes").startswith("call_")


@pytest.mark.parametrize("form", ["hermes", "llama", "mistral"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_is_exact_under_speculation_and_parses(tool_bundle, llama_bundle, mistral_bundle, choice, form):
    session = Session({"hermes": tool_bundle, "llama": llama_bundle, "mistral": mistral_bundle}[form])
    kw = dict(messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, max_new_tokens=200)
    plain = session.generate(speculate=False, **kw)
    content, calls = session.tool_calls(plain.token_ids)
    assert len(calls) == 1 and content == "", plain.text
    arguments = json.loads(calls[0].arguments)
    if isinstance(choice, dict):
        assert calls[0].name == "get_weather"
    if calls[0].name == "get_weather":
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f")
    for k in (1, 3, 8, "auto"):
        spec = session.generate(draft_len=k, **kw)
        assert spec.token_ids == plain.token_ids, k
    assert spec.stats.forced > 0  # the markers and the keys came for free


def test_openai_client_tool_round_trip(server, tool_bundle):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           max_tokens=200, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    json.loads(call.function.arguments)
    # the same call, streamed
    streamed = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME],
                                                   tool_choice="required", max_tokens=200, temperature=0, stream=True))
    deltas = [d for c in streamed if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(call.function.name, call.function.arguments)]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    # the follow-up carries the tool's result; the answer equals a Session's on the same turns
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18}'}]
    second = client.chat.completions.create(model="tiny", messages=follow, tools=[WEATHER, TIME], tool_choice="none",
                                            max_tokens=20, temperature=0)
    session = Session(tool_bundle)
    want = session.generate(messages=follow, max_new_tokens=20)
    assert second.choices[0].message.content == want.text and not second.choices[0].message.tool_calls
    rendered = session.tokenizer.decode(session.encode_messages([{"role": "tool", "content": '{"celsius": 18}'}]),
                                        skip_special_tokens=False)
    assert "<tool_response>" in rendered  # the template's tool turn, as the request gave it


def test_a_streamed_call_is_sent_once_its_block_closes(server):
    """An answer that writes a call and then more text (a grammar makes the tiny model write it):
    streamed, the call arrives in its own chunk as soon as `</tool_call>` is written, before the
    text after it; whole, the same call and content."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    grammar = ('start: "Checking. <tool_call>\\n" "{\\"name\\": \\"get_time\\", \\"arguments\\": {\\"zone\\": 3}}" '
               '"\\n</tool_call>" " and then some words after it"')
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=120, temperature=0,
              extra_body={"structured_outputs": {"grammar": grammar}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls[0].function.name == "get_time"
    assert whole.message.content == "Checking.  and then some words after it"
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    at = [i for i, c in enumerate(chunks) if c.delta.tool_calls]
    assert len(at) == 1 and chunks[at[0]].delta.tool_calls[0].function.arguments == '{"zone": 3}'
    after = "".join(c.delta.content or "" for c in chunks[at[0] + 1:])
    assert after == " and then some words after it" and chunks[-1].finish_reason == "tool_calls"
    assert "".join(c.delta.content or "" for c in chunks[: at[0] + 1]) == "Checking. "


def test_with_tools_a_streamed_answer_sends_its_content_as_it_comes(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 2  # round by round, not at the end
    if whole.finish_reason != "tool_calls":  # the tiny model wrote text, no call
        assert "".join(content) == whole.message.content


def test_llama_form_round_trip_through_the_client(llama_bundle):
    batch = BatchSession(llama_bundle, batch=2)
    try:
        with Server(batch) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
            out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME],
                                                 tool_choice={"type": "function", "function": {"name": "get_time"}},
                                                 max_tokens=200, temperature=0)
            call = out.choices[0].message.tool_calls[0]
            assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
            assert set(json.loads(call.function.arguments)) == {"zone"} and out.choices[0].message.content is None
            follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                            {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
            again = client.chat.completions.create(model="tiny", messages=follow, max_tokens=8, temperature=0)
            assert again.choices[0].message.content == Session(llama_bundle).generate(messages=follow,
                                                                                       max_new_tokens=8).text
    finally:
        batch.close()


def test_mistral_form_round_trip_through_the_client(mistral_bundle):
    """The call's id is Mistral's 9 characters, so its template takes the follow-up (it raises on
    any other id); streamed, the content before the marker arrives as it comes."""
    batch = BatchSession(mistral_bundle, batch=2)
    try:
        with Server(batch) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
            out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME],
                                                 tool_choice="required", max_tokens=200, temperature=0)
            choice = out.choices[0]
            call = choice.message.tool_calls[0]
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
            assert len(call.id) == 9 and call.id.isalnum() and choice.message.content is None
            json.loads(call.function.arguments)
            follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                            {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18}'}]
            again = client.chat.completions.create(model="tiny", messages=follow, max_tokens=8, temperature=0)
            session = Session(mistral_bundle)
            assert again.choices[0].message.content == session.generate(messages=follow, max_new_tokens=8).text
            turns = [message_of(m).for_template() for m in follow]
            rendered = session.tokenizer.decode(session.encode_messages(turns), skip_special_tokens=False)
            assert f'"call_id": "{call.id}"' in rendered and "[TOOL_CALLS] [" in rendered
            bad = [follow[0], {**follow[1], "tool_calls": [{**call.model_dump(), "id": "call_123"}]}, follow[2]]
            r = httpx.post(server.url + "/v1/chat/completions", json={"messages": bad, "max_tokens": 4})
            assert r.status_code == 400 and "length 9" in r.json()["error"]["message"], r.text  # the template's own refusal
    finally:
        batch.close()


@pytest.mark.parametrize("body, param, fragment", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "function.name must be"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "must be \"none\", \"auto\", \"required\""),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "no tool is named 'nope'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]}, "tools",
     "parameters"),
    ({"tool_choice": "required"}, "tool_choice", "'tool_choice' needs 'tools'"),
])
def test_bad_tools_get_a_400_that_names_the_field(server, body, param, fragment):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and fragment in r.json()["error"]["message"]


def test_a_template_without_tools_is_refused_in_one_line(bundles):
    session = Session(bundles("llama-ngram"))
    with pytest.raises(Exception) as e:
        session.generate(messages=ASK, tools=[WEATHER], max_new_tokens=8)
    assert "chat template has no tool format" in str(e.value) and "\n" not in str(e.value)
    # with tool_choice "none" the tools are not rendered, and the request runs
    assert session.generate(messages=ASK, tools=[WEATHER], tool_choice="none", max_new_tokens=4).token_ids
