"""Tool calls: a request's tools rendered through the bundle's chat template (which carries its
family's tool format), the calls the model writes parsed back, and `tool_choice` "required" or
a named function enforced by a grammar.

The format is read from the template, never guessed from the text. One family is read today:
the Hermes form (Qwen 2.5/3, SmolLM3, Hermes, and many fine-tunes), each call a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`. A template that
takes tools in another form, or none, gets a one-line refusal naming the field.
"""
from __future__ import annotations

import json
import re
from typing import NamedTuple

HERMES = "hermes"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
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
    """The template's tool format: HERMES, None where it takes no tools, "" where it takes them in
    a form not read here."""
    if not template or "tools" not in template:
        return None
    return HERMES if OPEN in template else ""


def call_grammar(tools: tuple[str, ...], choice: str, special: bool) -> str:
    """A Lark grammar (llguidance's, with %json) for one call the choice allows: any tool's
    ("required") or the named one's, arguments by its parameters' schema, on one line. `special`: the markers
    are special tokens of the tokenizer (written <tool_call>), else text."""
    options = []
    for text in tools:
        fn = json.loads(text)["function"]
        if choice in ("required", fn["name"]):
            options.append({"type": "object", "properties": {"name": {"const": fn["name"]},
                                                             "arguments": fn["parameters"]},
                            "required": ["name", "arguments"], "additionalProperties": False})
    schema = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    # written as the template shows calls: one line, ", " and ": " (the keys and separators are then
    # forced, drafted for free); free whitespace lets a model pad a call it cannot finish
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    open_, close = (OPEN, CLOSE) if special else (json.dumps(OPEN), json.dumps(CLOSE))
    return f'start: {open_} "\\n" call "\\n" {close}\ncall: %json {json.dumps(schema)}\n'


def parse_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The model's answer (special tokens kept) -> (its content outside the calls, as written,
    the calls). A block whose JSON does not read as {"name", "arguments"} stays content."""
    calls, kept, pos = [], [], 0
    for m in CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except ValueError:
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(ToolCall(call["name"], arguments if isinstance(arguments, str) else
                              json.dumps(arguments, ensure_ascii=False)))
        kept.append(text[pos:m.start()])
        pos = m.end()
    kept.append(text[pos:])
    return "".join(kept) if calls else text, calls


def content_before_calls(text: str) -> int:
    """How much of a growing answer is content for certain: up to its first call's marker, less
    an end that may be the marker's beginning or an incomplete character."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    end = len(text)
    while end and text[end - 1] == "\ufffd":  # a character whose last bytes have not come
        end -= 1
    for keep in range(min(len(OPEN) - 1, end), 0, -1):
        if text[end - keep:end] == OPEN[:keep]:
            return end - keep
    return end
