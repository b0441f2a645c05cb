"""Text in and out: the bundle's tokenizer.json, its chat template, streaming decode."""
from __future__ import annotations

import json
import os
import re
import secrets
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from specdeploy.core.chat_template import render as render_template
from specdeploy.core.errors import BundleError, InputError
from specdeploy.core.manifest import TokenizerEntry


def _library_failure(e: BaseException, path) -> BundleError:
    """The tokenizers library's own failure (an exception, or a Rust panic, which Python sees as
    a BaseException) as the one-line error of the bundle file that caused it."""
    first = (str(e).splitlines() or [""])[0][:200]
    return BundleError(f"{path}: the tokenizer failed ({type(e).__name__}: {first}); re-export the bundle")


@contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for a moment: what a Rust panic writes goes there."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


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
        self.path = path
        try:  # a file that is not a tokenizer, or whose rules make the library panic, fails here
            self._tok = HFTokenizer.from_file(str(path))
            with _quiet_stderr():  # a panic's own report (and backtrace) would precede our one line
                self._tok.decode(self._tok.encode("Check 0123 \u00e4\u00df \u4e2d \U0001f600 <|x|>\n").ids)
        except Exception as e:
            raise _library_failure(e, path) from None
        except BaseException as e:  # pyo3's PanicException is not an Exception
            if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            raise _library_failure(e, path) from None
        self.eos_token_ids: list[int] = list(spec.eos_token_ids)
        self.bos_token: str | None = spec.bos_token
        self.eos_token: str | None = spec.eos_token
        self.chat_template: str | None = spec.chat_template
        # special tokens (id -> text); message text holding these stays text unless the operator allows it
        self.special_tokens: dict[int, str] = {
            i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }
        self._text_first = self._text_rest = None  # copies that read special-token strings as text
        self._lock = threading.Lock()

    def size(self) -> int:
        """Its token ids, special tokens included (0 .. size-1)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def longest_token_chars(self) -> int:
        """Characters in the vocabulary's longest token string (special tokens included)."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=0)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except BaseException as e:  # a panic on this text (see __init__)
            if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError)):
                raise
            raise _library_failure(e, self.path) from None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        try:
            return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError)):
                raise
            raise _library_failure(e, self.path) from None

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self._render(messages, add_generation_prompt)

    def _render(self, messages, add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        chars = sum(len(v) for m in messages if isinstance(m, dict) for v in m.values() if isinstance(v, str))
        context = dict(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        if tools:
            context["tools"] = tools
            chars += len(json.dumps(tools))
        if not self.chat_template:
            raise InputError("this bundle's tokenizer has no chat template; pass the prompt without --chat")
        return render_template(self.chat_template, context, chars)

    def _has_special(self, text: str) -> bool:
        return any(s in text for s in self.special_tokens.values())

    def _locate(self, messages, add_generation_prompt: bool, text: str, tools=None):
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

        layout = self._render([marked(m) for m in messages], add_generation_prompt, tools)
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
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, allow_special_in_content: bool = False,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """A chat through the chat template, as token ids.

        Special tokens come only from the template: special-token strings inside a message's
        content (or role) stay text, so a user cannot forge turns. The ids equal those of the
        whole rendered text whenever the messages hold no special-token text; otherwise the text
        is encoded in the pieces between the template's own special tokens, each with the
        special-token strings in it read as text. `allow_special_in_content=True` parses special
        tokens anywhere (the operator's choice; what encoding the rendered text whole does).
        `tools`: function definitions the template renders (their text holds no special tokens:
        the caller checks).
        """
        text = self._render(messages, add_generation_prompt, tools)
        enc = self._tok.encode(text, add_special_tokens=False)
        if allow_special_in_content:
            return enc.ids
        specials = [(t, s, e) for t, (s, e) in zip(enc.ids, enc.offsets) if t in self.special_tokens]
        if not specials:
            return enc.ids
        spans = self._locate(messages, add_generation_prompt, text, tools)
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
