"""The suffix drafter against slow references: a brute-force scan for the lookup, an explicit
sort of every trie node for the tree; the shared index's sharing, privacy, LRU bound and lock."""
import threading

import numpy as np
import pytest

from specdeploy.runtime.decoding.drafters.suffix import MAX_OCCURRENCES, SuffixDrafter, SuffixIndex, continuation_tree
from specdeploy.runtime.decoding.sampling import SamplingParams

GREEDY = SamplingParams()


# ---- slow references ------------------------------------------------------------------------

def reference_continuations(ids, docs, max_ngram, min_ngram, max_depth, private=False):
    """Scan everything: the longest n whose pattern occurs earlier in ids or (ends before a
    document's end) in docs; own occurrences latest first, then the docs' latest first."""
    ids, docs = list(ids), [list(d) for d in docs]
    length = len(ids)
    for n in range(min(max_ngram, length), min_ngram - 1, -1):
        pattern = ids[length - n :]
        own = [e for e in range(n, length) if ids[e - n : e] == pattern]
        shared = [] if private else [(d, e) for d, doc in enumerate(docs) for e in range(n, len(doc))
                                     if doc[e - n : e] == pattern]
        if own or shared:
            own = own[::-1][:MAX_OCCURRENCES]
            shared = shared[::-1][: MAX_OCCURRENCES - len(own)]
            return [ids[e : e + max_depth] for e in own] + [docs[d][e : e + max_depth] for d, e in shared]
    return []


def reference_tree(continuations, budget):
    """Every trie node (a prefix) with its count and first rank, sorted best first, the first
    `budget` kept, written depth-first with children by (count desc, rank)."""
    nodes = {}
    for rank, cont in enumerate(continuations):
        for d in range(1, len(cont) + 1):
            count, first = nodes.get(tuple(cont[:d]), (0, rank))
            nodes[tuple(cont[:d])] = (count + 1, first)
    kept = set(sorted(nodes, key=lambda p: (-nodes[p][0], nodes[p][1], len(p)))[:budget])
    tokens, parents, probs = [], [], []

    def visit(prefix, parent):
        kids = sorted((p for p in kept if len(p) == len(prefix) + 1 and p[:-1] == prefix),
                      key=lambda p: (-nodes[p][0], nodes[p][1]))
        for p in kids:
            i = len(tokens)
            tokens.append(p[-1])
            parents.append(parent)
            probs.append(nodes[p][0] / len(continuations))
            visit(p, i)

    visit((), -1)
    return tokens, parents, probs


def main_chain(tree):
    out, node = [], -1
    while True:
        kids = [i for i, p in enumerate(tree.parents.tolist()) if p == node]
        if not kids:
            return tree.tokens[out]
        node = kids[0]
        out.append(node)


def assert_same_tree(tree, tokens, parents, probs):
    assert tree.tokens.tolist() == tokens
    assert tree.parents.tolist() == parents
    np.testing.assert_allclose(tree.probs, probs, rtol=0, atol=1e-12)


def assert_well_formed(tree):
    parents = tree.parents.tolist()
    assert all(p < i for i, p in enumerate(parents))
    probs = tree.probs
    assert probs[tree.parents < 0].sum() <= 1 + 1e-12
    for i, p in enumerate(parents):
        assert 0 < probs[i] <= 1
        if p >= 0:
            assert probs[i] <= probs[p]
    # children in order of preference: non-increasing probability
    for node in [-1, *range(tree.size)]:
        kids = [i for i, p in enumerate(parents) if p == node]
        assert list(probs[kids]) == sorted(probs[kids], reverse=True)
        assert len({tree.tokens[i] for i in kids}) == len(kids)  # siblings differ


def motif_text(rng, length, vocab=12, motifs=4, motif_len=5):
    """Random tokens with a few motifs repeated, so n-grams recur with varied continuations."""
    pieces = [rng.integers(0, vocab, motif_len) for _ in range(motifs)]
    out = []
    while len(out) < length:
        out.extend(pieces[rng.integers(motifs)] if rng.random() < 0.6 else rng.integers(0, vocab, rng.integers(1, 4)))
    return np.asarray(out[:length], dtype=np.int64)


# ---- own text --------------------------------------------------------------------------------

def test_own_text_proposes_what_followed_the_latest_match():
    d = SuffixDrafter(max_ngram=3, min_ngram=1)
    proposal = d.propose(np.array([5, 6, 7, 8, 5, 6]), 2, GREEDY, np.random.default_rng(0))
    tokens, probs = proposal.tokens, proposal.probs
    assert tokens.tolist() == [7, 8] and tokens.dtype == np.int64 and probs is None
    # the latest of two equally long matches comes first
    d.reset()
    assert d.propose(np.array([1, 2, 3, 1, 2, 4, 1, 2]), 1, GREEDY, None).tokens.tolist() == [4]


def test_the_longest_match_wins():
    # [2, 3] last continued with 8, but the longer [1, 2, 3] only ever with 9
    ids = np.array([1, 2, 3, 9, 4, 2, 3, 8, 0, 1, 2, 3])
    d = SuffixDrafter(max_ngram=3, min_ngram=1)
    assert d.propose(ids, 1, GREEDY, None).tokens.tolist() == [9]
    assert SuffixDrafter(max_ngram=2, min_ngram=1).propose(ids, 1, GREEDY, None).tokens.tolist() == [8]


def test_no_match_and_no_room_give_nothing():
    d = SuffixDrafter(max_ngram=3, min_ngram=2)
    assert d.propose_tree(np.array([1, 2, 3, 4, 5]), 8, 4).size == 0
    assert d.propose(np.array([1, 2, 3, 4, 5]), 4, GREEDY, None).tokens.shape == (0,)
    assert d.propose_tree(np.array([1, 2, 1, 2]), 0, 4).size == 0
    assert d.propose_tree(np.array([1, 2, 1, 2]), 4, 0).size == 0
    assert d.propose_tree(np.array([7]), 4, 4).size == 0


def test_never_past_the_text_end():
    d = SuffixDrafter(max_ngram=2, min_ngram=2)
    tree = d.propose_tree(np.array([4, 5, 6, 4, 5]), 16, 16)  # [4, 5] was followed by 6, 4, 5, then the end
    assert tree.tokens.tolist() == [6, 4, 5] and tree.is_chain()


# ---- the tree --------------------------------------------------------------------------------

def test_two_continuations_make_two_branches_the_more_frequent_first():
    #          [1, 2] -> 3 7 1     [1, 2] -> 3 8 1     [1, 2] -> 4 6 1
    ids = np.array([9, 1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 4, 6, 1, 2])
    tree = SuffixDrafter(max_ngram=2, min_ngram=2).propose_tree(ids, 16, 3)
    assert_well_formed(tree)
    top = tree.children(-1).tolist()
    assert tree.tokens[top].tolist() == [3, 4]  # 3 twice, 4 once
    np.testing.assert_allclose(tree.probs[top], [2 / 3, 1 / 3])
    three = top[0]
    assert tree.tokens[tree.children(three)].tolist() == [8, 7]  # equal counts: the more recent first
    assert tree.tokens.tolist() == [3, 8, 1, 7, 1, 4, 6, 1]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 3, -1, 5, 6]


def test_budget_caps_the_nodes_and_max_depth_the_depth():
    ids = motif_text(np.random.default_rng(1), 400, vocab=6)
    full = SuffixDrafter(max_ngram=2, min_ngram=2).propose_tree(ids, 10_000, 6)
    assert full.size > 20 and full.depths().max() == 6
    for budget in (1, 2, 5, 13, full.size, full.size + 5):
        tree = SuffixDrafter(max_ngram=2, min_ngram=2).propose_tree(ids, budget, 6)
        assert tree.size == min(budget, full.size)
        assert_well_formed(tree)
    for depth in (1, 2, 3):
        tree = SuffixDrafter(max_ngram=2, min_ngram=2).propose_tree(ids, 10_000, depth)
        assert tree.depths().max() == depth


def test_the_tree_matches_its_reference():
    rng = np.random.default_rng(2)
    for _ in range(300):
        continuations = [rng.integers(0, 4, rng.integers(1, 6)).tolist() for _ in range(rng.integers(1, 12))]
        budget = int(rng.integers(1, 30))
        tree = continuation_tree(continuations, budget)
        assert_same_tree(tree, *reference_tree(continuations, budget))
        assert_well_formed(tree)


def test_propose_is_the_trees_main_chain():
    rng = np.random.default_rng(3)
    for _ in range(50):
        ids = motif_text(rng, int(rng.integers(20, 200)), vocab=8)
        k = int(rng.integers(1, 9))
        tree = SuffixDrafter(max_ngram=4, min_ngram=2).propose_tree(ids, k, k)
        proposal = SuffixDrafter(max_ngram=4, min_ngram=2).propose(ids, k, GREEDY, None)
        tokens, probs = proposal.tokens, proposal.probs
        assert tokens.tolist() == main_chain(tree).tolist() and probs is None


# ---- lookup against the brute-force scan, incrementally ---------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_incremental_indexing_equals_indexing_afresh_and_the_scan(seed):
    rng = np.random.default_rng(seed)
    max_ngram, min_ngram = int(rng.integers(2, 6)), int(rng.integers(1, 3))
    docs = [motif_text(rng, int(rng.integers(5, 80))) for _ in range(int(rng.integers(0, 4)))]
    index = SuffixIndex(max_tokens=10_000, max_ngram=max_ngram, min_ngram=min_ngram)
    for doc in docs:
        index.add(doc)
    grown = SuffixDrafter(max_ngram, min_ngram, index)
    text = motif_text(rng, 300)
    length = 1
    while length <= text.shape[0]:
        ids = text[:length]
        budget, depth = int(rng.integers(1, 24)), int(rng.integers(1, 7))
        tree = grown.propose_tree(ids, budget, depth)
        fresh = grown.fork().propose_tree(ids, budget, depth)
        assert_same_tree(tree, fresh.tokens.tolist(), fresh.parents.tolist(), fresh.probs.tolist())
        expected = reference_continuations(ids, docs, max_ngram, min_ngram, depth)
        assert_same_tree(tree, *reference_tree(expected, budget))
        length += int(rng.integers(1, 6))
    # a new request without reset: the text no longer extends the indexed one
    other = motif_text(rng, 120)
    assert_same_tree(grown.propose_tree(other, 20, 5), *reference_tree(
        reference_continuations(other, docs, max_ngram, min_ngram, 5), 20))


def test_a_missed_reset_with_a_shorter_text_reindexes():
    d = SuffixDrafter(max_ngram=3, min_ngram=1)
    d.propose_tree(np.array([1, 2, 3, 4, 1, 2, 3, 5, 1, 2]), 4, 4)
    assert d.propose(np.array([1, 2, 9, 1, 2]), 1, GREEDY, None).tokens.tolist() == [9]


# ---- the shared index --------------------------------------------------------------------------

def test_a_later_request_draws_on_a_remembered_one():
    d = SuffixDrafter(max_ngram=3, min_ngram=2)
    first = np.array([10, 11, 12, 13, 14, 15, 16])
    d.propose_tree(first[:5], 4, 4)
    d.remember(first)
    d.reset()
    assert len(d.index) == 1 and d.index.tokens == 7
    assert d.propose(np.array([1, 2, 12, 13]), 3, GREEDY, None).tokens.tolist() == [14, 15, 16]
    # the request's own text and the index together: one occurrence each, own first
    tree = SuffixDrafter(max_ngram=3, min_ngram=2, index=d.index).propose_tree(np.array([12, 13, 9, 12, 13]), 8, 1)
    assert tree.tokens.tolist() == [9, 14] and tree.probs.tolist() == [0.5, 0.5]


def test_a_longer_match_in_the_index_beats_the_own_text():
    index = SuffixIndex(max_ngram=4, min_ngram=2)
    index.add(np.array([1, 2, 3, 4, 50]))
    d = SuffixDrafter(max_ngram=4, min_ngram=2, index=index)
    assert d.propose(np.array([3, 4, 60, 1, 2, 3, 4]), 1, GREEDY, None).tokens.tolist() == [50]


def test_a_private_request_neither_reads_nor_joins_the_index():
    d = SuffixDrafter(max_ngram=3, min_ngram=2)
    d.remember(np.array([10, 11, 12, 13]))
    private = d.fork()
    private.private = True
    assert private.propose_tree(np.array([5, 11, 12]), 4, 4).size == 0  # only in the index
    assert private.propose(np.array([11, 12, 7, 11, 12]), 1, GREEDY, None).tokens.tolist() == [7]  # own text still
    private.remember(np.array([20, 21, 22, 23]))
    assert len(d.index) == 1 and d.propose_tree(np.array([20, 21]), 4, 4).size == 0
    private.reset()
    assert private.private  # the session sets it per request; reset does not undo it


def test_fork_shares_the_index_not_the_request():
    d = SuffixDrafter(max_ngram=3, min_ngram=2)
    d.propose_tree(np.array([1, 2, 3, 1, 2]), 4, 4)
    worker = d.fork()
    assert worker.index is d.index
    assert worker.propose_tree(np.array([8, 1, 2]), 4, 4).size == 0  # d's request is d's own
    worker.remember(np.array([30, 31, 32, 33]))
    assert d.propose(np.array([31, 32]), 1, GREEDY, None).tokens.tolist() == [33]


def index_entries(index):
    return sum(1 if type(v) is int else len(v) for table in index._tables.values() for v in table.values())


def test_lru_eviction_bounds_the_tokens_and_drops_the_least_recently_used():
    index = SuffixIndex(max_tokens=30, max_ngram=2, min_ngram=2)
    docs = {name: np.arange(10) + base for name, base in (("a", 100), ("b", 200), ("c", 300), ("d", 400))}
    for name in "abc":
        index.add(docs[name])
    assert index.tokens == 30 and len(index) == 3
    n, where = index.find(np.array([100, 101]))  # drawing on a makes b the least recently used
    assert n == 2 and index.draw(where, 3) == [[102, 103, 104]]
    index.add(docs["d"])
    assert index.tokens == 30 and len(index) == 3
    assert index.find(np.array([200, 201]))[0] == 0
    assert all(index.find(docs[name][:2])[0] == 2 for name in "acd")
    assert index_entries(index) == 3 * 8  # 8 bigrams with something after them, per document
    index.add(np.arange(45) + 500)  # longer than the whole store: its last 30 tokens
    assert index.tokens == 30 and len(index) == 1 and index_entries(index) == 28
    assert index.find(np.array([515, 516]))[0] == 2 and index.find(np.array([514, 515]))[0] == 0


def test_eviction_leaves_the_index_as_if_built_from_the_survivors():
    rng = np.random.default_rng(4)
    index = SuffixIndex(max_tokens=300, max_ngram=4, min_ngram=2)
    kept = []  # the reference LRU, least recently used first: (document number, tokens)
    added = 0
    for _ in range(80):
        if kept and rng.random() < 0.4:  # a lookup that draws on one document
            doc = kept[int(rng.integers(len(kept)))][1]
            n, where = index.find(doc[: int(rng.integers(2, 6))])
            if n:
                index.draw(where[:1], 2)
                used = next(entry for entry in kept if entry[0] == where[0][0])
                kept.remove(used)
                kept.append(used)
        else:
            doc = motif_text(rng, int(rng.integers(3, 90)), vocab=8)
            index.add(doc)
            kept.append((added, doc))
            added += 1
            while sum(d.size for _, d in kept) > 300:
                kept.pop(0)
        assert list(index._docs) == [i for i, _ in kept]
        assert index.tokens == sum(d.size for _, d in kept) <= 300
        assert index_entries(index) == sum(max(0, d.size - n) for _, d in kept for n in range(2, 5))
    rebuilt = SuffixIndex(max_tokens=300, max_ngram=4, min_ngram=2)
    for _, doc in kept:
        rebuilt.add(doc)
    for _ in range(200):
        tail = motif_text(rng, 4, vocab=8)
        n, where = index.find(tail, limit=1000)
        n2, where2 = rebuilt.find(tail, limit=1000)
        assert n == n2 and sorted(index.draw(where, 3)) == sorted(rebuilt.draw(where2, 3))


def test_threads_share_one_index_safely():
    index = SuffixIndex(max_tokens=2_000, max_ngram=4, min_ngram=2)
    errors = []

    def work(seed):
        try:
            rng = np.random.default_rng(seed)
            drafter = SuffixDrafter(4, 2, index)
            for _ in range(40):
                text = motif_text(rng, int(rng.integers(20, 200)), vocab=10)
                drafter.reset()
                for end in range(10, text.size, 7):
                    tree = drafter.propose_tree(text[:end], 16, 5)
                    assert tree.size <= 16
                drafter.remember(text)
                assert index.tokens <= 2_000
        except Exception as e:  # noqa: BLE001 - reported below, with the thread's seed
            errors.append((seed, e))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert 0 < index.tokens <= 2_000
    assert index_entries(index) == sum(max(0, d.size - n) for d in index._docs.values() for n in range(2, 5))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_ngram"):
        SuffixIndex(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixIndex(max_tokens=0)
    with pytest.raises(ValueError, match="min_ngram"):
        SuffixDrafter(max_ngram=4, min_ngram=0)
