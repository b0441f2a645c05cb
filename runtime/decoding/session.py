"""What a service embeds: load a bundle once, then stream or collect generations."""
from __future__ import annotations

import functools
import json
import threading
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from specdeploy.core.errors import BundleError, InputError
from specdeploy.core.manifest import Bundle, load_bundle

from specdeploy.runtime.backends import BackendChoice, Device, make_engine
from specdeploy.runtime.backends.ort import settle_thread_pool, thread_pool_choice
from specdeploy.runtime.decoding.accept import Judge, TokenLogprob
from specdeploy.runtime.decoding.grammar import Grammars
from specdeploy.runtime.decoding.tools import (CLOSE, MISTRAL_CALLS, OPEN, ToolCall, call_grammar, parse_calls,
                                               tool_format)
from specdeploy.runtime.decoding.drafters import check_backend, make_drafter
from specdeploy.runtime.decoding.loop import DecodeSettings, PromptCache, decode
from specdeploy.runtime.decoding.policy import DraftLength, TreeSize
from specdeploy.runtime.decoding.request import (
    Message, MAX_TREE_NODES, SESSION_DEFAULTS, message_of, WORDS, Limits, Request, RequestError, Structure, fit,
    validate,
)
from specdeploy.runtime.decoding.stats import Stats, finish_reason
from specdeploy.runtime.decoding.sampling import SamplingParams
from specdeploy.runtime.decoding.stops import StopMatcher
from specdeploy.runtime.decoding.tokenizer import TextStream, Tokenizer, check_text


@dataclass
class Result:
    text: str
    token_ids: list[int]
    stats: Stats


@dataclass
class Piece:
    """One streamed piece: the text it completes, the token ids of its round and, where the
    request asks for them, their log probabilities (one per id)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class Generation:
    """A running generation: iterate it for pieces; `stats` fills as it goes.

    `cancel()` (from any thread) ends it before its next round. `close()` (from any thread)
    ends it at once, or, while another thread is inside a round, as soon as that round
    returns, so a server can let go of a generation whose client left without waiting for
    the thread that runs it. Either, before the rounds run out, leaves finish reason
    "cancelled", and frees the session for the next request. One thread at a time iterates
    it (a round runs in `next()`).
    """

    def __init__(self, pieces: Iterator[Piece], stats: Stats, finish: Callable[[bool], str], on_end=None):
        self._pieces = pieces
        self.stats = stats
        self._finish = finish  # cancelled -> the finish reason, recorded once, when it ends
        self.cancelled = threading.Event()
        self._on_end = on_end
        self._ended = False
        self._state = threading.Lock()  # guards _running, _close_requested, _ended
        self._running = False  # a thread is inside a round
        self._close_requested = False
        self._superseded = False  # ended because another generation started on its session

    def __iter__(self) -> Iterator[Piece]:
        return self

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # whatever left the block: the session is free again

    def supersede(self) -> bool:
        """End this generation because another starts on its session; False if a round is
        running now (another thread is inside it)."""
        with self._state:
            if self._running:
                return False
            self._superseded = not self._ended
            self._end(cancelled=True)
            return True

    def __next__(self) -> Piece:
        with self._state:
            if self._superseded:
                self._superseded = False  # said once; then it reads as ended
                raise InputError("this generation was ended: another one started on its session (a session runs "
                                 "one at a time; see SessionPool)")
            if self._ended:
                raise StopIteration
            if self._running:
                raise RuntimeError("this generation is already running a round in another thread")
            if self.cancelled.is_set() or self._close_requested:
                self._end(cancelled=True)
                raise StopIteration
            self._running = True
        try:
            piece = next(self._pieces)
        except BaseException:  # the end (StopIteration), or a failure: free the session either way
            with self._state:
                self._running = False
                self._end(cancelled=False)
            raise
        with self._state:
            self._running = False
            if self._close_requested:  # closed from another thread during this round
                self._end(cancelled=True)
        return piece

    @property
    def ended(self) -> bool:
        return self._ended

    def cancel(self) -> None:
        self.cancelled.set()

    def __del__(self):  # a generation dropped unread still frees its session
        try:
            self.close()
        except Exception:
            pass

    def close(self) -> None:
        with self._state:
            if self._running:
                self._close_requested = True  # the thread inside the round ends it on return
            else:
                self._end(cancelled=True)

    def _end(self, cancelled: bool) -> None:
        """With `_state` held: close the rounds and give the session back, once."""
        if self._ended:
            return
        self._ended = True
        self.stats.finish_reason = self._finish(cancelled)  # cancelled: before its rounds ran out
        try:
            self._pieces.close()
        finally:
            if self._on_end is not None:
                self._on_end()


class TextCut:
    """A generation's committed tokens as text pieces (valid UTF-8 each), cut at the first stop
    string; `met` records whether they met a stop string or an EOS (the finish reason's facts).
    Fed in the thread that runs the rounds, so a stop string ends the generation in the round
    that meets it."""

    def __init__(self, tokenizer: Tokenizer, stop, eos_token_ids):
        self.stops = StopMatcher(list(stop))
        self.text = TextStream(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.met = {"stop": False, "eos": False}

    def push(self, new: np.ndarray) -> Piece:
        """A round's tokens as a piece; after it, `met["stop"]` says whether the text ends here."""
        self.met["eos"] = int(new[-1]) in self.eos_token_ids  # a round ends at its first EOS
        out, self.met["stop"] = self.stops.feed(self.text.push(new))
        return Piece(out, new.tolist())

    def flush(self) -> Piece | None:
        """The text held back (an incomplete character, a possible stop string's start) once the
        rounds have ended without a stop string; None if there is none."""
        out, self.met["stop"] = self.stops.feed(self.text.flush())
        out += "" if self.met["stop"] else self.stops.flush()
        return Piece(out, []) if out else None


def text_pieces(rounds: Iterator[np.ndarray], cut: TextCut, judge: Judge | None = None) -> Iterator[Piece]:
    """A generation's rounds as text pieces, through `cut`: closed at its first stop string.
    `judge`: the rounds' judge, whose logprobs each piece carries."""
    for new in rounds:
        piece = cut.push(new)
        piece.logprobs = judge.take(new.shape[0]) if judge is not None else None
        if cut.met["stop"]:
            rounds.close()
            yield piece
            return
        yield piece
    last = cut.flush()
    if last is not None:
        yield last


class Prompts:
    """What turns a request into prompt token ids under a bundle's limits: shared by `Session`
    and the batched scheduler (runtime/decoding/batch.py). Needs `bundle`, `tokenizer` and a
    `target` with `vocab_size`."""

    # -- prompt handling -------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        check_text(prompt, "the prompt")
        return self.tokenizer.encode_chat(prompt) if chat else self.tokenizer.encode(prompt)

    def encode_messages(self, messages: list[dict[str, str]], allow_special_in_content: bool = False,
                        tools: list[dict] | None = None) -> list[int]:
        """A whole chat (system / user / assistant / tool turns) through the chat template, with
        the `tools` it may call. Special-token text inside a message stays text (a user cannot
        forge a turn) unless allowed."""
        for i, m in enumerate(messages):
            check_text(m["role"], f"messages[{i}].role")
            check_text(m["content"], f"messages[{i}].content")
        return self.tokenizer.encode_messages(messages, add_generation_prompt=True,
                                              allow_special_in_content=allow_special_in_content, tools=tools)

    # -- requests ------------------------------------------------------------------------
    @functools.cached_property
    def limits(self) -> Limits:
        """What this session's requests are checked against (the request schema's Limits)."""
        return Limits.of(self)

    def prepare(self, req: Request, labels: Mapping[str, str] = WORDS) -> Request:
        """A validated request with its prompt as token ids (through the chat template when it
        asks) and its new tokens resolved, checked against the max sequence (request.fit);
        errors name the fields as `labels` does."""
        if req.prepared:
            return req
        tools = self._tools(req, labels)
        if req.prompt_ids is not None:
            ids = req.prompt_ids
        elif req.messages is not None:
            ids = self.encode_messages([m.for_template() for m in req.messages], tools=tools)
        elif tools is not None:
            ids = self.encode_messages([{"role": "user", "content": req.prompt}], tools=tools)
        else:
            ids = self.encode(req.prompt, req.chat)
        req = fit(req, ids, self.limits, labels)
        if tools is not None and req.tool_choice != "auto":  # "required" or a name: the grammar makes the call
            if req.structure is not None:
                raise RequestError(f"{labels.get('tool_choice', 'tool_choice')} {req.tool_choice!r} writes a tool "
                                   "call: it cannot be given with a structure", "tool_choice")
            req = replace(req, structure=Structure("grammar", call_grammar(req.tools, req.tool_choice, self.tool_form,
                                                                           self.tokenizer.special_tokens)))
        if req.structure is not None:
            req = replace(req, grammar=self.grammars.compile(req.structure, labels.get("structure", "structure")))
        return replace(req, prepared=True)

    def _tools(self, req: Request, labels: Mapping[str, str]) -> list[dict] | None:
        """The request's tools as the chat template takes them (None: no tools, or tool choice
        "none"), after the checks that need the bundle: a template that reads them in the form
        parsed here, a choice among them, schemas the grammar engine compiles."""
        if req.tools is None and req.tool_choice not in ("auto", "none"):
            raise RequestError(f"{labels.get('tool_choice', 'tool_choice')} {req.tool_choice!r} needs tools",
                               "tool_choice")
        if req.tools is None or req.tool_choice == "none":
            return None
        label = labels.get("tools", "tools")
        if req.prompt_ids is not None or (req.prompt is not None and not req.chat):
            raise RequestError(f"{label} need a chat (messages, or a prompt through the chat template)", "tools")
        form = self.tool_form
        if form is None:
            raise RequestError(f"{label}: this bundle's chat template has no tool format", "tools")
        if not form:
            raise RequestError(f"{label}: this bundle's chat template writes tool calls in a form not read here "
                               f"(read: Hermes' {OPEN} JSON {CLOSE}, Llama 3's JSON with \"parameters\", Mistral's "
                               f"{MISTRAL_CALLS} [JSON])", "tools")
        tools = [json.loads(t) for t in req.tools]
        for i, tool in enumerate(tools):
            text = req.tools[i]
            if any(special in text for special in self.tokenizer.special_tokens.values()):
                raise RequestError(f"{label}[{i}] holds special-token text; remove it", "tools")
            self.grammars.compile(Structure("json_schema", json.dumps(tool["function"]["parameters"])),
                                  f"{label}[{i}].function.parameters", "tools")
        if req.tool_choice not in ("auto", "required") and req.tool_choice not in {
                t["function"]["name"] for t in tools}:
            raise RequestError(f"{labels.get('tool_choice', 'tool_choice')}: no tool is named {req.tool_choice!r}",
                               "tool_choice")
        return tools

    def tool_text(self, token_ids) -> str:
        """An answer's text with special tokens kept (a template's tool-call markers may be special
        tokens), its EOS left out: what tool calls are parsed from."""
        eos = set(self.eos_token_ids)
        return self.tokenizer.decode([t for t in token_ids if t not in eos], skip_special_tokens=False)

    def tool_calls(self, token_ids) -> tuple[str, list[ToolCall]]:
        """An answer's tool calls: -> (the content outside the calls, the calls)."""
        content, calls = parse_calls(self.tool_text(token_ids), self.tool_form or "")
        return content.strip() if calls else content, calls

    @functools.cached_property
    def tool_form(self) -> str | None:
        """The chat template's tool format (tools.tool_format)."""
        return tool_format(self.tokenizer.chat_template)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The bundle's grammar compiler (built on the first constrained request)."""
        return Grammars(self.tokenizer.path.read_text(encoding="utf-8"), self.target.vocab_size, self.tokenizer.size(),
                        self.eos_token_ids)

    def request(self, prompt: str | None = None, *, prompt_ids=None, chat: bool = False,
                max_new_tokens: int = SESSION_DEFAULTS["max_new_tokens"], draft_len: int | str | None = "auto",
                speculate: bool = True, temperature: float = SESSION_DEFAULTS["temperature"], top_k: int = 0,
                top_p: float = 1.0, seed: int | None = None, stop: list[str] | tuple[str, ...] = (),
                tree_nodes: int | str | None = "auto", private: bool = False, min_p: float = 0.0,
                presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                logprobs: int | None = None, structure=None, messages=None, tools=None,
                tool_choice="auto") -> Request:
        """`stream`'s arguments as a Request, checked by the request schema (what a server refuses,
        this refuses)."""
        req = validate(dict(
            prompt=prompt, prompt_ids=None if prompt_ids is None else _as_ids(prompt_ids), chat=chat,
            max_new_tokens=max_new_tokens, draft_len=_auto_or_int(draft_len, "draft_len"), speculate=speculate,
            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=stop,
            tree_nodes=_auto_or_int(tree_nodes, "tree_nodes"), private=private, min_p=min_p,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty, logprobs=logprobs, structure=structure,
            messages=None if messages is None else tuple(_message(m) for m in messages), tools=tools,
            tool_choice=tool_choice,
        ), self.limits)
        return req

    def check_request(self, prompt_ids: np.ndarray, max_new_tokens: int, draft_len: int) -> None:
        """What `stream` checks of prompt token ids, new tokens and a draft length."""
        req = validate(dict(prompt_ids=_as_ids(prompt_ids), max_new_tokens=max_new_tokens, draft_len=draft_len),
                       self.limits)
        self.prepare(req)



class Session(Prompts):
    """A bundle loaded once, with its engines' buffers allocated once.

    A session runs one generation at a time (its KV buffers are its state). Starting a second
    while another thread is inside a round of the first is an error; starting one while the
    first is paused between rounds ends the first (its next read says so), so a generation
    its caller abandoned never holds the session. For concurrent callers use `SessionPool`.
    """

    def __init__(
        self, bundle: str | Path | Bundle, threads: int | None = None, verify: bool = True, backend: str = "ort",
        prompt_cache: bool = True, device: str | Device | None = None, trt_ep: bool = False,
        thread_pool: str | None = None, digest: str | None = None,
    ):
        """`prompt_cache`: a generation whose prompt begins with tokens the KV buffers already
        hold (the previous prompt and answer: a chat's system prompt, its earlier turns)
        prefills only the rest (`Stats.cached_tokens` counts the reused ones). Off, every
        prompt is prefilled whole: what a benchmark comparing runs of one prompt wants.

        `device`: cpu, cuda or cuda:N (the ort and torch backends; None: the backend's own
        default, the CPU for ort). `trt_ep`: ort on CUDA through ONNX Runtime's TensorRT
        execution provider, falling back to its CUDA provider where TensorRT is missing.

        `thread_pool` (ort on the CPU): "auto" (None: $SPECDEPLOY_THREAD_POOL, else auto) runs
        target and draft on the process's one ONNX Runtime thread pool where the bundle has a
        draft graph, the fast configuration; "own" gives each engine a pool of its own (for a
        process whose other ONNX Runtime sessions want their own threads); "shared" always
        shares. See runtime.backends.ort.settle_thread_pool.

        `digest` ("sha256:...", as `specdeploy inspect` prints it): the bundle must be exactly
        that one, its manifest (system prompt, chat template, settings) included."""
        choice = BackendChoice.of(backend, device, trt_ep)  # checked before the bundle is read
        pool = thread_pool_choice(thread_pool)
        if isinstance(bundle, Bundle):
            if digest is not None and bundle.digest != digest:
                raise BundleError(f"{bundle.path}: bundle digest {bundle.digest} is not the {str(digest)[:80]} required")
            self.bundle = bundle
        else:
            self.bundle = load_bundle(bundle, verify=verify, digest=digest)
        b = self.bundle
        b.check_memory()  # before any buffer is allocated
        on_cpu_ort = choice.name == "ort" and (choice.device is None or choice.device.kind == "cpu")
        self.thread_pool = settle_thread_pool(pool, threads, b.model("draft") is not None) if on_cpu_ort else None
        self.cache = PromptCache(b.max_seq) if prompt_cache else None
        self.tokenizer = Tokenizer(b.file(b.tokenizer.file), b.tokenizer)
        self.backend = choice.name
        self.choice = choice
        check_backend(b, choice.name)  # a drafter that runs on some backends only
        self.target = make_engine(choice, b, b.model("target"), threads)
        self.drafter = make_drafter(b, choice, threads)  # the drafters pass the choice on to make_engine
        _attach(self.drafter, self.target)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self._auto: DraftLength | None = None  # the last greedy `auto` policy: the next one starts from it
        self._auto_tree: TreeSize | None = None
        self._busy = threading.Lock()
        self._current: Callable[[], Generation | None] | None = None  # the last generation started (a weak reference)

    def fork(self) -> "Session":
        """Another session over the same loaded weights, with its own KV buffers."""
        twin = object.__new__(Session)
        twin.__dict__.update(self.__dict__)
        twin.target = self.target.fork()
        twin.cache = PromptCache(self.bundle.max_seq) if self.cache is not None else None
        twin.drafter = self.drafter.fork() if self.drafter is not None else None
        _attach(twin.drafter, twin.target)
        twin.eos_token_ids = list(self.eos_token_ids)
        twin._auto = None
        twin._auto_tree = None
        twin._busy = threading.Lock()
        twin._current = None
        return twin

    # -- generation ----------------------------------------------------------------------
    def stream(self, prompt: str | None = None, **kwargs) -> Generation:
        """Start a generation; iterate the result for text pieces (valid UTF-8 each).

        draft_len: an int pins k; "auto" (or None) lets the runtime choose each round.
        tree_nodes: with a drafter that proposes token trees and a target that verifies them,
        "auto" (with draft_len auto) chooses the tree each round, an int N >= 2 verifies trees
        of up to N nodes (depth up to draft_len), 1 keeps chains.
        private: the drafter draws only on this request's own text, and keeps none of it for
        later requests (a shared suffix index).
        temperature 0 is greedy; with a seed, sampling replays exactly. min_p and the
        presence, frequency and repetition penalties as OpenAI's and vLLM's APIs define them.
        logprobs: each piece carries its tokens' log probabilities, with that many alternatives.
        structure: what the text must match, one of {"json": a JSON schema}, {"json_object": True},
        {"regex": ...}, {"grammar": a Lark grammar}, {"choice": [strings]} (grammar.py).
        messages (a chat, OpenAI's turns), tools and tool_choice (OpenAI's forms: tools.py); an
        answer's calls: `tool_calls(token_ids)`.
        The keywords are those of `request`.

        The arguments are checked by the request schema (runtime/decoding/request.py) before
        anything else: what a server refuses, this refuses.
        """
        return self.start(self.request(prompt, **kwargs))

    def start(self, req: Request) -> Generation:
        """Start the generation of a request `validate` passed against this session's limits (a
        server's, checked before it waited for a session); `stream` takes the same as arguments."""
        req = self.prepare(req)
        ids = np.asarray(req.prompt_ids, dtype=np.int64)
        draft_len, tree_nodes, speculate = req.draft_len, chain_nodes(req), req.speculate
        params = SamplingParams.of(req)
        if draft_len == "auto":
            cost = self.drafter.cost_ratio if self.drafter is not None else 0.0
            lengths = DraftLength(self.bundle.max_draft, cost_ratio=cost, measure=params.greedy)
            if speculate:
                lengths.carry_from(self._auto)
            k = self.bundle.max_draft
        else:
            k = draft_len
            lengths = DraftLength(self.bundle.max_draft, fixed=k)
        drafter = self.drafter if speculate and k > 0 else None
        tree = self._tree_policy(tree_nodes, draft_len, drafter, params) if drafter is not None else None
        if tree is not None:
            lengths = DraftLength(k, fixed=k)  # the tree's depth
        self._take()
        try:
            return self._begin(req, ids, drafter, params, lengths, tree)
        except BaseException:  # nothing started: the session is free again
            self._busy.release()
            raise

    def _take(self) -> None:
        """The session for a new generation. One paused between rounds (its caller stopped
        reading it, or dropped it while an exception holds it) is ended first: its next read
        says why. One inside a round (another thread) is an error: a session runs one at a time."""
        if self._busy.acquire(blocking=False):
            return
        previous = self._current() if self._current is not None else None
        if previous is None or not previous.supersede():
            raise InputError("this session is already generating in another thread; use one session per request "
                             "(see SessionPool)")
        if not self._busy.acquire(timeout=5):  # released by the superseded generation's end
            raise InputError("this session did not come free; use one session per request (see SessionPool)")

    def _begin(self, req: Request, ids: np.ndarray, drafter, params: SamplingParams, lengths: DraftLength,
               tree: TreeSize | None) -> "Generation":
        max_new_tokens, stop = req.max_new_tokens, req.stop
        if drafter is not None and drafter.keeps_history:
            drafter.private = req.private
        if req.speculate and lengths.measure and lengths.fixed is None:
            self._auto = lengths  # updated as this generation runs; the next starts from it
        if tree is not None and tree.measure and tree.fixed is None:
            self._auto_tree = tree
        stats = Stats()
        # A private request reads no prompt cache and leaves none (its passes invalidate it): no later
        # request's cached_tokens, or its prefill time, can tell what it shared with this prompt.
        settings = DecodeSettings(max_new_tokens, self.eos_token_ids, self.bundle.prefill_chunk, params, lengths, tree,
                                  None if req.private else self.cache)
        constraint = self.grammars.constraint(req.grammar) if req.grammar is not None else None
        judge = Judge(params, np.random.default_rng(params.seed), ids.shape[0], req.logprobs, constraint)
        rounds = decode(self.target, drafter, ids, settings, stats, judge)
        cut = TextCut(self.tokenizer, stop, settings.eos_token_ids)
        pieces = functools.partial(text_pieces, rounds, cut, judge)

        def finish(cancelled: bool) -> str:
            return finish_reason(cancelled=cancelled, **cut.met)

        on_end = self._busy.release
        if req.private and self.drafter is not None:
            def on_end():  # the draft's K/V of this text would speed up a later request that shares it
                try:
                    self.drafter.reset()
                finally:
                    self._busy.release()

        gen = Generation(pieces(), stats, finish, on_end=on_end)
        self._current = weakref.ref(gen)
        return gen

    def tree_capable(self) -> bool:
        """Whether this bundle runs tree rounds: a drafter that proposes trees, a target graph
        that verifies them (see runtime/backends/ort.py tree_capable)."""
        return self.drafter is not None and self.drafter.proposes_trees and self.target.trees

    def _tree_policy(self, tree_nodes, draft_len, drafter, params: SamplingParams) -> TreeSize | None:
        return tree_sizes(tree_nodes, draft_len, drafter, params, self.tree_capable(), self.bundle, self._auto_tree)

    def generate(self, prompt: str | None = None, **kwargs) -> Result:
        return self.collect(self.stream(prompt, **kwargs))

    @staticmethod
    def collect(gen: "Generation") -> Result:
        texts, ids = [], []
        for piece in gen:
            texts.append(piece.text)
            ids += piece.token_ids
        return Result("".join(texts), ids, gen.stats)


def tree_sizes(tree_nodes, draft_len, drafter, params: SamplingParams, capable: bool, bundle: Bundle,
               earlier: TreeSize | None) -> TreeSize | None:
    """The tree policy of a request (Session's rounds and a batch's lanes): tree rounds (`capable`:
    a drafter that proposes trees, a target that verifies them), or a model-free drafter's chains
    under auto (looked up before their length is chosen); None for chain rounds DraftLength sizes.
    `earlier`: the last greedy generation's policy of the same kind, which a greedy one starts from."""
    auto = tree_nodes in (None, "auto")
    n = None if auto else tree_nodes  # in [1, the limit]: the request schema checked it
    draft_auto = draft_len in (None, "auto")
    if n == 1 or (auto and not draft_auto) or (auto and not capable):
        if draft_auto and drafter.engine is None:
            # a model-free drafter's chains: look up first, then choose how much to verify
            return TreeSize(bundle.max_draft, measure=params.greedy, chains=True).carry_from(earlier)
        return None
    if not capable:
        raise InputError(
            f"tree nodes {n}: this bundle cannot verify token trees (its draft kind is {bundle.draft_kind!r}: "
            "trees need --draft suffix, and a target that is an exact-attention float graph on the ort "
            "backend's CPU or on the torch backend): use --tree-nodes 1 or auto"
        )
    if auto:
        return TreeSize(MAX_TREE_NODES, measure=params.greedy).carry_from(earlier)
    return TreeSize(n, fixed=n)


def chain_nodes(req: Request) -> int | str:
    """The request's tree nodes, or 1 (chains) where it asks for logprobs or a structure: a tree
    pass's rows can differ from single steps in the last bits of a logit (up to 7e-7 in a log
    probability, measured on a tiny suffix bundle; the tokens were equal), which would show in
    the log probabilities reported; a grammar's masks follow a chain's drafts (a tree's paths
    would need one matcher state per node)."""
    return 1 if req.logprobs is not None or req.structure is not None else req.tree_nodes


def _attach(drafter, target) -> None:
    """Give a drafter that reads the target's state (an EAGLE-3 head) its target engine."""
    if drafter is not None and drafter.reads_target:
        drafter.attach(target)


def _message(m) -> Message:
    if isinstance(m, Message):
        return m
    try:
        return message_of(m)
    except ValueError as e:
        raise RequestError(f"messages: {e}", "messages") from None


def _as_ids(values) -> tuple[int, ...]:
    """Prompt token ids, an array or a sequence, as the schema takes them (a tuple it checks)."""
    try:
        return tuple(values.reshape(-1).tolist() if isinstance(values, np.ndarray) else values)
    except TypeError:  # not a sequence
        raise RequestError("prompt token ids must be integers in [0, the vocabulary size)", "prompt_ids") from None


def _auto_or_int(value, field: str):
    """A draft length or a tree size as the schema takes it: "auto" (or None), an integer given
    as text (a command line's) read as one; anything else as given, for the schema to check."""
    if value is None or isinstance(value, str) and value == "auto":
        return "auto"
    if not isinstance(value, str):
        return value
    try:
        return int(value)
    except ValueError:
        raise RequestError(f"{WORDS[field]} {value!r}: expected an integer or 'auto'", field) from None
