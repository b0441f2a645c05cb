"""Text in and out: the bundle's tokenizer.json, its chat template, streaming decode."""
from __future__ import annotations

import json
import re
import secrets
import sys
import threading
import time
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from specdeploy.core.errors import BundleError, InputError
from specdeploy.core.manifest import TokenizerEntry

# Bounds on rendering a chat template (a bundle's template is code: a tampered one must not
# hang the CLI or the server's event loop, nor allocate without limit).
TEMPLATE_SECONDS = 1.0  # wall time for one render; the SmolLM2 template renders in well under 1 ms
TEMPLATE_MAX_RANGE = 10_000  # jinja2's sandbox allows range() up to 100 000 items
TEMPLATE_BASE_CHARS = 1 << 20  # any string the template builds, or its output, is at most this
# plus twice the characters of the messages it was given


class _TemplateLimit(Exception):
    """A render went past a bound; turned into a one-line InputError."""


class _Budget(threading.local):
    deadline: float | None = None
    chars: int = TEMPLATE_BASE_CHARS


_budget = _Budget()
_PERCENT_FIELD = re.compile(r"%[#0\- +]*(\d*)(?:\.(\d*))?")
_BRACE_FIELD = re.compile(r"\{[^{}]*\}")


def _check_len(n: int) -> None:
    if n > _budget.chars:
        raise _TemplateLimit(f"it built a string or list of {n} items (the bound is {_budget.chars})")


def _check_format(fmt, args) -> None:
    """A %- or {}-format whose field widths could allocate past the bound."""
    if isinstance(fmt, str):
        fields = [m.group(0) for m in _PERCENT_FIELD.finditer(fmt)] + _BRACE_FIELD.findall(fmt)
        for digits in (d for f in fields for d in re.findall(r"\d+", f)):
            if len(digits) > 12 or int(digits) > _budget.chars:
                raise _TemplateLimit(f"a format field width {digits[:20]} is past the bound ({_budget.chars})")
    if not (isinstance(fmt, str) and ("*" in fmt or re.search(r"\{[^{}]*\{", fmt))):
        return  # widths come only from the format string itself
    for a in args if isinstance(args, (tuple, list)) else (args,):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > _budget.chars:
            raise _TemplateLimit(f"a format argument {a} is past the bound ({_budget.chars})")


def _check_call(obj, args, kwargs) -> None:
    """String methods that can allocate far more than their input, checked before they run."""
    obj = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format / format_map
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, int):
                _check_len(a if name != "expandtabs" else a * max(1, owner.count("\t")) + len(owner))
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        count = owner.count(args[0]) if args[0] else len(owner) + 1
        _check_len(len(owner) + count * max(0, len(args[1]) - len(args[0])))
    elif name in ("format", "format_map"):
        _check_format(owner, list(args) + list(kwargs.values()))


def _check_binop(op: str, left, right) -> None:
    seq = (str, bytes, list, tuple)
    if op == "*":
        if isinstance(left, seq) and isinstance(right, int):
            _check_len(len(left) * right)
        elif isinstance(right, seq) and isinstance(left, int):
            _check_len(len(right) * left)
        elif isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > 4096:
            raise _TemplateLimit("it multiplied integers past 4096 bits")
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right * left.bit_length() > 4096:
            raise _TemplateLimit("it raised an integer to a power past 4096 bits")
    elif op == "+":
        if isinstance(left, seq) and isinstance(right, seq):
            _check_len(len(left) + len(right))
    elif op == "%" and isinstance(left, str):
        _check_format(left, right)


def _trace_template(frame, event, arg):
    """sys.settrace hook for the rendering thread: every line of template code checks the clock."""
    if _budget.deadline is not None and time.monotonic() > _budget.deadline:
        raise _TemplateLimit(f"it ran past {TEMPLATE_SECONDS:g} s")
    return _trace_template if frame.f_code.co_filename == "<template>" else None


def _sandbox():
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class _Generator(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: its result is checked too
            self.write("environment.checked_len(")
            super().visit_Concat(node, frame)
            self.write(")")

    class ChatSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = _Generator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            _check_call(__obj, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        @staticmethod
        def checked_len(s):
            _check_len(len(s))
            return s

    env = ChatSandbox(trim_blocks=True, lstrip_blocks=True)

    def capped_range(*args):
        rng = range(*args)
        if len(rng) > TEMPLATE_MAX_RANGE:
            raise SecurityError(f"range() of {len(rng)} items is past the bound ({TEMPLATE_MAX_RANGE})")
        return rng

    def raise_exception(message):
        raise InputError(f"chat template: {message}")

    env.globals.pop("lipsum", None)
    env.globals["range"] = capped_range
    env.globals["raise_exception"] = raise_exception
    base = env.filters
    for name in ("center", "indent"):
        def wide(s, *args, _f=base[name], **kwargs):
            width = args[0] if args else kwargs.get("width", 0)
            size = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
            _check_len(size * (1 + str(s).count("\n")) + len(str(s)))
            return _f(s, *args, **kwargs)

        env.filters[name] = wide

    def replace(eval_ctx, s, old, new, count=None, _f=base["replace"]):
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            n = s.count(old) if old else len(s) + 1
            _check_len(len(s) + n * max(0, len(new) - len(old)))
        return _f(eval_ctx, s, old, new, count)

    replace.jinja_pass_arg = base["replace"].jinja_pass_arg
    env.filters["replace"] = replace

    def format_(value, *args, _f=base["format"], **kwargs):
        _check_format(value, list(args) + list(kwargs.values()))
        return _f(value, *args, **kwargs)

    env.filters["format"] = format_
    return env


def _render(template, context: dict, input_chars: int) -> str:
    """Render with a wall-time bound and a bound on every string built and on the output."""
    from jinja2 import TemplateError

    _budget.chars = TEMPLATE_BASE_CHARS + 2 * input_chars
    _budget.deadline = time.monotonic() + TEMPLATE_SECONDS
    previous = sys.gettrace()
    sys.settrace(_trace_template)
    try:
        out, n = [], 0
        for piece in template.generate(**context):
            n += len(piece)
            if n > _budget.chars:
                raise _TemplateLimit(f"its output passed {_budget.chars} characters")
            out.append(piece)
        return "".join(out)
    except _TemplateLimit as e:
        raise InputError(f"chat template: stopped rendering, {e}; the bundle's template may be tampered with") from None
    except (TemplateError, MemoryError, RecursionError, OverflowError, ValueError, TypeError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise InputError(f"chat template: cannot render ({type(e).__name__}: {first[:200]})") from None
    finally:
        sys.settrace(previous)
        _budget.deadline = None


def _no_first_prefix(tok: HFTokenizer) -> HFTokenizer:
    """A copy whose Metaspace pre-tokenizer never adds its "first section" prefix space: for
    text that continues a string rather than starting one."""
    spec = json.loads(tok.to_str())
    changed = False

    def walk(node):
        nonlocal changed
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"] = "never"
                changed = True
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(spec.get("pre_tokenizer"))
    copy = HFTokenizer.from_str(json.dumps(spec)) if changed else HFTokenizer.from_str(tok.to_str())
    copy.encode_special_tokens = True
    return copy


def check_text(text, what: str) -> str:
    """`text` if it is a str that UTF-8 can carry (no lone surrogates), else a one-line InputError."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be text, got {type(text).__name__}")
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{what} is not valid Unicode text (a lone surrogate at character {e.start})") from None
    return text


class Tokenizer:
    def __init__(self, path: Path, spec: TokenizerEntry):
        self._tok = HFTokenizer.from_file(str(path))
        self.eos_token_ids: list[int] = list(spec.eos_token_ids)
        self.bos_token: str | None = spec.bos_token
        self.eos_token: str | None = spec.eos_token
        self.chat_template: str | None = spec.chat_template
        self._template = None
        # special tokens (id -> text); message text holding these stays text unless the operator allows it
        self.special_tokens: dict[int, str] = {
            i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }
        self._text_first = self._text_rest = None  # copies that read special-token strings as text
        self._lock = threading.Lock()

    def longest_token_chars(self) -> int:
        """Characters in the vocabulary's longest token string (special tokens included)."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=0)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _compiled(self):
        if not self.chat_template:
            raise InputError("this bundle's tokenizer has no chat template; pass the prompt without --chat")
        if self._template is None:
            from jinja2 import TemplateError

            try:
                self._template = _sandbox().from_string(self.chat_template)
            except TemplateError as e:
                first = (str(e).splitlines() or [type(e).__name__])[0]
                raise BundleError(f"chat template: not a valid Jinja template ({first[:200]})") from None
        return self._template

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self._render(messages, add_generation_prompt)

    def _render(self, messages, add_generation_prompt: bool) -> str:
        chars = sum(len(v) for m in messages if isinstance(m, dict) for v in m.values() if isinstance(v, str))
        context = dict(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        return _render(self._compiled(), context, chars)

    def _has_special(self, text: str) -> bool:
        return any(s in text for s in self.special_tokens.values())

    def _locate(self, messages, add_generation_prompt: bool, text: str):
        """Where each message's user-supplied text lies in the rendered `text`, as (start, end)
        spans, or None when the template's output cannot be matched piece by piece.

        The template is rendered a second time with a unique marker in place of every non-empty
        string of every message (a role only when it holds special-token text, since templates
        compare roles); the markers split that render into the template's own pieces, which must
        then appear in `text` in order, separated by each value as given or trimmed."""
        values: list[str] = []
        nonce = secrets.token_hex(8)
        while nonce in (self.chat_template or "") or any(
            nonce in v for m in messages if isinstance(m, dict) for v in m.values() if isinstance(v, str)
        ):
            nonce = secrets.token_hex(8)
        mark = f"\ue000{nonce}:"

        def marked(m):
            if not isinstance(m, dict):
                return m
            out = {}
            for k, v in m.items():
                if isinstance(v, str) and v and (k != "role" or self._has_special(v)):
                    out[k] = f"{mark}{len(values)}\ue001"
                    values.append(v)
                else:
                    out[k] = v
            return out

        layout = self._render([marked(m) for m in messages], add_generation_prompt)
        parts = re.split(re.escape(mark) + r"(\d+)\ue001", layout)
        if not text.startswith(parts[0]):
            return None
        pos, spans = len(parts[0]), []
        for i in range(1, len(parts), 2):
            v, after = values[int(parts[i])], parts[i + 1]
            for shown in dict.fromkeys((v, v.strip(), v.rstrip(), v.lstrip())):
                if text.startswith(shown, pos) and text.startswith(after, pos + len(shown)):
                    spans.append((pos, pos + len(shown)))
                    pos += len(shown) + len(after)
                    break
            else:
                return None
        return spans if pos == len(text) else None

    def _as_text(self, text: str, first: bool) -> list[int]:
        if self._text_first is None:
            with self._lock:
                if self._text_first is None:
                    first_tok = HFTokenizer.from_str(self._tok.to_str())
                    first_tok.encode_special_tokens = True
                    self._text_rest = _no_first_prefix(self._tok)
                    self._text_first = first_tok
        tok = self._text_first if first else self._text_rest
        return tok.encode(text, add_special_tokens=False).ids

    def encode_messages(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, allow_special_in_content: bool = False
    ) -> list[int]:
        """A chat through the chat template, as token ids.

        Special tokens come only from the template: special-token strings inside a message's
        content (or role) stay text, so a user cannot forge turns. The ids equal those of the
        whole rendered text whenever the messages hold no special-token text; otherwise the text
        is encoded in the pieces between the template's own special tokens, each with the
        special-token strings in it read as text. `allow_special_in_content=True` parses special
        tokens anywhere (the operator's choice; what encoding the rendered text whole does).
        """
        text = self._render(messages, add_generation_prompt)
        enc = self._tok.encode(text, add_special_tokens=False)
        if allow_special_in_content:
            return enc.ids
        specials = [(t, s, e) for t, (s, e) in zip(enc.ids, enc.offsets) if t in self.special_tokens]
        if not specials:
            return enc.ids
        spans = self._locate(messages, add_generation_prompt, text)
        if spans is None:
            # The template reshapes message text beyond trimming: its spans cannot be found.
            # Safe only when no message holds special-token text.
            for m in messages:
                for k, v in (m.items() if isinstance(m, dict) else ()):
                    if isinstance(v, str) and self._has_special(v):
                        raise InputError(
                            f"message {k} holds special-token text and this bundle's chat template reshapes "
                            "message text, so it cannot be kept as text; remove it"
                        )
            return enc.ids

        def own(t, s, e):  # a special token the template itself wrote
            return text[s:e] == self.special_tokens[t] and not any(s < b and a < e for a, b in spans)

        if all(own(*x) for x in specials):
            return enc.ids
        ids, pos = [], 0
        for t, s, e in specials:
            if own(t, s, e):
                ids += self._as_text(text[pos:s], first=pos == 0)
                ids.append(t)
                pos = e
        ids += self._as_text(text[pos:], first=pos == 0)
        return ids

    def encode_chat(self, user_text: str, allow_special_in_content: bool = False) -> list[int]:
        # The template already carries any special tokens it wants (as Hugging Face does).
        return self.encode_messages(
            [{"role": "user", "content": user_text}], allow_special_in_content=allow_special_in_content
        )


class TextStream:
    """Turns a growing list of token ids into text pieces that never split a character.

    A character whose UTF-8 bytes span several tokens decodes to U+FFFD until its last
    byte arrives; such a piece is held back until it completes. Decoding starts a few
    tokens back so tokenizers that drop a leading space on the first token still join
    words correctly.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # tokens already turned into emitted text

    def push(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read])
        text = decode(self.ids[self._prefix :])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before) :]
