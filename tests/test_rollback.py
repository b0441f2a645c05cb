"""Rollback is moving the length: slots past it are never read, buffers never move."""
import numpy as np
import pytest

from specdeploy.runtime import Session, load_bundle
from specdeploy.runtime.backends.ort import OrtEngine
from tiny import PROMPTS


def _engine(bundles):
    bundle = load_bundle(bundles("llama-model"))
    spec = bundle.model("target")
    return OrtEngine(bundle.file(spec.graph), spec, bundle.max_seq)


def test_garbage_past_the_length_changes_nothing(bundles):
    engine = _engine(bundles)
    ids = np.random.default_rng(0).integers(0, engine.vocab_size, size=40)
    engine.forward(ids[:30], 0)
    clean = engine.forward(ids[30:35], 30).copy()
    # A rejected verify pass left stale K/V at 30..34; fill everything past 30 with garbage
    # (NaN would poison any read of it), then redo the pass from the rolled-back length.
    for kv in engine.kv_arrays:
        kv[:, :, 30:] = np.nan
    again = engine.forward(ids[30:35], 30)
    assert np.array_equal(clean, again)
    assert not np.isnan(again).any()


def test_the_graph_writes_the_bound_buffers_in_place(bundles):
    engine = _engine(bundles)
    before = [kv.copy() for kv in engine.kv_arrays]
    engine.forward(np.array([5, 6, 7]), 10)
    for old, new in zip(before, engine.kv_arrays):
        changed = np.flatnonzero((old != new).any(axis=(0, 1, 3)))
        assert changed.tolist() == [10, 11, 12]  # exactly the written slots, in the host array itself


def test_kv_buffers_keep_their_addresses_for_a_whole_generation(bundles):
    session = Session(bundles("llama-model"))
    target0 = session.target.kv_addresses()
    draft0 = session.drafter.engine.kv_addresses()
    assert target0 == [a.ctypes.data for a in session.target.kv_arrays]
    seen = []
    for piece in session.stream(PROMPTS[10], max_new_tokens=60, draft_len=4):
        seen.append((session.target.kv_addresses(), session.drafter.engine.kv_addresses()))
    assert len(seen) > 5
    assert all(t == target0 and d == draft0 for t, d in seen)
    # and a second request on the same session still uses the same buffers
    session.generate(PROMPTS[2], max_new_tokens=10)
    assert session.target.kv_addresses() == target0


def test_a_draft_session_does_not_spin_on_the_targets_cores(bundles):
    """ONNX Runtime's idle threads spin by default; a draft's would spin through the target's
    verify pass on the same cores. The target keeps the default."""
    session = Session(bundles("llama-model"))
    draft = session.drafter.engine.session.get_session_options()
    assert draft.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    target = session.target.session.get_session_options()
    with pytest.raises(RuntimeError, match="does not have configuration"):
        target.get_session_config_entry("session.intra_op.allow_spinning")
