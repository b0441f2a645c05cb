"""The default thread pool: a Session whose bundle has a draft graph runs target and draft on the
process's one ONNX Runtime pool (the fast configuration, without the embedder knowing to call
share_cpu_threads); a target alone, or `thread_pool="own"`, keeps pools of their own. In child
processes: ONNX Runtime's pool is for good, and this suite's process keeps its own (conftest)."""
import os
import subprocess
import sys

import pytest

from specdeploy.runtime import InputError, Session

CHILD = """
import sys
from specdeploy.runtime import Session

bundle, pool = sys.argv[1], sys.argv[2]
session = Session(bundle, thread_pool=None if pool == "default" else pool)
engines = [session.target] + ([session.drafter.engine] if session.drafter.engine is not None else [])
print(session.thread_pool, *(e.session.get_session_options().use_per_session_threads for e in engines))
plain = session.generate("The sea is", max_new_tokens=16, speculate=False)
spec = session.generate("The sea is", max_new_tokens=16)
assert spec.token_ids == plain.token_ids
"""


def child(bundle, pool="default", env_pool=None):
    env = {k: v for k, v in os.environ.items() if k != "SPECDEPLOY_THREAD_POOL"}
    env["HF_HUB_OFFLINE"] = "1"
    if env_pool is not None:
        env["SPECDEPLOY_THREAD_POOL"] = env_pool
    out = subprocess.run([sys.executable, "-c", CHILD, str(bundle), pool], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_a_draft_graph_shares_one_pool_by_default(bundles):
    assert child(bundles("llama-model")) == ["shared", "False", "False"]


def test_a_target_alone_keeps_its_own_pool(bundles):
    assert child(bundles("llama-ngram")) == ["own", "True"]


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_own_pools_when_asked(bundles, how):
    got = child(bundles("llama-model"), "own") if how == "argument" else child(bundles("llama-model"), env_pool="own")
    assert got == ["own", "True", "True"]


def test_a_bad_choice_is_one_line_before_the_bundle_loads(tmp_path, monkeypatch):
    with pytest.raises(InputError, match=r"^thread_pool 'big' is not one of auto, shared, own$"):
        Session(tmp_path / "missing", thread_pool="big")
    monkeypatch.setenv("SPECDEPLOY_THREAD_POOL", "big")
    with pytest.raises(InputError, match=r"^SPECDEPLOY_THREAD_POOL 'big' is not one of auto, shared, own$"):
        Session(tmp_path / "missing")
