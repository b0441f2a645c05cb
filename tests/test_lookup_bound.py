"""benchmarks/lookup_bound.py: the oracle that bounds model-free drafting, on sequences whose
answer is known (no models)."""
import doctest
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parents[1]
from benchmarks import lookup_bound as bound


def test_docstring_examples():
    assert doctest.testmod(bound).failed == 0


def test_an_output_that_repeats_the_prompt_commits_depth_plus_one_a_pass():
    """The prompt said it all: every round verifies `depth` held tokens and the target's own."""
    rng = np.random.default_rng(0)
    prompt = rng.permutation(1000)[:200]  # no token twice: each context occurs once
    out = prompt[10:10 + 90].copy()  # the answer copies the prompt from its 11th token
    prompt = np.concatenate([prompt, prompt[8:10]])  # ... after the two tokens it ends with
    for c in (2, 1, 0):
        per_pass, _ = bound.replay(prompt, out, np.empty(0, dtype=np.int64), c, depth=8)
        assert per_pass == 90 / 10, c  # 10 rounds of 9 tokens


def test_new_tokens_commit_one_a_pass_and_a_shared_corpus_supplies_them():
    """Tokens never seen before: one a pass. The same output in an earlier request: the shared
    scope finds it, the own scope does not; a separator keeps texts from running into each other."""
    prompt = np.arange(100, 120)
    out = np.arange(500, 564)
    empty = np.empty(0, dtype=np.int64)
    assert bound.replay(prompt, out, empty, 1, depth=8)[0] == 1.0
    earlier = np.concatenate([prompt, out, [bound.SEPARATOR]])
    for c in (2, 1, 0):  # rounds of 9 tokens, then the 64th alone: 8 rounds
        assert bound.replay(prompt, out, earlier, c, depth=8)[0] == 8.0, c
    assert bound.replay(prompt, out, empty, 2, depth=8)[0] == 1.0


def test_a_context_must_match_in_full():
    """c = 2 finds only continuations after both last tokens; c = 1 after the last alone."""
    corpus = np.array([1, 2, 3, 4, 9, 2, 7, 8, 5, 2])  # "2" occurs after 1, 9, 5; "5 2" only at the end
    assert bound.best_continuation(corpus, 2, np.array([7, 8]), 8) == (0, 0)
    assert bound.best_continuation(corpus, 1, np.array([7, 8]), 8) == (2, 2)
    assert bound.best_continuation(corpus, 1, np.array([3, 4, 9]), 2) == (2, 2)  # capped at the depth


def test_the_suffix_drafter_never_beats_the_bound_of_its_context():
    """The suffix index's trees (any budget) over texts with repeats: their tokens per pass stay
    at or under the oracle's at c = 2 (their shortest context), and reach it on 9 of the 20
    texts: the bound is tight where the index keeps every occurrence. (The bound without a
    context, c = 0, is reached on none: a loose bound fails the second assertion.)"""
    from specdeploy.runtime.decoding.drafters import SuffixDrafter
    from specdeploy.runtime.decoding.accept import accept_tree

    rng = np.random.default_rng(1)
    reached = 0
    for trial in range(20):
        motifs = [rng.integers(0, 30, rng.integers(3, 9)) for _ in range(4)]
        text = np.concatenate([motifs[rng.integers(4)] if rng.random() < 0.7 else rng.integers(0, 30, 2)
                               for _ in range(40)])
        prompt, out = text[:60], text[60:140]
        drafter = SuffixDrafter(max_ngram=8, min_ngram=2)
        drafter.private = True
        p, rounds = 0, 0
        while p < out.shape[0]:
            tree = drafter.propose_tree(np.concatenate([prompt, out[:p]]), 10_000, 8)
            truth = out[p:]
            depths = np.concatenate([[0], tree.depths()])  # row 0 is the root, row i + 1 node i

            def target_token(row):  # greedy verification against the known output: its token at that depth
                return int(truth[depths[row]]) if depths[row] < truth.shape[0] else -1

            path, _ = accept_tree(tree, target_token)
            p += min(len(path), out.shape[0] - p - 1) + 1
            rounds += 1
        drafted = out.shape[0] / rounds
        bound_, _ = bound.replay(prompt, out, np.empty(0, dtype=np.int64), 2, depth=8)
        assert drafted <= bound_ + 1e-9, (trial, drafted, bound_)
        reached += drafted == bound_
    assert reached >= 5, reached
