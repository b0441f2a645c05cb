"""Rollback is moving the length: what slots past it hold never changes a result, buffers never move."""
import json
import os
import subprocess
import sys

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
    # A rejected verify pass left stale K/V at 30..34; fill everything past 30 with garbage, then
    # redo the pass from the rolled-back length. Slots past a pass's rows are read only under the
    # mask (a graph reading its K/V as bound reads up to its capacity): they add exact zeros, whatever
    # finite values they hold (every value a pass writes is finite: non-finite logits stop a request)
    rng = np.random.default_rng(1)
    for kv in engine.kv_arrays:
        kv[:, :, 30:] = rng.choice([-6e4, 6e4, 1e-30, 0.0], size=kv[:, :, 30:].shape)
    again = engine.forward(ids[30:35], 30)
    assert np.array_equal(clean, again)
    assert np.isfinite(again).all()


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


def test_a_draft_on_a_pool_of_its_own_does_not_spin_on_the_targets_cores(bundles):
    """Without a shared pool (this process has none) each session has its own; ONNX Runtime's
    idle threads spin by default, and a draft's would spin through the target's verify pass
    on the same cores. The target keeps the default."""
    session = Session(bundles("llama-model"))
    draft = session.drafter.engine.session.get_session_options()
    assert draft.use_per_session_threads is True
    assert draft.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    target = session.target.session.get_session_options()
    with pytest.raises(RuntimeError, match="does not have configuration"):
        target.get_session_config_entry("session.intra_op.allow_spinning")


SHARED_POOL = """
import sys
import onnxruntime as ort
from specdeploy.runtime import InputError, Session, share_cpu_threads

bundle, how = sys.argv[1:]
if how == "ours":
    assert share_cpu_threads(2) == 2 and share_cpu_threads(2) == 2  # once made, asking again is a no-op
    try:
        share_cpu_threads(3)
        raise SystemExit("a second width taken")
    except InputError as e:
        assert "cannot remake it 3 wide" in str(e), e
else:  # other code of the process made it: our sessions find out and join it
    ort.set_global_thread_pool_sizes(2, 1)
session = Session(bundle)
for engine in (session.target, session.drafter.engine):
    assert engine.session.get_session_options().use_per_session_threads is False, engine.name
for prompt in sys.stdin.read().splitlines():
    plain = session.generate(prompt, max_new_tokens=24, speculate=False)
    spec = session.generate(prompt, max_new_tokens=24, draft_len=4)
    assert spec.token_ids == plain.token_ids and spec.stats.draft_passes > 0, prompt
print("ok")
"""


@pytest.mark.parametrize("how", ["ours", "foreign"])
def test_a_target_and_its_draft_on_one_thread_pool_decode_as_plain(bundles, how):
    """share_cpu_threads (the `specdeploy` command calls it): the process's sessions share one
    pool; the draft's steps and the verify passes on it still give plain decoding's tokens. A
    pool other code made is joined, not fought. In a child process: the pool is for good."""
    out = subprocess.run([sys.executable, "-c", SHARED_POOL, str(bundles("llama-model")), how], input="\n".join(PROMPTS[:4]),
                         capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_command_shares_one_pool_and_decodes_as_plain(bundles):
    cli = "from specdeploy.cli import run; run()"  # the installed `specdeploy` command's entry point
    args = ["generate", str(bundles("llama-model")), "--prompt", PROMPTS[1], "--max-new-tokens", "20", "--json"]
    out = subprocess.run([sys.executable, "-c", cli, *args, "--draft-len", "3"], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert out.returncode == 0, out.stderr
    plain = Session(bundles("llama-model")).generate(PROMPTS[1], max_new_tokens=20, speculate=False)
    assert json.loads(out.stdout)["token_ids"] == plain.token_ids