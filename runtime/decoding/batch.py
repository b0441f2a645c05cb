"""Many requests, one pass: continuous batching over a batched engine (docs/design.md,
"Batched passes").

`BatchSession` runs every active request ("lane") through one target pass per round. A
request joins at a round boundary (its prompt prefilled in its own KV slot, a chunk between
rounds while others decode) and leaves when it finishes, meets a stop string, or is
cancelled or closed; its slot is free for the next round. Each lane keeps its own sampling
parameters, seed, stop strings, draft length and drafter state, and its output is the one
`Session` gives for the same request alone, token for token:

- its rows of a pass are computed from its own slot only (runtime/backends/ort.py, `forward_batch`);
- a lane's rows of a verify pass are its own round's, the rest of the pass's T rows are
  padding: after its rows, or where the buffer has no room after them, before them,
  recomputing tokens it already holds (the same K/V, written again where they were);
- a greedy lane's output does not depend on how many tokens it drafts, so the batch's
  policy (BatchPolicy) chooses that; a sampled lane's draft lengths follow its own policy,
  exactly as alone, so a seeded request replays whatever else is in the batch.

Drafting: model-free drafters (ngram, suffix) propose per lane on the host; a draft graph
(model, self) drafts each lane in its own slot of the batch's draft engine, an EAGLE-3 head
with the head of the lane's slot over the states the target wrote there (batch_draft.py);
the batch's verify pass is T = 1 + the longest draft verified. BatchPolicy prices a pass of T tokens for
B lanes from passes measured at that B, and turns speculation down, or off, as B grows.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from specdeploy.core.errors import BundleError, InputError, SpecdeployError
from specdeploy.core.manifest import Bundle, kept_positions, load_bundle

from specdeploy.runtime.backends import BackendChoice, make_batch_engine
from specdeploy.runtime.backends.ort import settle_thread_pool, thread_pool_choice
from specdeploy.runtime.decoding.accept import Judge
from specdeploy.runtime.decoding.admission import POLL_SECONDS, Cancelled, Overloaded, QueueTimeout
from specdeploy.runtime.decoding.batch_draft import BatchDraft, BatchHeads
from specdeploy.runtime.decoding.drafters import Proposal, check_backend, drafter_class, make_drafter
from specdeploy.runtime.decoding.drafters.model import static_cost_ratio
from specdeploy.runtime.decoding.engine import Checked
from specdeploy.runtime.decoding.loop import chain_draft, check_finite, commit, look_up
from specdeploy.runtime.decoding.policy import BatchPolicy, DraftLength, TreeSize
from specdeploy.runtime.decoding.request import Request
from specdeploy.runtime.decoding.sampling import SamplingParams
from specdeploy.runtime.decoding.session import (
    Generation, Piece, Prompts, Result, Session, TextCut, chain_nodes, tree_sizes,
)
from specdeploy.runtime.decoding.stats import Round, Stats, finish_reason
from specdeploy.runtime.decoding.tokenizer import Tokenizer
from specdeploy.runtime.decoding.tree import DraftTree, TreeLayout

log = logging.getLogger("specdeploy.runtime")


@dataclass(eq=False)  # a lane is itself: found in lists by identity
class Lane:
    """One request in the batch: its tokens, its place in the KV slots, its own policy."""

    req: Request
    ids: np.ndarray  # prompt + room for every new token
    n: int  # prompt tokens
    judge: Judge  # its sampling settings, random stream and verdicts
    drafter: object | None  # a fork of the bundle's model-free drafter, or the batch's BatchDraft; None: plain
    sizes: TreeSize | None  # per-rank acceptance (greedy auto), or the lane's own policy (sampled, pinned trees)
    fixed: int | None  # a pinned draft length (of chain rounds)
    lengths: DraftLength | None = None  # a model draft's: its own policy (sampled), its acceptance (greedy)
    depth: int = 0  # a lookup's longest chain, a tree's deepest node
    text: TextCut | None = None  # its text so far, cut at its stop strings: a stop string ends the lane
    stats: Stats = field(default_factory=Stats)
    out: "queue.SimpleQueue" = field(default_factory=queue.SimpleQueue)
    admitted: threading.Event = field(default_factory=threading.Event)
    leave: threading.Event = field(default_factory=threading.Event)  # cancelled or closed: drop at the next round
    slot: int = -1
    prefilled: int = 0  # prompt tokens whose K/V the slot holds
    end: int = 0  # committed tokens: ids[:end]
    started: float = 0.0
    dropped: bool = False  # ended before its rounds ran out
    # this round's plan
    tokens: np.ndarray | None = None  # the drafts to verify (chain) or candidates (sampled tree lanes)
    tree: DraftTree | None = None
    proposal: Proposal | None = None  # a model draft's, with its probabilities and costs
    forced: int = 0  # of the drafts, the first ones its grammar forced (proposed as Session's round does)

    @property
    def params(self) -> SamplingParams:
        return self.judge.params

    @property
    def rng(self) -> np.random.Generator:
        return self.judge.rng

    @property
    def ready(self) -> bool:
        return self.prefilled >= self.n - 1

    @property
    def kv_length(self) -> int:
        """Slots of its KV worth keeping: every committed token but the last, or the prompt so far."""
        return max(self.end - 1, self.prefilled)

    @property
    def greedy_auto(self) -> bool:
        """Greedy, its drafts sized by the batch's policy (not pinned: neither k nor a tree size)."""
        return self.params.greedy and self.drafter is not None and self.fixed is None and \
            (self.sizes is None or self.sizes.fixed is None)

    @property
    def trees(self) -> bool:
        """Verifies token trees (not a lookup's chains)."""
        return self.sizes is not None and not self.sizes.chains


_END = object()  # the lane's queue: no more rounds


class BatchSession(Prompts):
    """A bundle loaded once and served to many requests at a time: up to `batch` run in one
    pass per round, up to `max_queue` more wait for a slot.

    The Python API mirrors `Session` (`stream`, `generate`, `start`) and `SessionPool`
    (`check_capacity`, `shutdown`, `reopen`, `in_flight`, `waiting`): what `serve` and
    the Triton model run on. A scheduler thread runs the rounds; each generation reads its
    pieces from it. A lane's text (UTF-8 pieces, cut at its stop strings) is made as its rounds
    commit, so a stop string ends the lane in the round that meets it, whether or not its reader
    has caught up.
    """

    def __init__(self, bundle: str | Path | Bundle, batch: int = 4, max_queue: int = 8, threads: int | None = None,
                 backend: str = "ort", device: str | None = None, wait_seconds: float | None = None,
                 prompt_cache: bool = True, verify: bool = True, digest: str | None = None):
        self.bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle, verify=verify, digest=digest)
        b = self.bundle
        if backend == "ort" and (device is None or str(device) == "cpu"):  # target and draft take turns: one pool
            settle_thread_pool(thread_pool_choice(None), threads, b.model("draft") is not None)
        if not 1 <= batch <= b.max_batch:
            raise InputError(f"batch {batch}: this bundle's graphs carry 1..{b.max_batch} sequences a pass (its "
                             f"max_batch); re-export with --max-batch {batch} to batch more")
        b.check_memory(sequences=batch)
        self.tokenizer = Tokenizer(b.file(b.tokenizer.file), b.tokenizer)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        check_backend(b, backend)  # a drafter that runs on some backends only
        self.target = make_batch_engine(backend, b, batch, threads, device)
        kind = b.draft_kind
        self.drafter = None  # a model-free lookup: forked per lane, run on the host
        self.draft: BatchDraft | BatchHeads | None = None  # a draft graph: its KV slots follow the target's
        # (batch_draft.py)
        if kind != "none":
            cls = drafter_class(kind)
            if cls.model_free:
                self.drafter = make_drafter(b, "ort", threads)
            elif kind in ("model", "self"):
                engine = make_batch_engine(backend, b, batch, threads, device, role="draft")
                ratio = static_cost_ratio(b, b.model("draft"), b.model("target"))
                self.draft = BatchDraft(engine, ratio, batch)
            else:  # a head per slot (EAGLE-3, MTP, assistant), reading the hidden states the batched target writes there
                if self.target.features is None:
                    raise InputError(f"{b.path}: its {kind} head reads the target's hidden states, which the "
                                     f"{backend} backend's batched passes do not return; use --backend ort")
                heads = BackendChoice.of(backend, device)  # the backend a lane alone would draft on
                self.draft = BatchHeads(make_drafter(b, heads, threads), self.target, batch)
        self.batch = batch
        self.max_queue = max_queue
        self.wait_seconds = wait_seconds
        self.prompt_cache = prompt_cache
        self.policy = BatchPolicy(b.max_draft)
        self._auto: TreeSize | None = None  # the last greedy auto lane's estimates: the next starts from them
        self._auto_tree: TreeSize | None = None  # the same for tree lanes
        self._auto_lengths: DraftLength | None = None  # the same for a model draft's lanes
        self._lock = threading.Condition()
        self._pending: list[Lane] = []  # admitted to wait, not yet in a slot
        self._lanes: list[Lane] = []  # in slots 0..len-1: the ready lanes first, then those prefilling
        self._held: list[tuple[np.ndarray, int] | None] = [None] * batch  # a free slot's tokens and their K/V length
        self.closing = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._gate = threading.Lock()  # held by the scheduler through each step; `hold` holds it between them
        self.rounds = 0
        # where the scheduler's time went: batched rounds (their passes alone, and with the host
        # work around them), prefill passes; and the tokens the rounds committed
        self.timing = {"round_seconds": 0.0, "pass_seconds": 0.0, "prefill_seconds": 0.0, "tokens": 0, "lanes": 0,
                       "rounds": 0}
        self.timing_by_lanes: dict[int, list] = {}  # lanes in a round -> [rounds, seconds, tokens]
        self.widths: dict[tuple[int, int], int] = {}  # (lanes, T) -> rounds: how wide the batch's passes were

    # -- the pool's face ---------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.batch

    @property
    def in_flight(self) -> int:
        return len(self._lanes)

    @property
    def session(self) -> "BatchSession":
        """For read-only work (encoding, limits), as SessionPool.session."""
        return self

    @property
    def memory_per_sequence(self) -> int:
        """Bytes each slot holds (what one more sequence in the batch costs): the target's K/V, and
        the recurrent states a model with linear-attention layers keeps per slot."""
        return self.target.kv_bytes_per_sequence + self.bundle.model("target").state_bytes * kept_positions(self.bundle.max_draft)

    @property
    def waiting(self) -> int:
        """Requests queued for a slot (not yet running)."""
        return len(self._pending)

    def _refuse_if_full(self) -> None:
        # Capacity is `batch` running plus `max_queue` waiting; a request not yet admitted counts
        # once, in _pending (the free slots it will take are part of the batch's share).
        running, waiting = len(self._lanes), len(self._pending)
        if running + waiting >= self.batch + self.max_queue:
            raise Overloaded(f"server busy: {running} sequence(s) in the batch (of {self.batch}) and {waiting} "
                             f"request(s) waiting (queue limit {self.max_queue}); retry later")

    def check_capacity(self) -> None:
        with self._lock:
            self._refuse_if_full()

    def stream(self, prompt: str | None = None, cancel: threading.Event | None = None, **kwargs) -> Generation:
        """As Session.stream, run in the batch."""
        return self.start(self.request(prompt, **kwargs), cancel)

    def generate(self, prompt: str | None = None, **kwargs) -> Result:
        return Session.collect(self.stream(prompt, **kwargs))

    def start(self, req: Request, cancel: threading.Event | None = None) -> Generation:
        """Queue a request `validate` passed; return once it has a slot (its generation then
        runs in the batch). Raises Overloaded, QueueTimeout or Cancelled as SessionPool does."""
        req = self.prepare(req)
        lane = self._lane(req)
        with self._lock:
            if self.closing.is_set():
                raise Cancelled("the server is shutting down")
            self._refuse_if_full()
            self._pending.append(lane)
            self._ensure_thread()
            self._lock.notify_all()
        deadline = None if self.wait_seconds is None else time.monotonic() + self.wait_seconds
        try:
            while not lane.admitted.wait(POLL_SECONDS):
                why = None
                if cancel is not None and cancel.is_set():
                    why = Cancelled("the request was cancelled while it waited for a slot")
                elif self.closing.is_set():
                    why = Cancelled("the server is shutting down")
                elif deadline is not None and time.monotonic() >= deadline:
                    why = QueueTimeout(f"server busy: no slot came free within {self.wait_seconds}s; retry later")
                if why is not None:
                    with self._lock:
                        if lane in self._pending:
                            self._pending.remove(lane)
                            raise why
                    break  # admitted as it gave up: it runs (the client's cancel ends it)
        except BaseException:
            with self._lock:  # never left queued by an exception that is not one of the above
                if lane in self._pending:
                    self._pending.remove(lane)
            raise
        return self._generation(lane)

    def shutdown(self) -> None:
        """Refuse new requests, make waiting ones give up, end every running one after its round."""
        self.closing.set()
        with self._lock:
            for lane in self._lanes:
                lane.leave.set()
            self._lock.notify_all()

    def reopen(self) -> None:
        self.closing.clear()

    def close(self) -> None:
        """Stop the scheduler thread (after `shutdown`, or once nothing runs)."""
        self.shutdown()
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- a request's lane --------------------------------------------------------------------
    def _lane(self, req: Request) -> Lane:
        ids = np.empty(len(req.prompt_ids) + req.max_new_tokens, dtype=np.int64)
        n = len(req.prompt_ids)
        ids[:n] = req.prompt_ids
        params = SamplingParams.of(req)
        constraint = self.grammars.constraint(req.grammar) if req.grammar is not None else None
        judge = Judge(params, np.random.default_rng(params.seed), n, req.logprobs, constraint)
        max_draft = self.bundle.max_draft
        fixed = None if req.draft_len == "auto" else req.draft_len
        speculate = (self.drafter is not None or self.draft is not None) and req.speculate and fixed != 0
        if speculate and self.draft is not None:  # the batch's draft graph, in the lane's slot of it
            lengths = (DraftLength(max_draft, fixed=fixed) if fixed is not None else
                       DraftLength(max_draft, cost_ratio=self.draft.cost_ratio, measure=params.greedy))
            if params.greedy and fixed is None:
                lengths.carry_from(self._auto_lengths)
            return Lane(req, ids, n, judge, self.draft, None, fixed, lengths,
                        text=self._text(req), end=n)
        drafter = self.drafter.fork() if speculate else None
        if drafter is not None and drafter.keeps_history:
            drafter.private = req.private
        sizes = None
        if drafter is not None:
            # Session's tree policy for the request: greedy auto lanes keep their per-rank acceptance
            # for the batch's policy; sampled and pinned ones run it exactly as a Session alone
            capable = drafter.proposes_trees and self.target.trees
            sizes = tree_sizes(chain_nodes(req), req.draft_len, drafter, params, capable, self.bundle, None)
            if sizes is not None and params.greedy:
                _carry(sizes, self._auto if sizes.chains else self._auto_tree)
        depth = max_draft if fixed is None or sizes is None or sizes.chains else fixed
        return Lane(req, ids, n, judge, drafter, sizes,
                    fixed if sizes is None else None, text=self._text(req), end=n, depth=depth)

    def _text(self, req: Request) -> TextCut:
        return TextCut(self.tokenizer, req.stop, self.eos_token_ids)

    def _generation(self, lane: Lane) -> Generation:
        met = lane.text.met  # final once the lane's end is queued: the scheduler writes it before
        ref = weakref.ref(lane)

        def pieces() -> Iterator[Piece]:
            try:
                while True:
                    item = lane.out.get()
                    if item is _END:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                lane.leave.set()  # a close, or the end: the slot is free at the next round
                with self._lock:
                    self._lock.notify_all()

        def finish(cancelled: bool) -> str:  # dropped by the scheduler: cancelled, unless a stop string ended it
            return finish_reason(cancelled=cancelled or (lane.dropped and not met["stop"]), **met)

        def on_end() -> None:
            held = ref()
            if held is not None:
                held.leave.set()

        gen = _BatchGeneration(pieces(), lane.stats, finish, on_end=on_end)
        gen.lane = lane
        return gen

    # -- the scheduler -----------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="specdeploy-batch", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def hold(self):
        """Keep the scheduler between rounds while the block runs: requests started meanwhile
        join together at the next round boundary (what a test of joins and leaves needs)."""
        with self._gate:
            yield

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._lanes and not self._pending:
                    self._lock.wait()
                if self._stop and not self._lanes:
                    for lane in self._pending:  # never given a slot: its reader hears why
                        lane.out.put(Cancelled("the scheduler was closed before the request had a slot"))
                        lane.admitted.set()
                    self._pending.clear()
                    return
            with self._gate:
                with self._lock:
                    self._admit()
                try:
                    self.step()
                except Exception as e:  # a failed pass: its lanes end with the error, the batch goes on
                    self._fail(e)

    def _fail(self, e: Exception) -> None:
        log.error(f"batched round failed: {e}")
        error = e if isinstance(e, SpecdeployError) else BundleError(f"batched round failed: {e}")
        with self._lock:
            lanes, self._lanes = self._lanes, []
            self._held = [None] * self.batch  # what the slots hold is not known any more
            if self.draft is not None:
                self.draft.forget()
        for lane in lanes:
            lane.dropped = True
            lane.out.put(error)

    def _admit(self) -> None:
        """With the lock held: pending requests into free slots, the one whose slot holds the
        longest prefix of its prompt into that slot."""
        while self._pending and len(self._lanes) < self.batch:
            lane = self._pending.pop(0)
            at = len(self._lanes)
            best, reuse = at, 0
            if self.prompt_cache and not lane.req.private:
                for slot in range(at, self.batch):
                    held = self._held[slot]
                    if held is None:
                        continue
                    m = min(held[1], lane.n - 1)
                    differ = np.flatnonzero(held[0][:m] != lane.ids[:m])
                    same = self.target.resumable(int(differ[0]) if differ.size else m, slot)
                    if same > reuse:
                        best, reuse = slot, same
            if best != at:
                self.target.swap(at, best, self._held[at][1] if self._held[at] else 0, self._held[best][1])
                self._held[at], self._held[best] = self._held[best], self._held[at]
                if self.draft is not None:
                    self.draft.swap(at, best)
            if self.draft is not None and lane.req.private:
                self.draft.forget(at)  # a private request reads no cache, the draft's included
            self._held[at] = None
            lane.slot = at
            lane.prefilled = reuse
            lane.stats.prompt_tokens = lane.n
            lane.stats.cached_tokens = reuse
            lane.started = time.perf_counter()
            self._lanes.append(lane)
            if lane.ready:  # its whole prompt was in the slot (or it is one token): into the ready region
                self._move(lane, sum(1 for other in self._lanes if other.ready and other is not lane))
            lane.admitted.set()

    def step(self) -> None:
        """One scheduler step: drop the lanes that left, prefill a chunk of each joining lane
        (all of it while no lane decodes), then one batched round over the ready lanes."""
        for lane in [lane for lane in self._lanes if lane.leave.is_set()]:
            self._drop(lane, dropped=True)
        ready = [lane for lane in self._lanes if lane.ready]
        for lane in [lane for lane in self._lanes if not lane.ready]:
            self._prefill(lane, whole=not ready)
        ready = [lane for lane in self._lanes if lane.ready]
        if ready:
            self._round(ready)

    def _prefill(self, lane: Lane, whole: bool) -> None:
        chunk = self.bundle.prefill_chunk
        t0 = time.perf_counter()
        self._share(lane)
        while not lane.ready:
            at = lane.prefilled
            upto = min(at + chunk, lane.n - 1)
            self.target.forward_batch(lane.ids[None, at:upto], np.array([at]), first=lane.slot, last=True)
            lane.prefilled = upto
            if not whole:
                break
        lane.stats.prefill_seconds += time.perf_counter() - t0
        self.timing["prefill_seconds"] += time.perf_counter() - t0
        if lane.ready:  # into the ready region: slots 0..(ready lanes)-1
            ready = sum(1 for other in self._lanes if other.ready and other is not lane)
            self._move(lane, ready)

    def _share(self, lane: Lane) -> None:
        """Copy into the lane's slot the K/V another lane holds of the lane's prompt beyond what it
        has prefilled (the `n` answers to one prompt, a system prompt requests share): K/V at a
        position depend only on the tokens up to it, so the copy is what a prefill would write."""
        if not self.prompt_cache or lane.req.private:
            return
        best, upto = None, lane.prefilled
        for other in self._lanes:
            if other is lane or other.req.private:
                continue
            held = other.end - 1 if other.ready else other.prefilled  # positions whose K/V its slot holds
            m = min(held, lane.n - 1)
            if m <= upto:
                continue
            differ = np.flatnonzero(other.ids[:m] != lane.ids[:m])
            same = self.target.resumable(int(differ[0]) if differ.size else m, other.slot)
            if same > upto:
                best, upto = other, same
        if best is not None:
            self.target.copy(best.slot, lane.slot, lane.prefilled, upto)
            lane.stats.cached_tokens += upto - lane.prefilled
            lane.prefilled = upto

    def _move(self, lane: Lane, slot: int) -> None:
        """Swap `lane` with whatever occupies `slot` (another lane, or a free slot)."""
        if lane.slot == slot:
            return
        with self._lock:
            self._swap_lanes(lane, slot)

    def _swap_lanes(self, lane: Lane, slot: int) -> None:
        other = next((x for x in self._lanes if x.slot == slot), None)
        other_length = other.kv_length if other is not None else (self._held[slot][1] if self._held[slot] else 0)
        self.target.swap(lane.slot, slot, lane.kv_length, other_length)
        if self.draft is not None:
            self.draft.swap(lane.slot, slot)
        if other is not None:
            other.slot = lane.slot
        else:
            self._held[lane.slot], self._held[slot] = self._held[slot], None
        self._lanes.remove(lane)
        lane.slot = slot
        self._lanes.insert(slot, lane)
        self._lanes.sort(key=lambda x: x.slot)

    def _drop(self, lane: Lane, dropped: bool) -> None:
        """A lane leaves: its slot keeps its tokens for a later prompt that shares them (unless
        private), and the lanes after it close up so that slots 0..B-1 stay the running ones."""
        with self._lock:
            if lane not in self._lanes:
                return
            self._leave(lane, dropped)

    def _leave(self, lane: Lane, dropped: bool) -> None:
        lane.dropped = lane.dropped or dropped
        ready = [x for x in self._lanes if x.ready]
        if lane.ready:  # to the end of the ready region, then past the prefilling lanes
            self._move(lane, len(ready) - 1)
        self._move(lane, len(self._lanes) - 1)
        keep = not lane.req.private and self.prompt_cache
        self._held[lane.slot] = (lane.ids[: lane.end].copy(), lane.kv_length) if keep else None
        self.target.release(lane.slot)  # held for a later prompt while it costs the running lanes nothing
        if self.draft is not None:
            self.draft.release(lane.slot)
        self._lanes.remove(lane)
        try:
            if lane.lengths is not None:  # the batch's draft graph
                if lane.req.private:  # its text's draft K/V would speed up a later request
                    self.draft.forget(lane.slot)
            elif lane.drafter is not None and lane.drafter.keeps_history:
                lane.drafter.remember(lane.ids[: lane.end])
            if lane.greedy_auto:  # what it measured: the next greedy lane starts from it
                if lane.lengths is not None:
                    self._auto_lengths = lane.lengths
                elif lane.trees:
                    self._auto_tree = lane.sizes
                else:
                    self._auto = lane.sizes
        except Exception as e:  # out of _lanes already: _fail would not tell its reader
            lane.out.put(e if isinstance(e, SpecdeployError) else BundleError(f"batched round failed: {e}"))
            raise
        tail = lane.text.flush() if not lane.text.met["stop"] else None
        if tail is not None:
            lane.out.put(tail)
        lane.out.put(_END)

    # -- one round ---------------------------------------------------------------------------
    def _plan(self, lane: Lane, look: bool = True) -> int:
        """The lane's drafts for this round, looked up on the host: what it verifies at least
        (its own choice), and for a greedy auto lane its candidates in `lane.tokens` (a chain, or
        a tree in `lane.tree`; none unless `look`: the batch's policy rests on plain steps)."""
        wanted = lane.req.max_new_tokens - (lane.end - lane.n)
        most = wanted - 1
        ids = lane.ids[: lane.end]
        lane.tree = None
        lane.tokens = EMPTY
        lane.forced = 0
        if lane.drafter is None or most <= 0:
            return 0
        if lane.sizes is None:  # a pinned k, as Session's chain round
            k = min(lane.fixed, most)
            forced = lane.judge.forced(most)
            lane.tokens = chain_draft(lane.drafter, ids, k, most, forced, lane.judge).tokens
            lane.forced = forced.shape[0]
            return lane.tokens.shape[0]
        if lane.greedy_auto and not look:
            return 0
        candidates, _, _ = look_up(lane.drafter, ids, lane.sizes, min(lane.depth, most), self.bundle.max_seq,
                                   lane.judge)
        if lane.greedy_auto:  # the batch's policy chooses how much of it to verify
            lane.tree = candidates if lane.trees else None
            lane.tokens = candidates.tokens
            return 0
        # its own policy sizes it, as Session's round does alone
        lane.tree = candidates.prune(lane.sizes.choose(candidates.probs, candidates.size))
        lane.tokens = lane.tree.tokens
        return lane.tokens.shape[0]

    def _own_k(self, lane: Lane) -> int:
        """A model draft's k for a lane that chooses for itself: pinned, or a sampled lane's own
        policy (called every round, as Session's round calls it)."""
        most = lane.req.max_new_tokens - (lane.end - lane.n) - 1
        if lane.lengths is None:
            return 0
        return max(0, min(lane.fixed if lane.fixed is not None else lane.lengths.choose(), most))

    def _draft(self, lanes: list[Lane], ks: list[int]) -> None:
        """Every lane's drafts of this round (the greedy lanes' in one pass per draft step, a sampled
        lane's alone: BatchDraft); a lane whose grammar forces tokens proposes those instead,
        drafting nothing (as Session's round)."""
        forced = [lane.judge.forced(lane.req.max_new_tokens - (lane.end - lane.n) - 1) if lane.drafter is not None
                  else EMPTY for lane in lanes]
        ks = [0 if f.shape[0] else k for k, f in zip(ks, forced)]
        confidence = [lane.lengths.min_confidence if lane.lengths is not None else 0.0 for lane in lanes]
        proposals = self.draft.propose(lanes, ks, confidence)
        for lane, proposal, f in zip(lanes, proposals, forced):
            if f.shape[0]:
                proposal = Proposal(f)
            elif proposal is not None:
                proposal = lane.judge.cut(proposal)  # where the grammar leaves it
            lane.tree, lane.proposal, lane.forced = None, proposal, f.shape[0]
            lane.tokens = proposal.tokens if proposal is not None else EMPTY
        for proposal in proposals:  # each lane's own passes, timed
            if proposal is not None:
                self.policy.drafted(proposal, len(lanes))

    def _round(self, lanes: list[Lane]) -> None:
        started = time.perf_counter()
        b = len(lanes)
        ends = sum(lane.end for lane in lanes)
        assert [lane.slot for lane in lanes] == list(range(b)), [(lane.slot, lane.ready) for lane in self._lanes]
        auto = [lane for lane in lanes if lane.greedy_auto]
        if self.draft is not None:  # drafting costs passes: the policy chooses k before anyone drafts
            ks = [0 if lane.greedy_auto else self._own_k(lane) for lane in lanes]  # the lanes' own choices first
            look = bool(auto) and (max(ks) > 0 or self.policy.looks(b))
            prior = self.draft.cost_ratio * float(self.policy.cost(1 if 1 in self.policy.costs else b).seconds(1))
            holds = [lane.lengths.held() for lane in auto]
            k = self.policy.choose_k(b, max(ks), holds, prior) if look else 0
            prober = int(np.argmax([h[0] for h in holds])) if self.policy.probing and look else -1
            for i, lane in enumerate(auto):  # a probe: the lane likeliest to hold drafts, the others rest
                most = lane.req.max_new_tokens - (lane.end - lane.n) - 1
                ks[lanes.index(lane)] = max(0, min(k if prober < 0 or i == prober else 0, most))
            self._draft(lanes, ks)
            t = 1 + max(lane.tokens.shape[0] for lane in lanes)
        else:  # a lookup is free: look up first, then choose how much of it to verify
            least = [0 if lane.greedy_auto else self._plan(lane) for lane in lanes]  # the lanes' own choices first
            look = bool(auto) and (max(least) > 0 or self.policy.looks(b))  # rows the others pad are free to fill
            for lane in auto:
                self._plan(lane, look)
            chains = [(lane.tokens.shape[0], lane.sizes.estimates(lane.tree.probs if lane.tree is not None else None,
                                                                  lane.tokens.shape[0])) for lane in auto] if look else []
            t = self.policy.choose(b, 1 + max(least), chains)
        if self.bundle.manifest.recurrent:
            t = self._fit_after(lanes, t)
        verified = []
        for lane in lanes:
            if lane.greedy_auto and lane.tree is not None:  # the tree's t - 1 best nodes
                lane.tree = lane.tree.prune(t - 1)
                lane.tokens = lane.tree.tokens
            elif lane.greedy_auto:
                lane.tokens = lane.tokens[: t - 1]
            verified.append(lane.tokens.shape[0])
        rows = np.empty((b, t), dtype=np.int64)
        starts = np.empty(b, dtype=np.int64)
        offsets = []
        layouts: list[TreeLayout | None] = [None] * b
        for i, lane in enumerate(lanes):
            r = 1 + verified[i]
            start = lane.end - 1
            if start + t <= self.bundle.max_seq:  # padding after its rows
                rows[i, 0] = lane.ids[start]
                rows[i, 1:r] = lane.tokens
                rows[i, r:] = lane.ids[start]
                starts[i] = start
                offsets.append(0)
            else:  # no room after: padding before, its own tokens recomputed where they are
                shift = t - r
                rows[i, :shift] = lane.ids[start - shift : start]
                rows[i, shift] = lane.ids[start]
                rows[i, shift + 1 :] = lane.tokens
                starts[i] = start - shift
                offsets.append(shift)
            if lane.tree is not None and lane.trees and lane.tree.size and not lane.tree.is_chain():
                layouts[i] = pass_layout(lane.tree, t, offsets[-1])
        trees = {"layouts": layouts} if any(x is not None for x in layouts) else {}
        t0 = time.perf_counter()
        logits = self.target.forward_batch(rows, starts, pad=self._may_pad(b), **trees)
        seconds = time.perf_counter() - t0
        self.rounds += 1
        drafted, accepted = False, 0
        finished = []
        for i, lane in enumerate(lanes):
            r = 1 + verified[i]
            mine = logits[i, offsets[i] : offsets[i] + r]
            new, record = self._judge(lane, mine, seconds)
            drafted |= record.proposed > 0
            accepted += record.accepted
            if self._commit(lane, new, record):
                finished.append(lane)
        for lane in finished:  # after every lane has committed: a slot moves with all of its K/V
            self._drop(lane, dropped=False)
        # the round's draft passes: each lane's own, and its share of each pass greedy lanes shared
        draft_seconds = sum(lane.proposal.seconds for lane in lanes if lane.proposal is not None)
        self.policy.update(b, t, seconds, drafted, accepted, draft_seconds)
        timing = self.timing
        timing["round_seconds"] += time.perf_counter() - started
        timing["pass_seconds"] += seconds
        timing["lanes"] += b
        timing["rounds"] += 1
        self.widths[b, t] = self.widths.get((b, t), 0) + 1
        at = self.timing_by_lanes.setdefault(b, [0, 0.0, 0])  # rounds, seconds, tokens at this batch size
        at[0] += 1
        at[1] += time.perf_counter() - started
        at[2] += sum(lane.end for lane in lanes) - ends

    def _fit_after(self, lanes: list[Lane], t: int) -> int:
        """A model with recurrent states: each lane's pass must start at its length (where its state
        is kept), so no lane's rows may be padded before its own: t at most the room the fullest
        lane has left, each lane's drafts cut to fit (the first j of k drafts are a proposal of
        their own: sampled drafts were drawn one after the other)."""
        room = self.bundle.max_seq - max(lane.end - 1 for lane in lanes)
        if t <= room:
            return t
        for lane in lanes:
            if lane.tree is not None:
                lane.tree = lane.tree.prune(room - 1)
                lane.tokens = lane.tree.tokens
            elif lane.tokens.shape[0] > room - 1:
                lane.tokens = lane.tokens[: room - 1]
                p = lane.proposal
                if p is not None:
                    lane.proposal = replace(p, tokens=lane.tokens, probs=None if p.probs is None else p.probs[: room - 1])
                lane.forced = min(lane.forced, room - 1)
        return room

    def _may_pad(self, b: int) -> bool:
        """Whether the slots after the first b may take an engine's padding lanes (the torch backend's):
        none holds K/V at or past the engine's padding floor."""
        floor = self.target.padding_floor
        if floor is None:
            return False
        lengths = [lane.kv_length for lane in self._lanes if lane.slot >= b]
        lengths += [held[1] for held in self._held[b:] if held is not None]
        return max(lengths, default=0) <= floor

    def _judge(self, lane: Lane, logits: np.ndarray, seconds: float) -> tuple[np.ndarray, Round]:
        """The lane's verdict on its rows, by the rules its round would have alone."""
        start = lane.end - 1
        tokens = logits.argmax(axis=-1) if lane.params.greedy else None
        check_finite(self.target, logits, start, tokens)
        if lane.tree is not None:  # a tree, or a chain its own policy sized: judged as Session's round judges it
            path, token = lane.judge.tree(lane.ids[: lane.end], lane.tree, logits, tokens)
            if path != list(range(len(path))):  # off the main chain: the path's K/V into a chain's slots
                self.target.move_kv(lane.end + np.asarray(path, dtype=np.int64), lane.end, slot=lane.slot)
            trees = lane.trees
            record = Round(lane.tree.size, len(path), seconds, chosen=None if trees else lane.tree.size, tree=trees,
                           path=tuple(path), scores=lane.tree.probs)
            lane.sizes.update(record if not lane.greedy_auto else
                              Round(lane.tree.size, len(path), 0.0, tree=trees, path=tuple(path), scores=lane.tree.probs))
            return np.append(lane.tree.tokens[path], token), record
        drafts, p = lane.tokens, lane.proposal
        n_accepted, token = lane.judge.chain(lane.ids[: lane.end], Checked(drafts, p.probs if p is not None else None,
                                                                           logits, tokens))
        chosen = drafts.shape[0] if lane.drafter is not None and not lane.forced else None
        if p is not None:  # a model draft's round, recorded as Session records it
            record = Round(drafts.shape[0], n_accepted, seconds, p.seconds, p.passes, p.caught_up, p.first_seconds, chosen,
                           forced=lane.forced)
        else:
            record = Round(drafts.shape[0], n_accepted, seconds, chosen=chosen, forced=lane.forced)
        if lane.forced:  # a forced round says nothing of the drafter (as Session's rounds)
            return np.append(drafts[:n_accepted], token), record
        if lane.lengths is not None:  # its own policy learns (a greedy lane's acceptance only: costs are the batch's)
            lane.lengths.update(record if not lane.greedy_auto else Round(drafts.shape[0], n_accepted, 0.0))
        elif lane.greedy_auto:
            lane.sizes.update(Round(drafts.shape[0], n_accepted, 0.0, path=tuple(range(n_accepted))))
        return np.append(drafts[:n_accepted], token), record

    def _commit(self, lane: Lane, new: np.ndarray, record: Round) -> bool:
        """Commit a round's tokens to the lane and hand them to its reader; -> whether it is done."""
        s = lane.stats
        s.record(record)
        new, eos = commit(lane.ids, lane.end, lane.n, new, lane.req.max_new_tokens, self.eos_token_ids, s, lane.started)
        lane.end += new.shape[0]
        piece = lane.text.push(new)
        piece.logprobs = lane.judge.take(new.shape[0])
        lane.out.put(piece)
        self.timing["tokens"] += new.shape[0]
        return eos or s.new_tokens >= lane.req.max_new_tokens or lane.text.met["stop"]


EMPTY = np.empty(0, dtype=np.int64)


def pass_layout(tree: DraftTree, t: int, shift: int) -> TreeLayout:
    """A tree lane's T rows of a batched pass: `shift` of its own tokens recomputed before the
    root (a lane with no room after its rows), the root and the tree's nodes as the tree lays them
    out, then padding rows that see only the context and themselves (their rows are not read)."""
    tree_layout = tree.layout()
    r = tree_layout.offsets.shape[0]
    offsets = np.arange(t, dtype=np.int64)
    visible = np.eye(t, dtype=bool)
    visible[:shift, :shift] = np.tril(np.ones((shift, shift), dtype=bool))
    offsets[shift : shift + r] = shift + tree_layout.offsets
    visible[shift : shift + r, :shift] = True
    visible[shift : shift + r, shift : shift + r] = tree_layout.visible
    return TreeLayout(offsets, visible)


def _carry(sizes: TreeSize, earlier: TreeSize | None) -> None:
    """A new greedy lane starts from the acceptance the last one measured (as Session carries it)."""
    if earlier is not None:
        n = min(sizes.max_nodes, earlier.max_nodes)
        sizes.hits[:n], sizes.trials[:n] = earlier.hits[:n], earlier.trials[:n]


class _BatchGeneration(Generation):
    """A generation whose rounds run in the batch: cancel() and close() also tell the scheduler,
    which frees the slot at the next round."""

    lane: Lane

    def cancel(self) -> None:
        super().cancel()
        self.lane.leave.set()

    def close(self) -> None:
        self.lane.leave.set()
        with self._state:
            if self._running:  # the reader is waiting for a round: the scheduler's end wakes it
                self._close_requested = True
                return
            self._end(cancelled=True)


__all__ = ["BatchPolicy", "BatchSession", "Cancelled", "Overloaded", "QueueTimeout"]
