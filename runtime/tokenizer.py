"""Text in and out: the bundle's tokenizer.json, its chat template, streaming decode."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from specdeploy.core.errors import InputError
from specdeploy.core.manifest import TokenizerEntry


class Tokenizer:
    def __init__(self, path: Path, spec: TokenizerEntry):
        self._tok = HFTokenizer.from_file(str(path))
        self.eos_token_ids: list[int] = list(spec.eos_token_ids)
        self.bos_token: str | None = spec.bos_token
        self.eos_token: str | None = spec.eos_token
        self.chat_template: str | None = spec.chat_template
        self._template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise InputError("this bundle's tokenizer has no chat template; pass the prompt without --chat")
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message):
                raise InputError(f"chat template: {message}")

            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, user_text: str) -> list[int]:
        # The template already carries any special tokens it wants (as Hugging Face does).
        return self.encode(self.apply_chat_template([{"role": "user", "content": user_text}]), add_special_tokens=False)


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
