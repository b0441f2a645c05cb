"""The torch backend (eager on this CPU): the export stage's own module over static
buffers gives ONNX Runtime's logits, the same greedy output, and keeps its buffers.

The CUDA-graph path is proved on a GPU by proofs/gpu_check.py; here the fixed-window
formulation it captures runs eager and is checked against the exact window."""
import numpy as np
import pytest
import torch

from specdeploy.runtime import Session, load_bundle
from specdeploy.runtime.backends import make_engine
from specdeploy.runtime.backends.ort import OrtEngine
from specdeploy.core.graph_io import window_length
from specdeploy.runtime.backends.torch_engine import TorchEngine
from specdeploy.core.errors import BundleError
from tiny import PROMPTS

NEW_TOKENS = 24


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: a second intra-op thread only contends (torch's setting is process-wide)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# (start, T): a prefill chunk, single steps, verify passes, and passes that cross a window bucket
SCHEDULE = [(0, 16), (16, 1), (17, 9), (26, 1), (27, 2), (29, 5), (34, 1), (35, 30), (65, 1), (66, 9), (75, 1)]


def _engines(bundle_dir, role="target", **options):
    bundle = load_bundle(bundle_dir)
    spec = bundle.model(role)
    ort_engine = OrtEngine(bundle.file(spec.graph), spec, bundle.max_seq, threads=1)
    return ort_engine, TorchEngine.from_bundle(bundle, spec, device="cpu", **options)


@pytest.mark.parametrize("name, role", [("llama-model", "target"), ("llama-model", "draft"), ("mistral-model", "target")])
@pytest.mark.parametrize("buckets", [False, True])
def test_logits_match_onnx_runtime(bundles, name, role, buckets):
    """Every pass of the schedule, exact window and fixed (bucketed) window alike.
    Mistral's sliding window (40) is crossed by the later passes."""
    ort_engine, engine = _engines(bundles(name), role, buckets=buckets)
    ids = np.random.default_rng(1).integers(0, engine.vocab_size, size=SCHEDULE[-1][0] + SCHEDULE[-1][1])
    for start, t in SCHEDULE:
        want = ort_engine.forward(ids[start : start + t], start).copy()
        got = engine.forward(ids[start : start + t], start)
        assert got.shape == (t, engine.vocab_size) and got.dtype == np.float32
        scale = max(1.0, float(np.abs(want).max()))
        assert np.abs(got - want).max() / scale < 1e-4, (start, t)
        assert (got.argmax(-1) == want.argmax(-1)).all()


def test_fixed_window_is_the_exact_window(bundles):
    """The padded mask adds only exact zeros to each softmax: on the CPU the two
    formulations agree to rounding, and neither reads past the length."""
    bundle = load_bundle(bundles("llama-model"))
    spec = bundle.model("target")
    exact = TorchEngine.from_bundle(bundle, spec, device="cpu", buckets=False)
    fixed = TorchEngine.from_bundle(bundle, spec, device="cpu", buckets=True, min_window=8)
    ids = np.random.default_rng(2).integers(0, spec.vocab_size, size=80)
    for start, t in SCHEDULE[:-2]:
        a = exact.forward(ids[start : start + t], start)
        b = fixed.forward(ids[start : start + t], start)
        assert np.abs(a - b).max() < 1e-5, (start, t)
    # Slots past the length hold stale K/V from earlier passes, never read: a rolled-back
    # pass over garbage (finite: the model only writes finite values) gives the same logits.
    clean = fixed.forward(ids[30:35], 30).copy()
    for kv in fixed.kv_arrays:
        kv[:, :, 30:] = 1e4
    assert np.array_equal(fixed.forward(ids[30:35], 30), clean)


def test_window_bucket():
    assert [window_length(n - 1, 1, 64, 128) for n in (1, 63, 64, 65, 127, 128)] == [64, 64, 64, 128, 128, 128]
    assert window_length(4, 1, 4, 128) == 8
    assert window_length(699, 1, 64, 1000) == 1000  # capped at the buffer
    assert all(window_length(n - 1, 1, 64, 1000) >= n for n in range(1, 1001))


def test_lossless_loop_on_torch_equals_plain_and_ort(bundles):
    """Greedy speculative == plain on the torch backend == ONNX Runtime's output, token for token."""
    path = bundles("llama-model")
    ort_session = Session(path, threads=1)
    torch_session = Session(path, backend="torch")
    assert torch_session.target.stats.device == "cpu" and not torch_session.target.stats.capture
    for prompt in PROMPTS[:8]:
        ids = ort_session.encode(prompt)
        want = ort_session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False).token_ids
        plain = torch_session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False)
        assert plain.token_ids == want, prompt
        for k in (1, 2, 4, 8):
            spec = torch_session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert spec.token_ids == want, (prompt, k)


def test_self_draft_and_ngram_bundles_on_torch(bundles):
    for name in ("llama-self", "llama-ngram"):
        ort_session, torch_session = Session(bundles(name), threads=1), Session(bundles(name), backend="torch")
        ids = ort_session.encode(PROMPTS[16])
        want = ort_session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False).token_ids
        assert torch_session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=4).token_ids == want


def test_a_pool_of_torch_sessions_shares_weights_not_buffers(bundles):
    """SessionPool(backend="torch", workers=2): each worker forks the engines (one module, its
    weights shared) with KV buffers of its own; concurrent generations equal one run alone."""
    from concurrent.futures import ThreadPoolExecutor

    from specdeploy.runtime import SessionPool

    path = bundles("llama-model")
    pool = SessionPool(path, workers=2, backend="torch")
    first, second = pool.sessions
    assert first.target.graph is second.target.graph and first.drafter.engine.graph is second.drafter.engine.graph
    assert not set(first.target.kv_addresses()) & set(second.target.kv_addresses())
    assert not set(first.drafter.engine.kv_addresses()) & set(second.drafter.engine.kv_addresses())
    alone = Session(path, threads=1)
    prompts = PROMPTS[:6]
    want = [alone.generate(p, max_new_tokens=NEW_TOKENS, draft_len=3).token_ids for p in prompts]
    with ThreadPoolExecutor(2) as ex:
        got = list(ex.map(lambda p: pool.generate(p, max_new_tokens=NEW_TOKENS, draft_len=3).token_ids, prompts))
    assert got == want


def test_buffers_keep_their_addresses_and_only_target_passes_sync(bundles):
    session = Session(bundles("llama-model"), backend="torch")
    target, draft = session.target, session.drafter.engine
    target0, draft0 = target.kv_addresses(), draft.kv_addresses()
    assert target0 == [a.ctypes.data for a in target.kv_arrays]
    seen = []
    for _ in session.stream(PROMPTS[10], max_new_tokens=40, draft_len=4):
        seen.append((target.kv_addresses(), draft.kv_addresses()))
    assert len(seen) > 5 and all(t == target0 and d == draft0 for t, d in seen)
    session.generate(PROMPTS[2], max_new_tokens=10, speculate=False)
    assert target.kv_addresses() == target0
    for engine in (target, draft):
        s = engine.stats
        # greedy rounds are fused: a target pass syncs once, a draft step never
        assert s.passes > 0 and s.host_syncs == (s.passes if engine is target else 0) and s.eager == s.passes
        assert s.replays == 0 and s.graphs == [] and s.capture_error is None


def test_the_pass_writes_exactly_its_slots(bundles):
    _, engine = _engines(bundles("llama-model"))
    before = [kv.copy() for kv in engine.kv_arrays]
    engine.forward(np.array([5, 6, 7]), 10)
    for old, new in zip(before, engine.kv_arrays):
        assert np.flatnonzero((old != new).any(axis=(0, 1, 3))).tolist() == [10, 11, 12]


def test_boundary_errors_name_the_thing(bundles):
    _, engine = _engines(bundles("llama-model"))
    with pytest.raises(Exception, match=r"outside the KV buffer \[0, 128\)"):
        engine.forward(np.array([1, 2]), 127)
    with pytest.raises(Exception, match="outside the vocabulary"):
        engine.forward(np.array([engine.vocab_size]), 0)


def test_missing_source_is_a_bundle_error(bundles, tmp_path):
    import json
    import shutil

    copy = tmp_path / "moved"
    shutil.copytree(bundles("llama-model"), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["models"]["target"]["source"] = str(tmp_path / "gone")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    bundle = load_bundle(copy, verify=False)
    with pytest.raises(BundleError, match="rebuilds the target from its source model"):
        make_engine("torch", bundle, bundle.model("target"))


def test_capture_is_off_without_cuda(bundles):
    _, engine = _engines(bundles("llama-model"), capture=True)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: proofs/gpu_check.py covers capture")
    assert engine.capture is False and engine.buckets is False


def test_a_greedy_round_synchronises_the_host_once(bundles):
    """With a model draft, greedy rounds run fused: the draft chain on the device, the verify
    pass fed from device memory, one host synchronisation per round; output unchanged."""
    path = bundles("llama-model")
    ort_session = Session(path, threads=1)
    session = Session(path, backend="torch")
    target, draft = session.target, session.drafter.engine
    assert session.drafter.fused_with(target)
    for prompt in PROMPTS[:4]:
        want = ort_session.generate(prompt, max_new_tokens=NEW_TOKENS, speculate=False).token_ids
        for k in (1, 3, "auto"):
            t0, d0 = target.stats.host_syncs, draft.stats.host_syncs
            result = session.generate(prompt, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert result.token_ids == want, (prompt, k)
            # Prefill passes: the prompt's tokens but the last, less those the prompt cache held.
            fresh = len(session.encode(prompt)) - 1 - result.stats.cached_tokens
            prefill = -(-fresh // session.bundle.prefill_chunk)
            rounds = result.stats.target_passes
            assert target.stats.host_syncs - t0 == prefill + rounds  # one per round
            assert draft.stats.host_syncs == d0  # the draft never syncs: its tokens stay on the device
            assert result.stats.drafted > 0
