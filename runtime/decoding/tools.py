"""Tool calls: a request's tools rendered through the bundle's chat template (which carries its
family's tool format), the calls the model writes parsed back, and `tool_choice` "required" or
a named function enforced by a grammar.

The format is read from the template, never guessed from the text (`tool_format`). Three
families are read: the Hermes form (Qwen 2.5/3, SmolLM3, Hermes, and many fine-tunes), each call
a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`;
Llama 3.1-3.3's JSON form, the whole answer one object `{"name": ..., "parameters": {...}}`
(after `<|python_tag|>` where the model writes it); and Mistral's (7B v0.3, Nemo, Small 22B,
Large 2, Mixtral 8x22B), a JSON array of `{"name": ..., "arguments": {...}}` after
`[TOOL_CALLS]`, each call's id 9 letters or digits (their templates refuse any other). A
template that takes tools in another form (Mistral's later `name[ARGS]{...}`, gpt-oss's harmony,
Gemma 4's), or none, gets a one-line refusal naming the field.
"""
from __future__ import annotations

import json
import re
import secrets
import string
from typing import NamedTuple

HERMES, LLAMA, MISTRAL = "hermes", "llama", "mistral"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"  # the second: Mistral's later form, not read
MARKER = {HERMES: OPEN, MISTRAL: MISTRAL_CALLS}  # where a form's calls begin
PYTHON_TAG = "<|python_tag|>"
LLAMA_MARK = '"parameters": dictionary of argument name'  # Llama 3.1-3.3 templates ask for calls so
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


class ToolCall(NamedTuple):
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it


def check_tools(value) -> tuple[str, ...]:
    """OpenAI's `tools` (an array of {"type": "function", "function": {"name", "description",
    "parameters"}}) as canonical JSON texts, one a tool. Raises ValueError saying what is wrong."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError("must be a non-empty array of {type: function, function: {name, parameters}}")
    out, names = [], set()
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict):
            raise ValueError(f"[{i}] must be {{type: function, function: {{name, parameters}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"[{i}].function.name must be 1-64 letters, digits, _ or -")
        if name in names:
            raise ValueError(f"[{i}].function.name {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"[{i}].function.parameters must be a JSON schema object")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"[{i}].function.description must be text")
        canonical = {"type": "function", "function": {"name": name, **({"description": description}
                                                                        if description else {}), "parameters": params}}
        out.append(json.dumps(canonical, ensure_ascii=False))
    return tuple(out)


def check_tool_choice(value) -> str:
    """OpenAI's `tool_choice`: "none", "auto", "required", or {"type": "function", "function":
    {"name": ...}} -> "none", "auto", "required" or the function's name."""
    if value in ("none", "auto", "required"):
        return value
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str) and NAME.fullmatch(fn["name"]):
        return fn["name"]
    raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def tool_format(template: str | None) -> str | None:
    """The template's tool format: HERMES, LLAMA or MISTRAL, None where it takes no tools, ""
    where it takes them in a form not read here."""
    if not template or "tools" not in template:
        return None
    if OPEN in template:
        return HERMES
    if MISTRAL_CALLS in template:
        return "" if MISTRAL_ARGS in template else MISTRAL
    return LLAMA if LLAMA_MARK in template else ""


def call_id(form: str | None) -> str:
    """A new call's id as the form's template takes it back: Mistral's 9 letters or digits,
    else OpenAI's `call_` and 24 hex digits."""
    if form == MISTRAL:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def _literal(text: str, specials) -> str:
    """`text` in a Lark grammar: a special token of the tokenizer's as llguidance names one
    (`<tool_call>` as itself, another by its id, `<[5]>`), else as quoted text. `specials`:
    {id: text} (or a set of texts)."""
    ids = {v: k for k, v in specials.items()} if isinstance(specials, dict) else dict.fromkeys(specials)
    if text not in ids:
        return json.dumps(text)
    return text if text.startswith("<") and text.endswith(">") or ids[text] is None else f"<[{ids[text]}]>"


def call_grammar(tools: tuple[str, ...], choice: str, form: str, specials) -> str:
    """A Lark grammar (llguidance's, with %json) for one call the choice allows: any tool's
    ("required") or the named one's, arguments by its parameters' schema, on one line, in the
    template's `form`. `specials`: the tokenizer's special tokens, {id: text} (a marker that is one
    is written as that token, else as text)."""
    key = "parameters" if form == LLAMA else "arguments"
    options = []
    for text in tools:
        fn = json.loads(text)["function"]
        if choice in ("required", fn["name"]):
            options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, key: fn["parameters"]},
                            "required": ["name", key], "additionalProperties": False})
    schema = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    # written as the template shows calls: one line, ", " and ": " (the keys and separators are then
    # forced, drafted for free); free whitespace lets a model pad a call it cannot finish
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    call = f"call: %json {json.dumps(schema)}\n"
    if form == LLAMA:
        return "start: call\n" + call
    if form == MISTRAL:  # as its templates write calls: "[TOOL_CALLS] [" call "]"
        return f'start: {_literal(MISTRAL_CALLS, specials)} " [" call "]"\n' + call
    return f'start: {_literal(OPEN, specials)} "\\n" call "\\n" {_literal(CLOSE, specials)}\n' + call


def _call(obj) -> ToolCall | None:
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def parse_calls(text: str, form: str = HERMES) -> tuple[str, list[ToolCall]]:
    """The model's answer (special tokens kept) -> (its content outside the calls, as written,
    the calls). Hermes: a block whose JSON does not read as {"name", "arguments"} stays content.
    Llama: the whole answer is a call or is content."""
    if form == LLAMA:
        body = text.strip()
        body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
        try:
            obj = json.loads(body)
        except ValueError:
            return text, []
        calls = [_call(o) for o in (obj if isinstance(obj, list) else [obj])]
        return ("", calls) if calls and None not in calls else (text, [])
    if form == MISTRAL:
        return _parse_mistral(text)
    calls, kept, pos = [], [], 0
    for m in CALL.finditer(text):
        try:
            call = _call(json.loads(m.group(1)))
        except ValueError:
            continue
        if call is None:
            continue
        calls.append(call)
        kept.append(text[pos:m.start()])
        pos = m.end()
    kept.append(text[pos:])
    return "".join(kept) if calls else text, calls


def _parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    """Each `[TOOL_CALLS]` followed by a JSON array (or one object) of calls; a marker whose JSON
    does not read as calls stays content, as Hermes' blocks do."""
    decoder, calls, kept, pos = json.JSONDecoder(), [], [], 0
    at = text.find(MISTRAL_CALLS)
    while at >= 0:
        start = at + len(MISTRAL_CALLS)
        body = start + len(text[start:]) - len(text[start:].lstrip())
        try:
            obj, end = decoder.raw_decode(text, body)
        except ValueError:
            obj, end = None, start
        found = [_call(o) for o in (obj if isinstance(obj, list) else [obj])]
        if found and None not in found:
            calls += found
            kept.append(text[pos:at])
            pos = end
        at = text.find(MISTRAL_CALLS, end)
    kept.append(text[pos:])
    return "".join(kept) if calls else text, calls


def calls_close(form: str | None) -> bool:
    """Whether a call the form writes is final once its block closes (Hermes' `</tool_call>`,
    Mistral's array), so that a stream can send it then; Llama's answer is a call only if the
    whole answer is one, known at its end."""
    return form in (HERMES, MISTRAL)


def content_before_calls(text: str, form: str = HERMES) -> int:
    """How much of a growing answer is content for certain: up to its first call's marker, less
    an end that may be the marker's beginning or an incomplete character. Llama: nothing while
    the answer may still be a call (it begins with "{" or the python tag, or has not begun)."""
    if form == LLAMA:
        head = text.lstrip()
        if not head or head.startswith("{") or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head):
            return 0
        end = len(text)
        while end and text[end - 1] == "\ufffd":
            end -= 1
        return end
    marker = MARKER.get(form, OPEN)
    at = text.find(marker)
    if at >= 0:
        return at
    end = len(text)
    while end and text[end - 1] == "\ufffd":  # a character whose last bytes have not come
        end -= 1
    for keep in range(min(len(marker) - 1, end), 0, -1):
        if text[end - keep:end] == marker[:keep]:
            return end - keep
    return end
