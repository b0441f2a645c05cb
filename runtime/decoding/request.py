"""One request schema for every way in: an HTTP body of `specdeploy serve`, a Triton request
and the arguments of `Session.stream` are each mapped to the fields of `Request` and checked
by `validate`, against the `Limits` of the bundle that serves them.

A front end maps its transport's shapes to Python values (JSON numbers to floats, Triton's
tensors to scalars, a command line's text to integers) and its names to the schema's; the
kinds and the ranges are checked here, once. Each error is a `RequestError` naming its field
as the front end calls it (`labels`: `WORDS` for the library, `wire_labels` for HTTP and
Triton, whose names follow OpenAI's: `max_tokens`).

Every setting is one field of `Request`, declared with `setting(...)`: its kind, its rule,
its names and its Triton data type. The server reads a body, the Triton model its inputs and
`specdeploy triton-repo` writes config.pbtxt from these declarations, so a new setting is one
field here (and one keyword of `Session.stream`).

>>> limits = Limits(max_seq=128, max_draft=8)
>>> validate({"prompt": "Hi", "temperature": 0.5}, limits).temperature
0.5
>>> validate({"prompt": "Hi", "top_p": 0.0}, limits, wire_labels("prompt"))
Traceback (most recent call last):
...
specdeploy.runtime.decoding.request.RequestError: 'top_p' 0.0 is outside (0, 1]
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from numbers import Integral, Real
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from specdeploy.core.errors import InputError
from specdeploy.runtime.decoding.tokenizer import check_text
from specdeploy.runtime.decoding.tools import check_tool_choice, check_tools

CHARS_PER_TOKEN = 64  # at least: a prompt of max_seq tokens has at most max_seq times this many characters
DEFAULT_MAX_TOKENS = {False: 16, True: 256}  # plain, chat: when a request gives no max_tokens (capped to fit)
MAX_TREE_NODES = 32  # the most nodes a tree round verifies (a pass of 33 tokens)
MAX_STOPS = 4
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0  # presence and frequency: [-2, 2] as OpenAI's API; repetition: (0, 2]
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's `top_logprobs`
SEED_END = 1 << 64  # seeds are unsigned 64-bit integers


class RequestError(InputError):
    """A request field the schema refuses; `field` is the schema's name for it."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class Structure(NamedTuple):
    """What a constrained output must match (runtime/decoding/grammar.py compiles it): `kind` one
    of STRUCTURES; `source` the JSON schema as JSON text, the regular expression, the Lark
    grammar, or the choices as a JSON array of strings ("" for any JSON object)."""

    kind: str
    source: str


# the library's (and vLLM's `structured_outputs`) names for them -> the kinds
STRUCTURES = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "grammar": "grammar",
              "choice": "choice"}


def structure_of(value) -> Structure:
    """A `structure` as a request gives it, one key of STRUCTURES: {"json": schema (an object or
    its JSON text)}, {"json_object": true}, {"regex": text}, {"grammar": Lark text}, {"choice":
    [strings]}; or a Structure. Raises ValueError saying what is wrong."""
    if isinstance(value, Structure):
        return value
    if isinstance(value, str):  # the object as JSON text (a Triton string input)
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError("must be an object (or its JSON text) with one of " + ", ".join(STRUCTURES)) from None
        if isinstance(value, str):
            raise ValueError("must be an object (or its JSON text) with one of " + ", ".join(STRUCTURES))
        return structure_of(value)
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in STRUCTURES:
        raise ValueError(f"must be an object with one of {', '.join(STRUCTURES)}")
    (key, given), = value.items()
    if key == "json":
        if isinstance(given, str):
            try:
                given = json.loads(given)
            except ValueError:
                raise ValueError("'json' must be a JSON schema (an object, or its JSON text)") from None
        if not isinstance(given, dict):
            raise ValueError("'json' must be a JSON schema (an object, or its JSON text)")
        return Structure("json_schema", json.dumps(given))
    if key == "json_object":
        if given is not True:
            raise ValueError("'json_object' must be true")
        return Structure("json_object", "")
    if key == "choice":
        if not isinstance(given, (list, tuple)) or not given or not all(isinstance(c, str) and c for c in given):
            raise ValueError("'choice' must be a non-empty array of non-empty strings")
        return Structure("choice", json.dumps(list(given)))
    if not isinstance(given, str) or not given:
        raise ValueError(f"'{key}' must be non-empty text")
    return Structure(STRUCTURES[key], given)


class Message(NamedTuple):
    """One turn of a chat: an assistant's may carry the tool calls it made (id, name, arguments
    as JSON text), a tool's the id of the call it answers."""

    role: str
    content: str
    tool_calls: tuple[tuple[str, str, str], ...] = ()
    tool_call_id: str | None = None

    def for_template(self) -> dict:
        """The turn as chat templates read it (transformers' form: arguments as an object)."""
        out = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": _arguments(a)}}
                                 for i, n, a in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def message_of(m) -> Message:
    """A chat turn in OpenAI's form: {role, content} (text; an assistant's may be null when it
    carries `tool_calls`: [{id, type: function, function: {name, arguments: JSON text}}]), a tool's
    with `tool_call_id`. Raises ValueError saying what is wrong."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError("each turn must be an object with a string 'role'")
    calls = m.get("tool_calls") or ()
    content = m.get("content")
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise ValueError("each turn's 'content' must be text (an assistant's may be null with 'tool_calls')")
    if not isinstance(calls, (list, tuple)):
        raise ValueError("'tool_calls' must be an array")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", "{}"), str) and isinstance(c.get("id", ""), str)):
            raise ValueError("each tool call must be {id, type: function, function: {name, arguments: JSON text}}")
        out.append((c.get("id", ""), fn["name"], fn.get("arguments", "{}")))
    call_id = m.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise ValueError("'tool_call_id' must be text")
    return Message(m["role"], content, tuple(out), call_id)


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the serving bundle's sizes."""

    max_seq: int
    max_draft: int
    max_chars: int | None = None  # a longer prompt cannot fit in max_seq tokens (None: max_seq * CHARS_PER_TOKEN)
    vocab: int | None = None  # token ids are below it (None: any int64 id)
    max_tree_nodes: int = MAX_TREE_NODES

    def __post_init__(self):
        if self.max_chars is None:
            object.__setattr__(self, "max_chars", self.max_seq * CHARS_PER_TOKEN)

    @classmethod
    def of(cls, session, max_chars: int | None = None) -> "Limits":
        """A session's limits. The characters a prompt that fits in max_seq tokens can have:
        max_seq tokens of at most `CHARS_PER_TOKEN` characters, or of the vocabulary's longest
        token if longer (a byte-level or SentencePiece token's vocabulary string is at least as
        long as the text it stands for). A tokenizer that drops characters (a whitespace
        pre-tokenizer) could fit more; such a prompt is refused all the same."""
        b = session.bundle
        if max_chars is None:
            max_chars = b.max_seq * max(CHARS_PER_TOKEN, session.tokenizer.longest_token_chars())
        return cls(b.max_seq, b.max_draft, max_chars, session.target.vocab_size)


# -- kinds and rules ----------------------------------------------------------------------------

def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)  # a JSON true is never a number here


@dataclass(frozen=True)
class Kind:
    """A setting's type: what it accepts, the shape its rule sees, the value it keeps."""

    what: str  # for errors: "must be an integer"
    accepts: Callable[[Any], bool]
    shape: Callable[[Any], Any] = lambda v: v
    keep: Callable[[Any], Any] = lambda v: v


def _is_auto(value) -> bool:
    return isinstance(value, str) and value == "auto"


INTEGER = Kind("an integer", _is_int, keep=int)
NUMBER = Kind("a number", lambda v: _is_int(v) or isinstance(v, Real) and not isinstance(v, bool), keep=float)
BOOLEAN = Kind("a boolean", lambda v: isinstance(v, (bool, np.bool_)), keep=bool)
INTEGER_OR_AUTO = Kind("an integer or 'auto'", lambda v: v is None or _is_auto(v) or _is_int(v),
                       shape=lambda v: "auto" if v is None else v, keep=lambda v: v if _is_auto(v) else int(v))
STRINGS = Kind("a string or an array of strings", lambda v: isinstance(v, (str, list, tuple)),
               shape=lambda v: (v,) if isinstance(v, str) else tuple(v))

STRUCTURE = Kind("an object with one of json, json_object, regex, grammar, choice",
                 lambda v: isinstance(v, (dict, str, Structure)), keep=structure_of)

def _checked(check):
    """A rule from a check that raises ValueError."""
    def rule(value, limits):
        try:
            check(value)
        except ValueError as e:
            return str(e)
        return None
    return rule


TOOLS = Kind("an array of tools", lambda v: isinstance(v, (list, tuple)), keep=check_tools)
TOOL_CHOICE = Kind('"none", "auto", "required" or a function', lambda v: isinstance(v, (str, dict)),
                   keep=check_tool_choice)

Rule = Callable[[Any, "Limits | None"], "str | None"]  # (the shaped value, limits) -> what is wrong, or None


def _shown(value) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:20]}..."


def _bound(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _outside(value, low, high, low_open: bool = False, note: str = "") -> str | None:
    # exact for integers of any size (no float conversion); NaN is never inside
    inside = (low < value if low_open else low <= value) and value <= high
    return None if inside else f"{_shown(value)} is outside {'(' if low_open else '['}{_bound(low)}, {_bound(high)}]{note}"


def _not_unicode(text: str) -> str | None:
    """What is wrong with text UTF-8 cannot carry: JSON's \\ud800 escapes (and UTF-8-encoded
    surrogates, which Python's json accepts) give lone surrogates, which no tokenizer takes."""
    try:
        check_text(text, "")
    except InputError as e:
        return str(e).strip()
    return None


def _new_tokens(value, limits):
    return _outside(value, 1, limits.max_seq)


def _temperature(value, limits):
    return _outside(value, 0.0, MAX_TEMPERATURE)


def _top_p(value, limits):
    return _outside(value, 0.0, 1.0, low_open=True)


def _top_k(value, limits):
    return None if value >= 0 else f"{_shown(value)} must be >= 0 (0: off)"


def _min_p(value, limits):
    return _outside(value, 0.0, 1.0)


def _penalty(value, limits):
    return _outside(value, -MAX_PENALTY, MAX_PENALTY)


def _repetition(value, limits):
    return _outside(value, 0.0, MAX_PENALTY, low_open=True)


def _logprobs(value, limits):
    return _outside(value, 0, MAX_LOGPROBS)


def _seed(value, limits):
    return None if 0 <= value < SEED_END else f"{_shown(value)} is outside [0, 2**64)"


def _stop(value, limits):
    if len(value) > MAX_STOPS or not all(isinstance(s, str) and s for s in value):
        return f"must be at most {MAX_STOPS} non-empty strings"
    if sum(map(len, value)) > limits.max_chars:
        return f"strings are longer than {limits.max_chars} characters in all"
    return next(filter(None, map(_not_unicode, value)), None)


def _draft_len(value, limits):
    return None if _is_auto(value) else _outside(value, 0, limits.max_draft, note=" (the bundle's max draft)")


def _tree_nodes(value, limits):
    return None if _is_auto(value) else _outside(value, 1, limits.max_tree_nodes, note=" (1: chains)")


@dataclass(frozen=True)
class Setting:
    """How a request field is read and checked, and what each front end calls it."""

    kind: Kind
    words: str  # the library's name for it, in Session's errors
    wire: str | None  # its name in an HTTP body and a Triton request (None: the library's alone)
    triton: str = ""  # Triton's data type for the input (TYPE_*)
    doc: str = ""
    rule: Rule = lambda value, limits: None
    optional: bool = False  # None is a value: absent


def setting(default, kind: Kind, words: str, wire: str | None, triton: str = "", doc: str = "",
            rule: Rule = lambda value, limits: None, optional: bool = False):
    """A field of `Request` that is a setting (the prompt fields are not)."""
    return field(default=default, metadata={"setting": Setting(kind, words, wire, triton, doc, rule, optional)})


# -- the request ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    """A validated request (from `validate`): exactly one prompt form, and its settings. The
    defaults are those of an HTTP or Triton request that gives none (Session passes its own)."""

    prompt: str | None = None  # text (through the chat template when `chat`)
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[Message, ...] | None = None  # a whole chat, through the chat template
    chat: bool = False
    max_new_tokens: int | None = setting(
        None, INTEGER, "max new tokens", "max_tokens", "TYPE_INT32", "new tokens (default 16, chat 256, capped to fit)",
        _new_tokens, optional=True)  # None: the default, capped to what fits after the prompt (see `fit`)
    temperature: float = setting(
        1.0, NUMBER, "temperature", "temperature", "TYPE_FP64", "[0, 2]; 0 is greedy (default 1)", _temperature)
    top_p: float = setting(1.0, NUMBER, "top-p", "top_p", "TYPE_FP64", "(0, 1]; 1 is off", _top_p)
    top_k: int = setting(0, INTEGER, "top-k", "top_k", "TYPE_INT32", ">= 0; 0 is off", _top_k)
    min_p: float = setting(0.0, NUMBER, "min-p", "min_p", "TYPE_FP64", "[0, 1]; 0 is off", _min_p)
    presence_penalty: float = setting(
        0.0, NUMBER, "presence penalty", "presence_penalty", "TYPE_FP64",
        "[-2, 2]: less each token the text holds (0 is off)", _penalty)
    frequency_penalty: float = setting(
        0.0, NUMBER, "frequency penalty", "frequency_penalty", "TYPE_FP64",
        "[-2, 2]: less each token by how often the text holds it (0 is off)", _penalty)
    repetition_penalty: float = setting(
        1.0, NUMBER, "repetition penalty", "repetition_penalty", "TYPE_FP64",
        "(0, 2]: tokens of prompt and text divided (1 is off)", _repetition)
    logprobs: int | None = setting(
        None, INTEGER, "logprobs", None, doc="each token's log probability and that many likeliest alternatives",
        rule=_logprobs, optional=True)  # the server maps OpenAI's two forms (chat's and completions') to it
    seed: int | None = setting(
        None, INTEGER, "seed", "seed", "TYPE_UINT64", "the same seed gives the same text", _seed, optional=True)
    stop: tuple[str, ...] = setting(
        (), STRINGS, "stop", "stop", "TYPE_STRING", "up to 4 stop strings; the text ends before the first", _stop)
    draft_len: int | str = setting(
        "auto", INTEGER_OR_AUTO, "draft length", "draft_len", "TYPE_INT32",
        "draft tokens per round, [0, the bundle's max draft] (default auto)", _draft_len)
    tree_nodes: int | str = setting(
        "auto", INTEGER_OR_AUTO, "tree nodes", "tree_nodes", "TYPE_INT32",
        "token-tree nodes per round, [1, 32] (1: chains; default auto)", _tree_nodes)
    private: bool = setting(
        False, BOOLEAN, "private", "private", "TYPE_BOOL",
        "the drafter draws on this request's text alone and keeps none of it (default false)")
    speculate: bool = setting(True, BOOLEAN, "speculate", None)  # False: the target alone
    structure: Structure | None = setting(
        None, STRUCTURE, "structure", "structure", "TYPE_STRING",
        'what the output must match, as JSON: {"json": schema}, {"json_object": true}, {"regex": ...}, '
        '{"grammar": Lark}, {"choice": [...]}', _checked(structure_of), optional=True)  # the server also maps OpenAI's
    # response_format and vLLM's structured_outputs to it
    tools: tuple[str, ...] | None = setting(
        None, TOOLS, "tools", None, doc="functions the model may call, as JSON (OpenAI's form)", rule=_checked(check_tools),
        optional=True)  # canonical JSON texts, one a tool
    tool_choice: str = setting("auto", TOOL_CHOICE, "tool choice", None,
                               doc='"none", "auto", "required" or a function to call (OpenAI\'s forms)',
                               rule=_checked(check_tool_choice))
    grammar: str | None = None  # the structure compiled for the bundle's tokenizer (by `Prompts.prepare`)
    prepared: bool = False  # by `Prompts.prepare`: its prompt as token ids (tools rendered), its grammar compiled

    @property
    def source(self) -> str:
        """The prompt form this request gives (a field name)."""
        return "prompt_ids" if self.prompt_ids is not None else "messages" if self.messages is not None else "prompt"

    @property
    def chat_like(self) -> bool:
        """Whether the prompt goes through the chat template (its default answer is longer)."""
        return self.messages is not None or (self.chat and self.prompt is not None)


SETTINGS: dict[str, Setting] = {f.name: f.metadata["setting"] for f in fields(Request) if "setting" in f.metadata}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Request)}
# where the library's (Session.stream's, the command line's) defaults differ from a wire request's
SESSION_DEFAULTS: dict[str, Any] = {"max_new_tokens": 128, "temperature": 0.0}
PROMPT_FIELDS = ("prompt", "prompt_ids", "messages")

WORDS: dict[str, str] = {"prompt": "the prompt", "prompt_ids": "prompt", "messages": "messages", "chat": "chat",
                         **{name: s.words for name, s in SETTINGS.items()}}


def wire_names(prompt: str) -> dict[str, str]:
    """Field -> its name in an HTTP body or a Triton request; `prompt`: the prompt text's."""
    return {"prompt": prompt, "prompt_ids": prompt, "messages": "messages", "chat": "chat",
            **{name: s.wire for name, s in SETTINGS.items() if s.wire is not None}}


def wire_labels(prompt: str) -> dict[str, str]:
    """How errors name the fields of an HTTP or Triton request: quoted wire names ('max_tokens')."""
    return {name: f"'{wire}'" for name, wire in wire_names(prompt).items()}


# -- validation -----------------------------------------------------------------------------------

def _brief(value) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text[:40]


def check_setting(name: str, value, limits: Limits | None, labels: Mapping[str, str] = WORDS):
    """One setting's value as the request keeps it, or a RequestError naming it. `limits` may
    be None for the settings whose rules need none (the sampling ones)."""
    s, label = SETTINGS[name], labels.get(name, name)
    if value is None and s.optional:
        return None
    if not s.kind.accepts(value):
        raise RequestError(f"{label} must be {s.kind.what}, got {_brief(value)}", name)
    value = s.kind.shape(value)
    problem = s.rule(value, limits)
    if problem:
        raise RequestError(f"{label} {problem}", name)
    return s.kind.keep(value)


def validate(given: Mapping[str, Any], limits: Limits, labels: Mapping[str, str] = WORDS) -> Request:
    """The request `given` describes (field -> value; an absent field takes its default),
    checked against `limits`. Cheap: nothing here tokenizes. Each error names its field as
    `labels` does."""
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"not fields of a request: {', '.join(sorted(unknown))}")
    label = lambda name: labels.get(name, name)  # noqa: E731
    forms = [name for name in PROMPT_FIELDS if given.get(name) is not None]
    if len(forms) != 1:
        raise RequestError("give one prompt: its text, its token ids or chat messages", forms[-1] if forms else "prompt")
    chat = given.get("chat", False)
    if not BOOLEAN.accepts(chat):
        raise RequestError(f"{label('chat')} must be a boolean, got {_brief(chat)}", "chat")
    prompt = {forms[0]: _check_prompt(forms[0], given[forms[0]], limits, label(forms[0]))}
    settings = {name: check_setting(name, given.get(name, DEFAULTS[name]), limits, labels) for name in SETTINGS}
    return Request(**prompt, chat=bool(chat), **settings)


def _check_prompt(name: str, value, limits: Limits, label: str):
    max_seq, max_chars = limits.max_seq, limits.max_chars
    if name == "prompt":
        if not isinstance(value, str):
            raise RequestError(f"{label} must be text, got {_brief(value)}", name)
        if len(value) > max_chars:
            raise RequestError(f"{label} has {len(value)} characters; at most {max_chars} can fit in the bundle's max "
                               f"sequence of {max_seq} tokens", name)
        problem = _not_unicode(value)
        if problem:
            raise RequestError(f"{label} {problem}", name)
        return value
    if name == "prompt_ids":
        if not isinstance(value, (list, tuple)) or not all(map(_is_int, value)):
            raise RequestError(f"{label} must be an array of token ids", name)
        if not value:
            raise RequestError(f"{label} is empty: give at least one token", name)
        if len(value) >= max_seq:
            raise RequestError(f"{label} of {len(value)} tokens is longer than the bundle's max sequence of {max_seq} "
                               f"(at most {max_seq - 1} prompt tokens)", name)
        top = limits.vocab if limits.vocab is not None else 1 << 63
        if not all(-(1 << 63) <= t < 1 << 63 for t in value):  # the graphs take int64 ids
            raise RequestError(f"{label} token ids must be integers in [0, the vocabulary size)", name)
        for i, t in enumerate(value):
            if not 0 <= t < top:
                raise RequestError(f"{label}: token id {_shown(t)} at prompt position {i} is outside the vocabulary "
                                   f"[0, {top})", name)
        return tuple(int(t) for t in value)
    # messages
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(m, Message) for m in value):
        raise RequestError(f"{label} must be a non-empty array of {{role, content}} turns", name)
    if len(value) >= max_seq:  # every turn costs the template at least one token
        raise RequestError(f"{label} holds {len(value)} turns; at most {max_seq - 1} fit in the bundle's max sequence "
                           f"of {max_seq} tokens", name)
    for m in value:
        for text in (m.role, m.content, *(t for call in m.tool_calls for t in call)):
            problem = _not_unicode(text) if isinstance(text, str) else "must hold text"
            if problem:
                raise RequestError(f"{label} {problem}", name)
    chars = sum(len(m.role) + len(m.content) + sum(map(len, (t for c in m.tool_calls for t in c))) for m in value)
    if chars > max_chars:
        raise RequestError(f"{label} hold {chars} characters; at most {max_chars} can fit in the bundle's max "
                           f"sequence of {max_seq} tokens", name)
    return tuple(value)


def fit(req: Request, prompt_ids: Sequence[int], limits: Limits, labels: Mapping[str, str] = WORDS) -> Request:
    """The request with its prompt as token ids (what its prompt tokenized to) and its new
    tokens resolved: the default when it gives none, capped to what fits. The checks that need
    the token count, each naming its field."""
    label = labels.get(req.source, req.source)
    n, max_seq = len(prompt_ids), limits.max_seq
    new = req.max_new_tokens
    if new is None:
        new = max(1, min(DEFAULT_MAX_TOKENS[req.chat_like], max_seq - n))
    if n == 0:
        raise RequestError(f"{label} is empty: it gives no tokens", req.source)
    if n >= max_seq:
        raise RequestError(f"{label} of {n} tokens is longer than the bundle's max sequence of {max_seq} "
                           f"(at most {max_seq - 1} prompt tokens)", req.source)
    if n + new > max_seq:
        raise RequestError(
            f"{labels.get('max_new_tokens', 'max_new_tokens')}: prompt of {n} tokens + {new} new tokens exceeds the "
            f"bundle's max sequence of {max_seq} (at most {max_seq - n} new tokens fit)", "max_new_tokens")
    return replace(req, prompt=None, messages=None, prompt_ids=tuple(int(t) for t in prompt_ids), max_new_tokens=new)
