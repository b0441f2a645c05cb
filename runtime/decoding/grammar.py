"""Structured output: a request's structure (a JSON schema, any JSON object, a regular
expression, a Lark grammar, a choice of strings), compiled by llguidance against the bundle's
tokenizer, and each generation's `Constraint`: the token mask of every verify row (the state
advanced along the drafts on a copy), where a draft leaves the grammar, the tokens it forces.

Speculation keeps constrained output exact because the mask is applied to each row under the
tokens before it (the committed ones, then the drafts), as a single step would apply it: a row
after a draft the grammar forbids is never read (the draft is rejected there for certain).
llguidance was chosen over xgrammar for its footprint (numpy; xgrammar imports torch, which the
runtime never does), its draft validation and its forced tokens; both compute a mask for
SmolLM2's 49k-token vocabulary in tens of microseconds on this CPU (results/structured/).
"""
from __future__ import annotations

import functools
import json

import numpy as np

from specdeploy.runtime.decoding.request import RequestError, Structure

COMPILED = 64  # grammars kept compiled per bundle


@functools.lru_cache(maxsize=4)
def _llguidance():
    import llguidance  # imported on the first constrained request: the runtime's import stays lean
    import llguidance.numpy  # noqa: F401

    return llguidance


class Grammars:
    """A bundle's grammar compiler: its tokenizer as llguidance reads it (built once, about a
    second for a 49k vocabulary), and the grammars requests ask for, checked before any work."""

    def __init__(self, tokenizer_json: str, vocab: int, tokenizer_size: int, eos_token_ids):
        """`vocab`: the graph's logits per row; `tokenizer_size`: the tokenizer's ids (either may
        be the larger: a graph padded past the tokenizer, a tiny model's head short of it)."""
        llg = _llguidance()
        self.vocab = vocab
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=max(vocab, tokenizer_size),
                                         eos_token=sorted(eos_token_ids) or None)
        self._compiled: dict[Structure, str] = {}  # the last requests' (a service asks for a few, often)

    def compile(self, structure: Structure, label: str = "structure", field: str = "structure") -> str:
        """The llguidance grammar of `structure`, or a RequestError for the request's `field` (its
        message led by `label`) that says what the engine refused (a schema it cannot compile, a
        regex or a grammar with an error)."""
        grammar = self._compiled.get(structure)
        if grammar is None:
            grammar = self._compile(structure, label, field)
            if len(self._compiled) >= COMPILED:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[structure] = grammar
        return grammar

    def _compile(self, structure: Structure, label: str, field: str) -> str:
        llg = _llguidance()
        kind, source = structure
        try:
            if kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(source)
            elif kind == "json_object":
                grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"})
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(source)
            elif kind == "grammar":
                grammar = llg.LLMatcher.grammar_from_lark(source)
            else:  # choice: a Lark alternation of literal strings
                grammar = llg.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in json.loads(source)))
        except ValueError as e:
            raise RequestError(f"{label}: {_first_line(e)}", field) from None
        problem = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise RequestError(f"{label}: the {kind.replace('_', ' ')} does not compile: {_first_line(problem)}", field)
        return grammar

    def constraint(self, grammar: str) -> "Constraint":
        return Constraint(_llguidance().LLMatcher(self.tokenizer, grammar, log_level=0), self.vocab,
                          self.tokenizer.vocab_size)


def _first_line(problem) -> str:
    lines = [line.strip() for line in str(problem).splitlines() if line.strip()]
    return " / ".join(lines[:2])[:300] if lines else "refused"


class Constraint:
    """One generation's grammar state (an llguidance matcher): what each row may be, where a
    draft leaves the grammar, what the grammar forces. Holds exactly the committed tokens.
    Drafts are looked at on copies of it (`deep_copy`, under a microsecond), never by consuming
    and rolling back: on llguidance 1.9.1 a matcher rolled back after a regex's bounded
    repetition refused a token a fresh matcher over the same tokens took (tests/test_structured.py)."""

    def __init__(self, matcher, vocab: int, ids: int):
        self.matcher, self.vocab = matcher, vocab  # masks of `vocab` logits; the matcher's own of `ids`
        self.bitmask = _llguidance().numpy.allocate_token_bitmask(1, ids)
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise RuntimeError(f"grammar matcher: {self.matcher.get_error()}")

    def allowed(self, matcher=None) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next (after `matcher`'s tokens: ours)."""
        _llguidance().numpy.fill_next_token_bitmask(matcher or self.matcher, self.bitmask)
        return np.unpackbits(self.bitmask[0].view(np.uint8), bitorder="little")[: self.vocab].view(bool)

    def valid(self, tokens: np.ndarray, after: np.ndarray | None = None) -> int:
        """How many leading `tokens` the grammar allows in turn (after the tokens `after`)."""
        if not tokens.shape[0]:
            return 0
        matcher = self.matcher
        if after is not None and after.shape[0]:
            matcher = self._ahead(after)
        return matcher.validate_tokens(tokens.tolist())

    def masks(self, drafts: np.ndarray) -> list[np.ndarray]:
        """The masks of the rows a chain verify pass over `drafts` gives, up to the row that
        judges the first draft the grammar forbids (the rows after it are never read)."""
        n = self.valid(drafts)
        out = [self.allowed()]
        if n:
            ahead = self.matcher.deep_copy()
            for token in drafts[:n].tolist():
                ahead.consume_token(token)
                out.append(self.allowed(ahead))
        return out

    def _ahead(self, tokens: np.ndarray):
        """A copy of the matcher moved on by `tokens` (drafts are looked at on copies: the
        matcher itself only ever takes committed tokens, and is never rolled back)."""
        ahead = self.matcher.deep_copy()
        for token in tokens.tolist():
            if ahead.is_stopped() or not ahead.consume_token(token):
                break
        return ahead

    def forced(self) -> list[int]:
        """The tokens the grammar allows alone, one after another from here (empty: a choice)."""
        return self.matcher.compute_ff_tokens()

    def commit(self, tokens) -> None:
        for token in tokens:
            if self.matcher.is_stopped():  # complete: it allowed an EOS alone, which ends the generation
                return
            if not self.matcher.consume_token(int(token)):
                self._check()


def mask_rows(logits: np.ndarray, masks: list[np.ndarray]) -> np.ndarray:
    """logits [R, V] with each of the first len(masks) rows' forbidden tokens at -inf (a copy)."""
    out = np.array(logits, dtype=np.float32)
    for i, allowed in enumerate(masks):
        out[i] = np.where(allowed, out[i], np.float32(-np.inf))  # 20-50 us a row of 49k (a boolean store: 130)
    return out
