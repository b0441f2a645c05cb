"""Token trees: greedy tree rounds equal plain decoding and Hugging Face `generate` token for
token; tree rows on the main chain equal single steps bit for bit (side branches: up to
rounding); the accepted path's K/V moved into place equal a fresh prefill's; sampled tree
rounds keep the target's distribution (chi-square, with a companion that catches a sampler
always following the first child)."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdeploy.runtime import InputError, Session
from specdeploy.runtime.decoding import accept as accept_module
from specdeploy.runtime.decoding.drafters import Proposal
from specdeploy.runtime.decoding.tree import DraftTree
from test_lossless import NEW_TOKENS, hf_greedy
from test_sampling import ALPHA, SAMPLES, SETTINGS, chi_square_pvalue, exact_first_two
from tiny import VOCAB
from tiny import PROMPTS


class OracleTrees:
    """A test drafter: knows the plain continuation of each prompt (`answers`) and hides it in
    trees among decoys, the true branch rarely first, sometimes wrong deep down, sometimes
    missing, with nested decoys inside it, so accepted paths leave the main chain and the K/V
    move runs."""

    kind = "oracle"
    proposes_trees, keeps_history = True, False
    engine = None
    cost_ratio = 0.0
    private = False

    def __init__(self, answers: dict[tuple, list[int]], vocab: int, seed: int = 0):
        self.answers = answers
        self.vocab = vocab
        self.rng = np.random.default_rng(seed)
        self.trees = []

    def reset(self):
        pass

    def fused_with(self, target):
        return False

    def _truth(self, ids):
        for prompt, answer in self.answers.items():
            n = len(prompt)
            if tuple(ids[:n].tolist()) == prompt:
                return answer[ids.shape[0] - n :]
        raise AssertionError("an unknown prompt")

    def propose_tree(self, ids, budget, max_depth):
        truth = self._truth(ids)[:max_depth]
        rng = self.rng
        tokens, parents = [], []

        def branch(parent, seq):
            for tok in seq:
                tokens.append(int(tok))
                parents.append(parent)
                parent = len(tokens) - 1
            return parent

        def decoy(parent, depth, avoid):
            seq = rng.integers(0, self.vocab, depth)
            seq[0] = (avoid + 1 + rng.integers(0, self.vocab - 1)) % self.vocab if avoid is not None else seq[0]
            branch(parent, seq)

        first = truth[0] if truth else None
        if rng.random() < 0.7:  # a decoy first, so the true branch is not the main chain
            decoy(-1, int(rng.integers(1, max_depth + 1)), first)
        if truth and rng.random() < 0.9:
            cut = int(rng.integers(1, len(truth) + 1))
            seq = list(truth[:cut])
            if cut < len(truth) and rng.random() < 0.5:
                seq.append((truth[cut] + 1) % self.vocab)  # wrong deep down
            node = -1
            for depth, tok in enumerate(seq):
                if depth > 0 and rng.random() < 0.3:  # a nested decoy before the true child
                    decoy(node, 1, tok)
                tokens.append(int(tok))
                parents.append(node)
                node = len(tokens) - 1
        if rng.random() < 0.5:
            decoy(-1, 2, first)
        tree = DraftTree(np.array(tokens, dtype=np.int64), np.array(parents, dtype=np.int64))
        tree = tree.prune(budget)
        self.trees.append(tree)
        return tree

    def propose(self, ids, k, params, rng, min_confidence=0.0):
        return Proposal(self.propose_tree(ids, k, k).main_chain())


@pytest.fixture(scope="module")
def llama(bundles, models):
    session = Session(bundles("llama-ngram"), prompt_cache=False)
    hf = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32).eval()
    answers = {}
    for prompt in PROMPTS:
        ids = session.encode(prompt)
        plain = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False).token_ids
        with torch.no_grad():
            assert plain == hf_greedy(hf, ids, session.eos_token_ids), prompt
        answers[tuple(ids)] = plain + [0] * 40  # past the end: anything
    return session, answers


@pytest.mark.parametrize("nodes", [2, 4, 8, 16, "auto"])
def test_greedy_trees_equal_plain_and_hf_generate(llama, nodes):
    session, answers = llama
    session.drafter = drafter = OracleTrees(answers, session.target.vocab_size, seed=len(str(nodes)))
    assert session.tree_capable()
    moves = []
    move = session.target.move_kv
    session.target.move_kv = lambda source, start: (moves.append(source.copy()), move(source, start))
    try:
        off_main = 0
        for ids, answer in answers.items():
            result = session.generate(prompt_ids=list(ids), max_new_tokens=NEW_TOKENS, tree_nodes=nodes)
            plain = answer[: len(result.token_ids)]
            assert result.token_ids == plain, ids
            assert len(result.token_ids) == NEW_TOKENS or result.stats.finish_reason == "eos"
            assert result.stats.tree_sizes and result.stats.target_passes == len(result.stats.tree_sizes)
            off_main += sum(1 for p in result.stats.path_lengths if p)
            assert max(result.stats.tree_sizes) <= (nodes if nodes != "auto" else 32)
    finally:
        del session.target.move_kv
    assert moves, "no accepted path left the main chain: the K/V move never ran"
    if nodes != 2:  # a path of two off the main chain needs three nodes
        assert any(len(m) > 1 for m in moves)
    assert max(t.size for t in drafter.trees) > 1


def test_main_chain_rows_equal_single_steps_bit_for_bit(llama):
    """The main chain is written where a chain round writes it, so its rows attend over the same
    values at the same slots as single steps: bit-identical, side branches or not."""
    session, answers = llama
    target = session.target.fork()
    ids, answer = next((k, v) for k, v in answers.items() if len(k) > 20)
    ids = np.array(ids)
    n = ids.shape[0]
    target.forward(ids[:-1], 0)
    steps = [target.forward(np.array([t]), n - 1 + i).copy()[0] for i, t in enumerate([ids[-1]] + answer[:5])]
    tree = DraftTree(np.array(answer[:5] + [7, 8, 9]), np.array([-1, 0, 1, 2, 3, -1, 5, 1]))
    target.forward(ids[:-1], 0)
    rows = target.forward(np.concatenate([ids[-1:], tree.tokens]), n - 1, tree=tree.layout()).copy()
    for i in range(6):
        assert np.array_equal(rows[i], steps[i]), i


def test_moved_kv_equals_a_fresh_prefill(llama):
    """After a tree round whose path is a side branch, the K/V moved into place give the next
    pass the logits a fresh prefill of the same committed tokens gives, up to rounding: a side
    branch's rows attend over the same values as single steps but at other slots, and ONNX
    Runtime's blocked sums round them apart (not bit for bit: that holds for the main chain)."""
    session, answers = llama
    ids, answer = next((k, v) for k, v in answers.items() if len(k) > 10)
    ids = np.array(ids)
    n = ids.shape[0]
    target = session.target.fork()
    target.forward(ids[:-1], 0)
    # decoys first, the truth as the second branch of the root and with a decoy sibling inside
    tree = DraftTree(np.array([3, 4, answer[0], 5, answer[1], answer[2]]), np.array([-1, 0, -1, 2, 2, 4]))
    rows = target.forward(np.concatenate([ids[-1:], tree.tokens]), n - 1, tree=tree.layout()).copy()
    path, token = accept_module.accept_tree(tree, lambda r: rows[r].argmax())
    assert path == [2, 4, 5] and token == answer[3]
    target.move_kv(n + np.array(path), n)
    after = target.forward(np.array([token]), n + 3).copy()
    fresh = session.target.fork()
    committed = np.concatenate([ids, answer[:3]])
    fresh.forward(committed, 0)
    expected = fresh.forward(np.array([token]), n + 3).copy()
    np.testing.assert_allclose(after, expected, rtol=0, atol=1e-5)  # measured: 7e-7 (side rows round apart)
    assert after.argmax() == expected.argmax() == answer[4]


def test_tree_nodes_errors(bundles, llama):
    session, _ = llama
    with pytest.raises(InputError, match=r"tree nodes 0 is outside \[1, 32\]"):
        session.generate("hello", max_new_tokens=2, tree_nodes=0)
    with pytest.raises(InputError, match="tree nodes 'x': expected an integer"):
        session.generate("hello", max_new_tokens=2, tree_nodes="x")
    plain_drafts = Session(bundles("llama-self"))
    with pytest.raises(InputError, match="cannot verify token trees"):
        plain_drafts.generate("hello", max_new_tokens=2, tree_nodes=4)
    # auto and 1 fall back to chains
    assert plain_drafts.generate("hello", max_new_tokens=4, tree_nodes="auto").stats.tree_sizes == []
    assert plain_drafts.generate("hello", max_new_tokens=4, tree_nodes=1).stats.tree_sizes == []


# -- sampled trees keep the target's distribution --------------------------------------------------

class TopTrees:
    """Proposes, at every round, the target's own three likeliest first tokens as siblings, each
    with its three likeliest successors: the sampled walk meets real branching."""

    kind = "top"
    proposes_trees, keeps_history = True, False
    engine = None
    cost_ratio = 0.0
    private = False

    def __init__(self, target):
        self.target = target.fork()

    def reset(self):
        pass

    def fused_with(self, target):
        return False

    def propose_tree(self, ids, budget, max_depth):
        self.target.forward(ids[:-1], 0)
        first = self.target.forward(ids[-1:], ids.shape[0] - 1)[0]
        tokens, parents = [], []
        for a in np.argsort(-first)[:3]:
            tokens.append(int(a))
            parents.append(-1)
            root_child = len(tokens) - 1
            if max_depth > 1:
                second = self.target.forward(np.array([a]), ids.shape[0])[0]
                for b in np.argsort(-second)[:3]:
                    tokens.append(int(b))
                    parents.append(root_child)
        return DraftTree(np.array(tokens), np.array(parents)).prune(budget)

    def propose(self, ids, k, params, rng, min_confidence=0.0):
        return Proposal(self.propose_tree(ids, k, k).main_chain())


def sampled_pairs(session, prompt, params, n):
    counts = {}
    for seed in range(n):
        kw = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed)
        ids = session.generate(prompt_ids=prompt, max_new_tokens=3, tree_nodes=12, **kw).token_ids
        counts[(ids[0], ids[1])] = counts.get((ids[0], ids[1]), 0) + 1
    return counts


@pytest.fixture(scope="module")
def small_tree(tmp_path_factory):
    import tiny

    from specdeploy.export import build_bundle

    root = tmp_path_factory.mktemp("small-tree")
    tiny.make_model(root / "t", "llama", seed=11, layers=2, vocab_size=VOCAB, initializer_range=0.5)
    build_bundle(root / "t", "ngram", root / "b", max_seq=32, max_draft=4, prefill_chunk=8)
    session = Session(root / "b", prompt_cache=False)
    session.eos_token_ids = []
    session.drafter = TopTrees(session.target)
    return session, [3, 5, 7, 3, 5]


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_sampled_trees_have_the_target_distribution(small_tree, setting):
    session, prompt = small_tree
    params = SETTINGS[setting]
    exact = exact_first_two(session, prompt, params)
    counts = sampled_pairs(session, prompt, params, SAMPLES)
    stats = session.generate(prompt_ids=prompt, max_new_tokens=3, tree_nodes=12, seed=0, temperature=1.0).stats
    assert stats.tree_sizes[0] == 12 and stats.target_passes == 1  # the walk ran in one tree pass
    pvalue, cells = chi_square_pvalue(exact, counts, SAMPLES)
    assert cells >= 5
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e} over {cells} cells"


def _first_child_always(tree, row_tokens):
    """A wrong tree sampler: follows the first child wherever there is one, without a draw."""
    path, node = [], -1
    while True:
        kids = tree.children(node)
        if kids.size == 0:
            return path, int(row_tokens(node + 1))
        node = int(kids[0])
        path.append(node)


def test_the_distribution_test_catches_a_tree_sampler_that_follows_the_first_child(small_tree, monkeypatch):
    session, prompt = small_tree
    params = SETTINGS[0]
    exact = exact_first_two(session, prompt, params)
    monkeypatch.setattr(accept_module, "accept_tree", _first_child_always)
    counts = sampled_pairs(session, prompt, params, SAMPLES)
    pvalue, _ = chi_square_pvalue(exact, counts, SAMPLES)
    assert pvalue < ALPHA, f"the broken sampler passed: p = {pvalue:.2e}"


# -- the suffix drafter end to end -----------------------------------------------------------------

def test_suffix_bundle_is_lossless_and_learns_from_earlier_requests(bundles, llama):
    """A `--draft suffix` bundle: greedy tree rounds equal plain decoding on every prompt; the
    second time round, the shared index holds the first round's answers and proposes them
    (far more tokens per pass); a private request draws on none of it."""
    _, answers = llama
    session = Session(bundles("llama-suffix"), prompt_cache=False)
    assert session.bundle.draft_kind == "suffix" and session.tree_capable()
    passes = {"first": 0, "again": 0, "private": 0}
    tokens = dict.fromkeys(passes, 0)
    for turn in passes:
        for ids, answer in answers.items():
            result = session.generate(prompt_ids=list(ids), max_new_tokens=NEW_TOKENS, private=turn == "private")
            assert result.token_ids == answer[: len(result.token_ids)], (turn, ids)
            assert result.stats.tree_sizes
            passes[turn] += result.stats.target_passes
            tokens[turn] += result.stats.new_tokens
    per_pass = {turn: tokens[turn] / passes[turn] for turn in passes}
    assert per_pass["again"] > 2 * per_pass["first"], per_pass
    assert per_pass["private"] < per_pass["again"] / 2, per_pass
    index = session.drafter.index
    held = index.tokens
    session.generate(prompt_ids=list(next(iter(answers))), max_new_tokens=8, private=True)
    assert index.tokens == held  # a private request left nothing behind


def test_pool_workers_share_one_suffix_index(bundles):
    from specdeploy.runtime.serving.pool import SessionPool

    pool = SessionPool(bundles("llama-suffix"), workers=2)
    drafters = [s.drafter for s in pool.sessions]
    assert len(drafters) == 2 and drafters[0] is not drafters[1]
    assert drafters[0].index is drafters[1].index
    pool.generate(PROMPTS[0], max_new_tokens=8)
    assert drafters[0].index.tokens > 0


def test_server_takes_tree_settings_and_reports_trees(bundles):
    import httpx

    from loopback import Server
    from specdeploy.runtime.serving.pool import SessionPool

    with Server(SessionPool(bundles("llama-suffix"), workers=1)) as s:
        for body in ({"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "tree_nodes": 4, "private": True},
                     {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}):
            r = httpx.post(s.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["specdeploy"]["tree_rounds"] > 0
        for bad, message in (({"tree_nodes": 0}, "outside [1, 32]"), ({"tree_nodes": "many"}, "integer or 'auto'"),
                             ({"private": "yes"}, "a boolean")):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "The", "max_tokens": 4, **bad})
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        text = httpx.get(s.url + "/metrics").text
        assert "specdeploy_tree_nodes_bucket" in text and "specdeploy_accepted_path_length_bucket" in text
        assert 'specdeploy_tree_nodes_count 0.0' not in text


def test_torch_backend_runs_tree_rounds_on_its_device(bundles):
    """The torch backend (what runs on CUDA): tree passes eager on its device, the K/V move a
    device copy; greedy tree rounds equal its own plain decoding."""
    session = Session(bundles("llama-suffix"), backend="torch", prompt_cache=False)
    assert session.target.trees
    answers = {}
    for prompt in PROMPTS[:8]:
        ids = session.encode(prompt)
        answers[tuple(ids)] = session.generate(prompt_ids=ids, max_new_tokens=24, speculate=False).token_ids + [0] * 30
    session.drafter = OracleTrees(answers, session.target.vocab_size, seed=3)
    moved = []
    move = session.target.move_kv
    session.target.move_kv = lambda source, start: (moved.append(len(source)), move(source, start))
    for ids, answer in answers.items():
        result = session.generate(prompt_ids=list(ids), max_new_tokens=24, tree_nodes=8)
        assert result.token_ids == answer[: len(result.token_ids)], ids
    assert moved and max(moved) > 1


# -- the tree-size policy --------------------------------------------------------------------------

def _tree_rounds(sizes, rounds, holds, probs, slope_seconds):
    """Feed the policy `rounds` tree rounds of a 16-node candidate scored `probs`, where the
    node of rank r is accepted when `holds(r)` and a pass of N nodes takes 1 + slope_seconds * N."""
    from specdeploy.runtime.decoding.policy import TreeSize
    from specdeploy.runtime.decoding.stats import Round

    chosen = []
    rank = TreeSize.ranks(probs, probs.shape[0])
    for _ in range(rounds):
        n = sizes.choose(probs, probs.shape[0])
        chosen.append(n)
        kept = np.sort(np.argsort(-probs, kind="stable")[:n])
        path = [i for i, node in enumerate(kept) if holds(rank[node])]
        sizes.update(Round(n, len(path), 1.0 + slope_seconds * n, 0.0, path=tuple(path), scores=probs[kept] if n else None))
    return chosen


def test_tree_size_follows_measured_acceptance_per_rank_and_the_pass_cost():
    from specdeploy.runtime.decoding.policy import TreeSize

    probs = np.linspace(0.9, 0.3, 16)  # a drafter sure of far too much
    # only the two best-ranked nodes ever hold: the tree shrinks to them, whatever the scores say,
    # with a wider try now and then (a rank left out drifts back to the drafter's score)
    tail = _tree_rounds(TreeSize(32), 60, lambda r: r < 2, probs, 0.02)[-20:]
    assert tail.count(2) >= 15 and min(tail) == 2, tail
    # every node holds and passes are cheap: the whole candidate
    assert _tree_rounds(TreeSize(32), 40, lambda r: True, probs, 0.02)[-5:] == [16] * 5
    # nothing holds: plain steps, with probes of one node ever further apart
    chosen = _tree_rounds(TreeSize(32), 200, lambda r: False, probs, 0.02)
    assert set(chosen[40:]) == {0, 1} and np.diff(np.flatnonzero(chosen))[-2:].tolist() == [64, 64]
    # the node of rank r holds with chance 0.8 ** r: cheap passes verify more nodes than dear ones
    rng = np.random.default_rng(0)
    holds = lambda r: rng.random() < 0.8 ** r  # noqa: E731
    cheap = np.median(_tree_rounds(TreeSize(32), 200, holds, probs, 0.02)[100:])
    dear = np.median(_tree_rounds(TreeSize(32), 200, holds, probs, 0.5)[100:])
    assert 1 <= dear < cheap, (dear, cheap)
