"""Batched passes and continuous batching (runtime/decoding/batch.py): every request's output in
a batch is the one it gets alone, token for token, greedy and seeded sampled, whatever joins
or leaves beside it."""
import threading
import time

import numpy as np
import pytest

import tiny
from specdeploy.core.errors import InputError
from specdeploy.runtime import Session
from specdeploy.runtime.decoding.batch import BatchPolicy, BatchSession, Overloaded
from specdeploy.runtime.decoding.policy import PassCost

# one request in five of each kind: different drafts, draft lengths, sampling and lengths in one batch
KINDS = [
    dict(),  # greedy, the batch's policy drafts
    dict(temperature=0.8, seed=3),  # sampled, its own policy drafts
    dict(draft_len=3),  # pinned
    dict(speculate=False),  # plain
    dict(temperature=1.0, top_k=20, top_p=0.9, seed=11, draft_len=2),
]


def jobs(n=len(tiny.PROMPTS)):
    return [(p, dict(KINDS[i % len(KINDS)], max_new_tokens=12 + 9 * (i % 4))) for i, p in enumerate(tiny.PROMPTS[:n])]


def solo(bundle, work, backend="ort"):
    session = Session(bundle, prompt_cache=False, backend=backend)
    return [session.generate(p, **kw).token_ids for p, kw in work]


def concurrently(batched, work, stagger=0.0):
    out = [None] * len(work)

    def run(i):
        p, kw = work[i]
        out[i] = batched.generate(p, **kw).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for t in threads:
        t.start()
        time.sleep(stagger)
    for t in threads:
        t.join()
    return out


def assert_a_batch_of_4_answers_each_as_alone(bundle, n=len(tiny.PROMPTS)):
    """The first n of `jobs` (greedy and seeded sampled, pinned and auto draft lengths, plain,
    different prompt lengths and finishing times), sent at once to a batch of 4 so that requests
    join as others leave: each one's tokens are Session's alone."""
    work = jobs(n)
    want = solo(bundle, work)
    batched = BatchSession(bundle, batch=4, max_queue=32)
    try:
        assert concurrently(batched, work, stagger=0.002) == want
        assert batched.rounds > 0
    finally:
        batched.close()


@pytest.mark.parametrize("name", ["llama-ngram", "llama-suffix", "qwen2-self", "mistral-model", "llama-same",
                                  "llama-self-int8"])
def test_every_request_in_a_batch_equals_it_alone(bundles, name):
    """Greedy and seeded sampled, pinned and auto draft lengths, plain, different prompt lengths
    and finishing times, requests joining as others leave: token for token what Session gives.
    Lookup drafts (ngram, suffix) and draft graphs (a self-draft, a separate model with a
    sliding window, the target drafting for itself: every draft accepted; its own int8 copy, a
    fused graph), each lane's draft in its own slot of the batch's draft engine."""
    assert_a_batch_of_4_answers_each_as_alone(bundles(name))


@pytest.mark.parametrize("backend", ["ort", "torch"])
def test_token_trees_in_a_batch_beside_chains_answer_each_request_as_alone(bundles, backend):
    """A suffix bundle over an exact float target verifies token trees in a batch: greedy auto
    lanes (the batch's policy prunes each lane's tree to the pass's width), a sampled lane with its
    own tree policy, a pinned tree size, beside a pinned chain and plain decoding, joining as others
    leave: each request's tokens are Session's alone (on the same backend). Trees with branches
    were verified, and accepted paths off the main chain moved their K/V within their lane's slot."""
    bundle = bundles("llama-suffix")
    kinds = [dict(), dict(temperature=0.8, seed=3, private=True), dict(tree_nodes=6), dict(draft_len=3),
             dict(speculate=False), dict(tree_nodes=6, draft_len=2)]
    work = [(p, dict(kinds[i % len(kinds)], max_new_tokens=30 + 7 * (i % 3))) for i, p in enumerate(tiny.PROMPTS)]
    want = solo(bundle, work, backend=backend)
    batched = BatchSession(bundle, batch=4, max_queue=32, backend=backend)
    moved = []
    move = batched.target.move_kv
    batched.target.move_kv = lambda *a, **kw: (moved.append(a), move(*a, **kw))
    try:
        results = [None] * len(work)

        def run(i):
            p, kw = work[i]
            results[i] = batched.generate(p, **kw)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
        for t in threads:
            t.start()
            time.sleep(0.002)
        for t in threads:
            t.join()
        assert [r.token_ids for r in results] == want
        assert any(any(n > 1 for n in r.stats.tree_sizes) for r in results)  # trees, not only chains, verified
        assert moved  # some accepted path left the main chain
    finally:
        batched.close()


def test_a_tree_size_the_bundle_cannot_verify_is_refused_in_a_batch_as_alone(bundles):
    """tree_nodes N >= 2 on a bundle whose drafter proposes no trees: the one-line refusal Session gives."""
    batched = BatchSession(bundles("llama-ngram"), batch=2)
    try:
        with pytest.raises(InputError, match="cannot verify token trees"):
            batched.generate(tiny.PROMPTS[0], max_new_tokens=5, tree_nodes=4)
        with pytest.raises(InputError, match="cannot verify token trees"):
            Session(bundles("llama-ngram")).generate(tiny.PROMPTS[0], max_new_tokens=5, tree_nodes=4)
    finally:
        batched.close()


def _started(batched, work):
    """Start each request in a thread, in order; return once all wait (under `hold`) or run."""
    gens = [None] * len(work)

    def start(i):
        p, kw = work[i]
        gens[i] = batched.stream(p, **kw)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(work))]
    deadline = time.monotonic() + 10
    for i, t in enumerate(threads):  # one after another: they queue, and take their slots, in this order
        t.start()
        while batched.waiting < i + 1 and gens[i] is None and time.monotonic() < deadline:
            time.sleep(0.001)
    return threads, gens


def collect(gen):
    return Session.collect(gen).token_ids


def joined_generations(batched, work):
    """The requests of `work` admitted together, in order, at one round boundary; -> their generations."""
    with batched.hold():
        threads, gens = _started(batched, work)
    for t in threads:
        t.join()
    return gens


def joined(batched, work):
    """As joined_generations; -> each one's tokens."""
    return [collect(g) for g in joined_generations(batched, work)]


def test_a_lane_that_leaves_moves_the_last_one_with_all_its_kv(bundles):
    """Three lanes join at one round: the first finishes early, so the last lane's slot moves
    into the first's, after that round's K/V were written (moving it before would lose its newest
    position's K/V and change its output)."""
    work = [(tiny.PROMPTS[0], dict(max_new_tokens=3, speculate=False)),
            (tiny.PROMPTS[10], dict(max_new_tokens=40, speculate=False)),
            (tiny.PROMPTS[16], dict(max_new_tokens=40, speculate=False))]
    want = solo(bundles("llama-ngram"), work)
    batched = BatchSession(bundles("llama-ngram"), batch=3)
    try:
        with batched.hold():  # admitted together, in order: slots 0, 1, 2
            threads, gens = _started(batched, work)
        for t in threads:
            t.join()
        assert [collect(g) for g in gens] == want
        assert gens[0].lane.slot == 2  # the first to leave went past the others, which closed up
    finally:
        batched.close()


def test_joining_and_leaving_mid_generation_changes_no_other_output(bundles):
    """A long request runs; others join while it is mid-generation, one is cancelled mid-way:
    the long one's tokens are still its tokens alone, and so are the others'."""
    bundle = bundles("llama-ngram")
    long = (tiny.PROMPTS[16], dict(max_new_tokens=60))
    joiners = [(tiny.PROMPTS[1], dict(max_new_tokens=20, temperature=0.7, seed=5)), (tiny.PROMPTS[4], dict(max_new_tokens=25))]
    want = solo(bundle, [long] + joiners)
    from loopback import slow_down

    batched = BatchSession(bundle, batch=4)
    slow_down(batched, 0.005)  # the quitter is still running when it is closed
    try:
        first = batched.stream(long[0], **long[1])
        got = next(first).token_ids  # it is mid-generation
        while len(got) < 10:
            got += next(first).token_ids
        quitter = batched.stream(tiny.PROMPTS[7], max_new_tokens=100)
        next(quitter)
        threads, gens = _started(batched, joiners)
        for t in threads:
            t.join()
        quitter.close()  # leaves mid-generation
        got += collect(first)
        assert got == want[0]
        assert [collect(g) for g in gens] == want[1:]
        assert quitter.stats.finish_reason == "cancelled"
    finally:
        batched.close()


def test_a_cancelled_request_frees_its_slot_for_a_waiting_one(bundles):
    """Limits before work (a full queue refuses at once), and a cancelled request's slot goes to
    the waiting one at the next round boundary: the cancelled lane runs no further round."""
    from loopback import slow_down

    batched = BatchSession(bundles("llama-ngram"), batch=1, max_queue=1)
    slow_down(batched, 0.01)  # 120 tokens take over a second: it is still running when cancelled
    try:
        gen = batched.stream(tiny.PROMPTS[0], max_new_tokens=120, speculate=False)
        next(gen)
        waiter = {}
        with batched.hold():
            t = threading.Thread(target=lambda: waiter.setdefault("gen", batched.stream(tiny.PROMPTS[1], max_new_tokens=5)))
            t.start()
            while batched.waiting < 1:
                time.sleep(0.001)
            with pytest.raises(Overloaded):  # the one slot busy, the one place in the queue taken
                batched.stream(tiny.PROMPTS[2], max_new_tokens=5)
            made = gen.stats.new_tokens
            assert made < 120
            gen.cancel()
        t.join(timeout=10)
        assert "gen" in waiter and len(collect(waiter["gen"])) > 0
        assert gen.stats.new_tokens == made and gen.lane.dropped
    finally:
        batched.close()


def test_a_prompt_that_extends_a_finished_one_reuses_its_slot(bundles):
    bundle = bundles("llama-ngram")
    batched = BatchSession(bundle, batch=2)
    try:
        first = batched.generate(tiny.PROMPTS[16], max_new_tokens=10)
        ids = batched.encode(tiny.PROMPTS[16]) + first.token_ids + batched.encode(" again")
        second = batched.generate(prompt_ids=ids, max_new_tokens=10)
        assert second.stats.cached_tokens > len(first.token_ids)
        alone = Session(bundle, prompt_cache=False).generate(prompt_ids=ids, max_new_tokens=10)
        assert second.token_ids == alone.token_ids
        private = batched.generate(prompt_ids=ids, max_new_tokens=10, private=True)
        assert private.stats.cached_tokens == 0 and private.token_ids == alone.token_ids
    finally:
        batched.close()


class Repeats:
    """A drafter that always proposes k tokens (its last token again): every round of a lane that
    drafts with it is as wide as its draft length allows."""

    keeps_history = proposes_trees = False
    engine = None  # model-free: a lookup, as the drafters declare

    def fork(self):
        return Repeats()

    def propose(self, ids, k, params, rng, min_confidence=0.0):
        from specdeploy.runtime.decoding.drafters import Proposal

        return Proposal(np.full(k, ids[-1], dtype=np.int64))


def test_sequences_near_the_end_of_the_buffer_pad_before_their_rows(bundles):
    """A verify pass wider than the room a lane has left after its rows: its padding goes before
    them (its own tokens recomputed in place), and its output is still its own."""
    bundle = bundles("llama-ngram")
    from conftest import MAX_SEQ

    session = Session(bundle, prompt_cache=False)
    long_ids = session.encode(" ".join(tiny.PROMPTS) * 2)[: MAX_SEQ - 12]
    assert len(long_ids) == MAX_SEQ - 12
    work = [(None, dict(prompt_ids=long_ids, max_new_tokens=12, speculate=False)),
            (tiny.PROMPTS[13], dict(max_new_tokens=40, draft_len=8))]
    want = [session.generate(prompt_ids=long_ids, max_new_tokens=12, speculate=False).token_ids,
            session.generate(tiny.PROMPTS[13], max_new_tokens=40, speculate=False).token_ids]
    batched = BatchSession(bundle, batch=2)
    batched.drafter = Repeats()
    widths = []
    forward = batched.target.forward_batch
    batched.target.forward_batch = lambda tokens, starts, **kw: (widths.append((tokens.shape, starts.tolist())),
                                                           forward(tokens, starts, **kw))[1]
    try:
        assert joined(batched, work) == want
        first_lane = [starts[0] for shape, starts in widths if shape[0] == 2]
        assert any(b < a for a, b in zip(first_lane, first_lane[1:]))  # its write index stepped back: padded before
    finally:
        batched.close()


def test_batch_sizes_the_bundle_was_not_exported_for_are_refused_in_one_line(bundles):
    with pytest.raises(InputError, match=r"batch 9: this bundle's graphs carry 1\.\.8 sequences"):
        BatchSession(bundles("llama-ngram"), batch=9)
    with pytest.raises(InputError, match="batched serving takes --backend ort or torch"):
        BatchSession(bundles("llama-ngram"), batch=2, backend="trt")


def test_memory_per_sequence_is_one_slot_of_kv(bundles):
    batched = BatchSession(bundles("llama-ngram"), batch=2)
    spec = batched.bundle.model("target")
    assert batched.memory_per_sequence == spec.kv_bytes(batched.bundle.max_seq)
    batched.close()


# -- the policy ---------------------------------------------------------------------------------

def _measured(v1: float, slope: float, max_t: int = 9) -> PassCost:
    cost = PassCost(max_tokens=max_t)
    for _ in range(20):
        for t in (1, 2, 3):
            cost.add(t, v1 + slope * (t - 1))
    return cost


def test_policy_drafts_where_wide_passes_are_cheap_and_stops_where_they_are_dear():
    """One batch size where a wide pass costs 5% more a token (B = 1 on a memory-bound pass), one
    where it costs 60% (B = 8 on two cores): the same lanes, the same acceptance."""
    policy = BatchPolicy(max_draft=8)
    holds = np.full(4, 0.6)
    policy.costs[1] = _measured(6.0, 0.3)
    policy.costs[8] = _measured(16.0, 9.6)
    assert policy.choose(1, 1, [(4, holds)]) > 1
    assert policy.choose(8, 1, [(4, holds)] * 8) in (1, 2)  # plain, or a probe now and then
    picks = [policy.choose(8, 1, [(4, holds)] * 8) for _ in range(64)]
    assert picks.count(1) >= 56  # the probes are rare


def test_policy_settled_on_plain_steps_looks_nothing_up_but_probes():
    """Once plain steps won at a batch size, the next rounds there look no chain up (host work
    for nothing), except for a probe now and then; another batch size evaluates as ever."""
    policy = BatchPolicy(max_draft=8)
    policy.costs[8] = _measured(16.0, 9.6)
    policy.costs[1] = _measured(6.0, 0.3)
    holds = [(4, np.full(4, 0.6))] * 8
    assert policy.choose(8, 1, holds) in (1, 2)
    looked = [policy.looks(8) for _ in range(BatchPolicy.SETTLED - 1)]
    assert looked.count(False) >= BatchPolicy.SETTLED - 2
    assert policy.looks(1) and policy.choose(1, 1, [(4, np.full(4, 0.6))]) > 1


def test_policy_catches_a_cost_model_that_ignores_the_batch():
    """The companion: priced with B = 1's costs, the same 8 lanes would draft (and be slower)."""
    policy = BatchPolicy(max_draft=8)
    policy.costs[8] = _measured(6.0, 0.3)
    assert policy.choose(8, 1, [(4, np.full(4, 0.6))] * 8) > 1


def test_policy_widens_at_most_to_the_longest_chain_and_never_below_the_least():
    policy = BatchPolicy(max_draft=8)
    policy.costs[2] = _measured(6.0, 0.1)
    assert policy.choose(2, 1, [(2, np.full(2, 0.9)), (0, np.zeros(0))]) == 3
    assert policy.choose(2, 5, [(2, np.full(2, 0.9))]) == 5


def test_the_server_batches_concurrent_http_requests_and_answers_each_as_alone(bundles):
    """serve --batch over real loopback HTTP: concurrent completions, streamed and not, greedy and
    seeded sampled, each the text a Session gives it alone."""
    import httpx
    from loopback import Server, sse_text

    bundle = bundles("llama-ngram")
    work = [(p, dict(max_tokens=10 + 3 * i, temperature=0.9 if i % 3 == 1 else 0.0, seed=i, stream=i % 2 == 0))
            for i, p in enumerate(tiny.PROMPTS[:8])]
    session = Session(bundle, prompt_cache=False)
    want = [session.generate(p, max_new_tokens=kw["max_tokens"], temperature=kw["temperature"], seed=kw["seed"]).text
            for p, kw in work]
    batched = BatchSession(bundle, batch=4, max_queue=8)
    got = [None] * len(work)

    def ask(i, url):
        p, kw = work[i]
        body = {"prompt": p, **kw}
        if kw["stream"]:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                got[i] = sse_text(r)
        else:
            got[i] = httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]

    with Server(batched) as server:
        threads = [threading.Thread(target=ask, args=(i, server.url)) for i in range(len(work))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        health = server.health()
    assert got == want
    assert health["sessions"] == 4 and batched.rounds > 0


@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "buckets"])
def test_the_torch_backend_batches_each_request_as_alone(bundles, buckets):
    """The torch backend's batched engine, eager on the CPU: with `buckets`, the bookkeeping of
    its captured passes (batches padded to 1, 2, 4, 8 lanes, windows to powers of two) runs
    eager, padding lanes included, and changes nothing."""
    work = jobs(12)
    want = solo(bundles("llama-ngram"), work, backend="torch")
    batched = BatchSession(bundles("llama-ngram"), batch=4, max_queue=32, backend="torch")
    batched.target.buckets = buckets
    try:
        assert concurrently(batched, work, stagger=0.002) == want
        stats = batched.target.stats
        assert stats.passes > 0 and stats.replays == 0  # no GPU here: every pass eager
    finally:
        batched.close()


@pytest.mark.parametrize("name, most, backend", [("llama-model", 0.6, "ort"), ("llama-self-int8", 0.8, "ort"),
                                                ("llama-model", 0.6, "torch")])
def test_greedy_lanes_share_their_draft_passes(bundles, name, most, backend):
    """Three greedy lanes with a draft graph, joined at one round: their draft steps are passes
    of the batched draft engine for all of them (`most`: at most that share of the passes the
    lanes ran between them; a fused graph shares single-token steps only, its catch-ups go
    alone), and each answer is still its own alone. On ONNX Runtime a sampled lane beside them
    drafts alone and keeps its seed's tokens (on torch a sampled lane alone runs its round fused
    on the device, with a generator of its own: greedy lanes only there)."""
    work = [(tiny.PROMPTS[i], dict(max_new_tokens=24, draft_len=3)) for i in (2, 5, 9)]
    if backend == "ort":
        work.append((tiny.PROMPTS[12], dict(max_new_tokens=24, draft_len=3, temperature=0.8, seed=4)))
    want = solo(bundles(name), work, backend=backend)
    batched = BatchSession(bundles(name), batch=len(work), backend=backend)
    try:
        gens = joined_generations(batched, work)
        assert [collect(g) for g in gens] == want
        lanes_passes = sum(g.stats.draft_passes for g in gens)
        assert batched.draft.engine.runs < most * lanes_passes, (batched.draft.engine.runs, lanes_passes)
    finally:
        batched.close()


def test_the_torch_backend_copies_a_shared_prompt_instead_of_prefilling_it(bundles):
    """Three lanes of one prompt joined at one round on the torch batched engine: the later two
    copy the first's K/V of the prompt (`copy` on the device) and prefill nothing, and each
    answer is the one it gets alone (greedy, and sampled with their own seeds)."""
    prompt = "A prompt no request gave before: " + tiny.PROMPTS[7]
    work = [(prompt, dict(max_new_tokens=16)), (prompt, dict(max_new_tokens=16, temperature=0.9, seed=5)),
            (prompt, dict(max_new_tokens=16, temperature=0.9, seed=6))]
    want = solo(bundles("llama-ngram"), work, backend="torch")
    batched = BatchSession(bundles("llama-ngram"), batch=3, backend="torch")
    try:
        gens = joined_generations(batched, work)
        assert [collect(g) for g in gens] == want
        n = gens[0].stats.prompt_tokens
        assert [g.stats.cached_tokens for g in gens] == [0, n - 1, n - 1]  # the last one is each lane's first row
    finally:
        batched.close()


def test_the_torch_backend_refuses_to_batch_an_int_target(copy_of):
    import json

    folder = copy_of("llama-ngram")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["models"]["target"]["dtype"] = "int4"  # refused from the manifest, before anything is rebuilt
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match="not bit-identical from one pass shape to another"):
        BatchSession(folder, batch=2, backend="torch")


def test_a_prompt_wholly_in_a_slot_joins_the_decoding_lanes_at_once(bundles):
    """A one-token prompt (nothing to prefill) joins while another lane is still prefilling: it
    decodes beside the running lanes from its first round, each as alone."""
    bundle = bundles("llama-ngram")
    long_prompt = " ".join(tiny.PROMPTS)[:150]  # several prefill chunks
    work = [(tiny.PROMPTS[0], dict(max_new_tokens=30)), (long_prompt, dict(max_new_tokens=10)),
            ("a", dict(max_new_tokens=10))]
    want = solo(bundle, work)
    batched = BatchSession(bundle, batch=3)
    try:
        first = batched.stream(work[0][0], **work[0][1])
        got = next(first).token_ids
        with batched.hold():
            threads, gens = _started(batched, work[1:])
        for t in threads:
            t.join()
        assert got + collect(first) == want[0]
        assert [collect(g) for g in gens] == want[1:]
    finally:
        batched.close()


def test_finish_reasons_in_a_batch(bundles):
    """A stop string ends a request as "stop" (its slot freed), max_new_tokens as "length", a
    cancel as "cancelled": as Session says them."""
    bundle = bundles("llama-ngram")
    session = Session(bundle, prompt_cache=False)
    alone = session.generate(tiny.PROMPTS[0], max_new_tokens=30)
    stop = alone.text[8:12]
    assert stop and alone.stats.finish_reason == "length"
    batched = BatchSession(bundle, batch=2)
    try:
        for _ in range(3):  # the scheduler may drop the lane before or after the reader finishes
            got = batched.generate(tiny.PROMPTS[0], max_new_tokens=30, stop=[stop])
            want = session.generate(tiny.PROMPTS[0], max_new_tokens=30, stop=[stop])
            assert (got.text, got.stats.finish_reason) == (want.text, "stop")
        assert batched.generate(tiny.PROMPTS[0], max_new_tokens=30).stats.finish_reason == "length"
    finally:
        batched.close()


def test_a_stop_string_ends_the_lane_in_the_round_that_meets_it_whether_read_or_not(bundles):
    """The scheduler cuts a lane's text at its stop strings as the rounds commit: a request whose
    reader reads nothing still leaves the batch in the round that met its stop string (it decodes
    no round nobody reads), and its text and tokens are then Session's."""
    bundle = bundles("llama-ngram")
    session = Session(bundle, prompt_cache=False)
    alone = session.generate(tiny.PROMPTS[0], max_new_tokens=100, speculate=False)
    stop = alone.text[8:12]
    want = session.generate(tiny.PROMPTS[0], max_new_tokens=100, stop=[stop], speculate=False)
    assert stop and want.stats.finish_reason == "stop" and want.stats.new_tokens < 100
    batched = BatchSession(bundle, batch=2)
    try:
        gen = batched.stream(tiny.PROMPTS[0], max_new_tokens=100, stop=[stop], speculate=False)
        deadline = time.monotonic() + 30
        while batched.in_flight and time.monotonic() < deadline:  # nobody reads it meanwhile
            time.sleep(0.005)
        assert batched.in_flight == 0 and gen.stats.new_tokens == want.stats.new_tokens
        got = Session.collect(gen)
        assert (got.text, got.token_ids, got.stats.finish_reason) == (want.text, want.token_ids, "stop")
    finally:
        batched.close()


def test_servers_batch_by_default_where_the_bundle_and_the_memory_allow(copy_of):
    """What `serve` and `triton-repo` run when told neither a batch nor a pool (pool.default_batch):
    up to 8 lanes, fewer where half the machine's memory holds fewer KV slots, and one session where
    a batch cannot run the bundle (one sequence a pass, ONNX Runtime on a GPU, TensorRT)."""
    import json

    from specdeploy.core.manifest import load_bundle
    from specdeploy.runtime.serving.pool import default_batch

    path = copy_of("llama-ngram")
    bundle = load_bundle(path, verify=False)
    per_slot = bundle.manifest.kv_bytes()
    assert default_batch(bundle) == (8, "batches of up to 8")
    assert default_batch(bundle, "torch")[0] == 8
    assert default_batch(bundle, budget=3 * per_slot + 1)[0] == 3
    batch, why = default_batch(bundle, budget=per_slot)
    assert batch is None and "do not fit" in why
    for where in [dict(device="cuda"), dict(device="cuda:1", trt_ep=True)]:
        batch, why = default_batch(bundle, "ort", **where)
        assert batch is None and "not ort on cuda" in why
    assert default_batch(bundle, "trt")[0] is None
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["max_batch"] = 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    batch, why = default_batch(load_bundle(path, verify=False))
    assert batch is None and "one sequence a pass" in why


class Forks(Repeats):
    """A model-free drafter whose trees have two branches: the last token twice, and the one before
    it twice (Repeats' chains for lanes that draft chains)."""

    proposes_trees = True

    def fork(self):
        return Forks()

    def propose_tree(self, ids, room, max_depth):
        from specdeploy.runtime.decoding.tree import DraftTree

        a, b = int(ids[-1]), int(ids[-2])
        n = min(room, 4)
        return DraftTree(np.array([a, a, b, b])[:n], np.array([-1, 0, -1, 2])[:n], np.array([0.9, 0.8, 0.7, 0.6])[:n])


def test_a_tree_lane_near_the_end_of_the_buffer_pads_before_its_tree(bundles):
    """A tree lane with no room after its rows for the pass's width (a chain lane beside it drafts 8):
    its own tokens are recomputed before the root, its tree laid out after them, and its output is
    still its own."""
    bundle = bundles("llama-ngram")  # an exact fp32 target: it verifies trees
    from conftest import MAX_SEQ

    session = Session(bundle, prompt_cache=False)
    long_ids = session.encode(" ".join(tiny.PROMPTS) * 2)[: MAX_SEQ - 12]
    work = [(None, dict(prompt_ids=long_ids, max_new_tokens=12, tree_nodes=4)),
            (tiny.PROMPTS[13], dict(max_new_tokens=40, draft_len=8))]
    want = [session.generate(prompt_ids=long_ids, max_new_tokens=12, speculate=False).token_ids,
            session.generate(tiny.PROMPTS[13], max_new_tokens=40, speculate=False).token_ids]
    batched = BatchSession(bundle, batch=2)
    batched.drafter = Forks()
    laid = []  # each tree pass's row offsets
    forward = batched.target.forward_batch
    batched.target.forward_batch = lambda tokens, starts, **kw: (
        laid.extend(x.offsets.tolist() for x in kw.get("layouts") or [] if x is not None), forward(tokens, starts, **kw))[1]
    try:
        assert joined(batched, work) == want
        # recomputed rows at consecutive positions before the root, then the tree (offsets fall back):
        # unpadded, a tree's rows start [0, 1, 2, 1] here
        assert any(o[:4] == [0, 1, 2, 3] and o[-1] < len(o) - 1 for o in laid), laid
    finally:
        batched.close()


def test_a_burst_gets_every_place_the_batch_and_its_queue_offer(bundles):
    """`batch` N running plus `max_queue` Q waiting: a burst of N + Q is admitted whole (a request
    not yet in a slot counts once), the next is refused, and the refusal says what is true then."""
    batched = BatchSession(bundles("llama-ngram"), batch=2, max_queue=3)
    try:
        gens: list = []
        with batched.hold():  # the scheduler admits nobody: the whole burst waits at once
            threads = [threading.Thread(target=lambda i=i: gens.append(
                batched.stream(tiny.PROMPTS[i], max_new_tokens=4, speculate=False))) for i in range(5)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 10
            while batched.waiting < 5 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert batched.waiting == 5
            with pytest.raises(Overloaded, match=r"0 sequence\(s\) in the batch \(of 2\) and 5 request\(s\) waiting"):
                batched.stream(tiny.PROMPTS[6], max_new_tokens=4)
        for t in threads:
            t.join(timeout=30)
        assert len(gens) == 5 and all(len(collect(g)) > 0 for g in gens)
        assert batched.waiting == 0
    finally:
        batched.close()
