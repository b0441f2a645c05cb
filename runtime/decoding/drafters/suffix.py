"""Suffix lookup: a model-free drafter over the request's own text and earlier requests.

The SuffixDecoding idea (Oliaro et al., 2024), built our own way: no suffix tree, but an
n-gram index (n in [min_ngram, max_ngram]) from each n tokens to where they ended, kept for
the request's own committed text (grown a few tokens a round) and for a shared, bounded store
of finished requests (`SuffixIndex`). A round finds the longest n whose last n tokens occurred
before, gathers what followed each occurrence (own text first, the most recent first) and
proposes the most frequent continuations as a token tree, each node scored by the share of
occurrences that pass through it.

Keys are the n tokens as int32 bytes: one slice of a bytes buffer, hashed by the dict, and a
lookup costs a handful of dict probes plus the matches it returns, never a scan of the text.
"""
from __future__ import annotations

import heapq
import threading
import time
from bisect import bisect_left
from collections import OrderedDict

import numpy as np

from specdeploy.core.manifest import Bundle, DraftEntry

from specdeploy.runtime.backends import BackendChoice
from specdeploy.runtime.decoding.drafters.ngram import HostLookup
from specdeploy.runtime.decoding.drafters.proposal import Proposal
from specdeploy.runtime.decoding.sampling import SamplingParams
from specdeploy.runtime.decoding.tree import DraftTree

_KEY = np.dtype("<i4")  # token ids fit in int32; half the bytes of int64 per key
_DOC_SHIFT = 32  # an occurrence in the shared index is one int: document << 32 | end
_END_MASK = (1 << _DOC_SHIFT) - 1
MAX_OCCURRENCES = 64  # occurrences a lookup draws continuations from
# Earlier requests' tokens a bundle's shared index holds: about 1 KB a token with n = 2..8, so
# about 64 MB (a scratch measurement of the index's own structures)
SHARED_TOKENS = 1 << 16


class SuffixIndex:
    """Finished requests' texts (prompt + output), searchable by n-gram; shared by the
    drafters of a pool, so every method takes one lock.

    Memory stays bounded: past `max_tokens` stored tokens the least recently used documents
    (used: added, or drawn on by a lookup) go, their index entries with them. Each stored
    token costs one index entry per n (about 1 KB a token with n = 2..8).

    >>> index = SuffixIndex(max_tokens=100, max_ngram=3, min_ngram=2)
    >>> index.add(np.array([1, 2, 3, 4, 5, 6]))
    >>> n, where = index.find(np.array([9, 2, 3]))
    >>> n, index.draw(where, max_depth=2)
    (2, [[4, 5]])
    """

    def __init__(self, max_tokens: int = 1 << 20, max_ngram: int = 8, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"SuffixIndex: need 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        if max_tokens < 1:
            raise ValueError(f"SuffixIndex: max_tokens must be positive, got {max_tokens}")
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._lock = threading.Lock()
        self._docs: OrderedDict[int, np.ndarray] = OrderedDict()  # least recently used first
        self._next_doc = 0
        self._tokens = 0
        # n -> {n tokens' bytes: one occurrence (int) or several (a list, ascending: documents are
        # numbered in the order added and their ends indexed in order, so appends keep it sorted)}
        self._tables: dict[int, dict[bytes, int | list[int]]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def __len__(self) -> int:
        with self._lock:
            return len(self._docs)

    @property
    def tokens(self) -> int:
        """Tokens stored, over all documents."""
        with self._lock:
            return self._tokens

    def add(self, tokens: np.ndarray) -> None:
        """Store a document (a longer one than max_tokens keeps its last max_tokens tokens),
        evicting the least recently used ones to make room."""
        doc_tokens = np.asarray(tokens).reshape(-1)[-self.max_tokens :].astype(_KEY)
        if doc_tokens.size == 0:
            return
        with self._lock:
            while self._docs and self._tokens + doc_tokens.size > self.max_tokens:
                old, old_tokens = self._docs.popitem(last=False)
                self._tokens -= old_tokens.size
                self._unindex(old, old_tokens)
            doc = self._next_doc
            self._next_doc += 1
            self._docs[doc] = doc_tokens
            self._tokens += doc_tokens.size
            self._index(doc, doc_tokens)

    def find(self, tail: np.ndarray, min_n: int = 1,
             limit: int = MAX_OCCURRENCES) -> tuple[int, list[tuple[int, int]]]:
        """The longest n (at least min_n) whose last n tokens of `tail` occur in a stored
        document with something after them -> (n, up to `limit` occurrences as (document, end),
        the most recently added first); (0, []) when none does."""
        raw = np.asarray(tail).reshape(-1)[-self.max_ngram :].astype(_KEY).tobytes()
        width = len(raw) // 4
        if limit <= 0:
            return 0, []
        with self._lock:
            for n in range(min(self.max_ngram, width), max(self.min_ngram, min_n) - 1, -1):
                found = self._tables[n].get(raw[4 * (width - n) :])
                if found is not None:
                    found = [found] if type(found) is int else found[: -limit - 1 : -1]
                    return n, [(h >> _DOC_SHIFT, h & _END_MASK) for h in found]
        return 0, []

    def draw(self, occurrences: list[tuple[int, int]], max_depth: int) -> list[list[int]]:
        """The up-to-max_depth tokens after each occurrence `find` gave, marking their documents
        used; one evicted since is skipped."""
        out = []
        with self._lock:
            for doc, end in occurrences:
                doc_tokens = self._docs.get(doc)
                if doc_tokens is None:
                    continue
                out.append(doc_tokens[end : end + max_depth].tolist())
                self._docs.move_to_end(doc)
        return out

    def _index(self, doc: int, doc_tokens: np.ndarray) -> None:
        raw, base, length = doc_tokens.tobytes(), doc << _DOC_SHIFT, doc_tokens.size
        for n, table in self._tables.items():
            setdefault = table.setdefault  # one probe for a new key, the common case
            for end in range(n, length):  # one ending at the document's end has nothing after it
                key, where = raw[4 * (end - n) : 4 * end], base | end
                held = setdefault(key, where)
                if held is not where:
                    if type(held) is int:
                        table[key] = [held, where]
                    else:
                        held.append(where)

    def _unindex(self, doc: int, doc_tokens: np.ndarray) -> None:
        """Remove the document's entries: its keys come again from its tokens, and its
        occurrences are one contiguous run of each sorted list."""
        raw, length = doc_tokens.tobytes(), doc_tokens.size
        lo, hi = doc << _DOC_SHIFT, (doc + 1) << _DOC_SHIFT
        for n, table in self._tables.items():
            for end in range(n, length):
                key = raw[4 * (end - n) : 4 * end]
                held = table.get(key)
                if held is None:
                    continue  # a repeat of a key already cleared
                if type(held) is int:
                    if lo <= held < hi:
                        del table[key]
                    continue
                first = bisect_left(held, lo)
                last = bisect_left(held, hi, first)
                if first < last:
                    del held[first:last]
                    if len(held) == 1:
                        table[key] = held[0]
                    elif not held:
                        del table[key]


class SuffixDrafter(HostLookup):
    """Propose what followed the longest earlier match of the text's last n tokens, in the
    request's own text or in earlier requests (`SuffixIndex`), as a tree of the frequent
    continuations.

    `private` (set by the session for each request; reset leaves it alone) keeps a request
    out of the shared index both ways: it neither reads it nor is remembered in it.

    >>> drafter = SuffixDrafter(max_ngram=3, min_ngram=1)
    >>> tree = drafter.propose_tree(np.array([5, 6, 7, 5, 6, 8, 5, 6, 7, 1, 5, 6]), budget=4, max_depth=2)
    >>> tree.tokens.tolist(), tree.parents.tolist(), tree.probs.round(2).tolist()
    ([7, 1, 8, 5], [-1, 0, -1, 2], [0.67, 0.33, 0.33, 0.33])
    """

    kind = "suffix"
    proposes_trees = keeps_history = True

    def __init__(self, max_ngram: int = 8, min_ngram: int = 2, index: SuffixIndex | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"SuffixDrafter: need 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.index = index if index is not None else SuffixIndex(max_ngram=max_ngram, min_ngram=min_ngram)
        self.private = False
        self.reset()

    @classmethod
    def from_bundle(cls, bundle: Bundle, backend: BackendChoice | str, threads: int | None) -> "SuffixDrafter":
        entry = bundle.draft
        max_ngram, min_ngram = entry.max_ngram or 8, entry.min_ngram or 2
        return cls(max_ngram, min_ngram, SuffixIndex(SHARED_TOKENS, max_ngram, min_ngram))

    @staticmethod
    def describe(entry: DraftEntry) -> str:
        span = f"{entry.max_ngram or 8}..{entry.min_ngram or 2}"
        return f"suffix lookup over the request and earlier ones, n-grams {span}, no graph"

    def fork(self) -> "SuffixDrafter":
        """A drafter over the same shared index, with request state of its own."""
        return SuffixDrafter(self.max_ngram, self.min_ngram, self.index)

    def reset(self) -> None:
        self._text: list[int] = []  # the committed tokens indexed so far
        # n -> {n tokens' bytes: ends in the own text, ascending}; an end e < len(text) only,
        # so the text's trailing n-gram (the pattern itself) is never its own match
        self._own: dict[int, dict[bytes, list[int]]] = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}

    def remember(self, ids: np.ndarray) -> None:
        """A finished generation's prompt + output joins the shared index (unless private)."""
        if not self.private:
            self.index.add(np.asarray(ids, dtype=np.int64))

    def propose(self, ids: np.ndarray, k: int, params: SamplingParams, rng: np.random.Generator,
                min_confidence: float = 0.0) -> Proposal:
        """The main chain of the k-node tree (a point mass on each token)."""
        t0 = time.perf_counter()
        chain = self.propose_tree(ids, k, k).main_chain()
        return Proposal(chain, None, time.perf_counter() - t0)

    def propose_tree(self, ids: np.ndarray, budget: int, max_depth: int) -> DraftTree:
        """Up to `budget` candidate nodes, `max_depth` deep at most, after ids [n] (the round
        times the lookup)."""
        ids = np.asarray(ids).reshape(-1)
        self._catch_up(ids)
        if budget <= 0 or max_depth <= 0:
            return continuation_tree([], 0)
        tail = ids[-self.max_ngram :]
        raw = tail.astype(_KEY).tobytes()
        width = tail.shape[0]
        own_n, own_ends = 0, []
        for n in range(min(self.max_ngram, width), self.min_ngram - 1, -1):
            ends = self._own[n].get(raw[4 * (width - n) :])
            if ends:
                own_n, own_ends = n, ends[: -MAX_OCCURRENCES - 1 : -1]
                break
        shared_n, shared = 0, []
        if not self.private:  # a longer match in the shared index wins; one as long joins in
            shared_n, shared = self.index.find(tail, max(own_n, self.min_ngram), MAX_OCCURRENCES)
        if shared_n > own_n:
            own_ends = []
        else:
            shared = shared[: MAX_OCCURRENCES - len(own_ends)]
        text = self._text
        continuations = [text[end : end + max_depth] for end in own_ends]
        if shared:
            continuations += self.index.draw(shared, max_depth)
        return continuation_tree(continuations, budget)

    def _catch_up(self, ids: np.ndarray) -> None:
        """Index the n-grams ending at the tokens new since the last call. The loop passes a
        growing prefix; a text that does not extend the indexed one (a new request without
        reset) is indexed afresh. The check compares only its first and last max_ngram tokens,
        so it costs the same at any length: reset() is the contract, this catches a missed one."""
        done, length = len(self._text), ids.shape[0]
        if done and not self._extends(ids):
            self.reset()
            done = 0
        if length == done:
            return
        start = max(0, done - self.max_ngram)
        raw = ids[start:length].astype(_KEY).tobytes()
        for n, table in self._own.items():
            for end in range(max(done, n), length):  # ends < length: the trailing n-gram waits a round
                key = raw[4 * (end - n - start) : 4 * (end - start)]
                held = table.get(key)
                if held is None:
                    table[key] = [end]
                else:
                    held.append(end)
        self._text.extend(ids[done:length].tolist())

    def _extends(self, ids: np.ndarray) -> bool:
        done = len(self._text)
        if ids.shape[0] < done:
            return False
        w = min(done, self.max_ngram)
        return ids[:w].tolist() == self._text[:w] and ids[done - w : done].tolist() == self._text[done - w :]


def continuation_tree(continuations: list[list[int]], budget: int) -> DraftTree:
    """A trie of the continuations (in order of preference: the more recent first), cut to its
    `budget` most probable nodes. A node's probability is the share of continuations passing
    through it; the kept nodes come depth-first, each node's children by count, ties to the
    more preferred continuation. Best-first keeps a subtree, since no child outscores its parent.

    >>> t = continuation_tree([[7, 8], [7, 9], [7, 8], [4]], budget=3)
    >>> t.tokens.tolist(), t.parents.tolist(), t.probs.tolist()
    ([7, 8, 9], [-1, 0, 0], [0.75, 0.5, 0.25])
    """
    total = len(continuations)
    if total == 0 or budget <= 0:
        return DraftTree(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), np.empty(0))
    COUNT, RANK, TOKEN, CHILDREN, KEPT = range(5)
    root: dict[int, list] = {}
    for rank, continuation in enumerate(continuations):
        children = root
        for token in continuation:
            node = children.get(token)
            if node is None:
                node = children[token] = [0, rank, token, {}, []]
            node[COUNT] += 1
            children = node[CHILDREN]
    # Keys never decrease from one pop to the next (a child's count is at most its parent's, its
    # rank at least), so each KEPT list fills already in the children's order.
    kept_top: list[list] = []
    heap = [(-node[COUNT], node[RANK], i, node, kept_top) for i, node in enumerate(root.values())]
    heapq.heapify(heap)
    pushed, kept = len(heap), 0
    while heap and kept < budget:
        _, _, _, node, siblings = heapq.heappop(heap)
        siblings.append(node)
        kept += 1
        for child in node[CHILDREN].values():
            heapq.heappush(heap, (-child[COUNT], child[RANK], pushed, child, node[KEPT]))
            pushed += 1
    tokens, parents, probs = [], [], []
    stack = [(node, -1) for node in reversed(kept_top)]
    while stack:
        node, parent = stack.pop()
        i = len(tokens)
        tokens.append(node[TOKEN])
        parents.append(parent)
        probs.append(node[COUNT] / total)
        stack.extend((child, i) for child in reversed(node[KEPT]))
    return DraftTree(np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64), np.asarray(probs))
