"""Greedy speculative output == greedy plain output of the same bundle == Hugging Face
`generate(do_sample=False)` of the source model. Token for token, every prompt, no threshold."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdeploy.runtime import Session
from specdeploy.runtime.decoding.drafters import Proposal
from tiny import PROMPTS

NEW_TOKENS = 40
DRAFT_LENS = (1, 2, 4, 8)


def hf_greedy(model, ids, eos_ids):
    out = model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos_ids, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    "name, source", [
        ("llama-model", "llama"),
        ("llama-self", "llama"),
        ("llama-ngram", "llama"),
        ("llama-same", "llama"),
        ("qwen2-self", "qwen2"),
        ("mistral-model", "mistral"),
    ],
)
def test_speculative_equals_plain_and_hf_generate(name, source, bundles, models):
    session = Session(bundles(name))
    hf = AutoModelForCausalLM.from_pretrained(models[source], dtype=torch.float32).eval()
    assert len(PROMPTS) >= 20
    accepted = drafted = 0
    for prompt in PROMPTS:
        ids = session.encode(prompt)
        plain = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False)
        assert plain.stats.target_passes == len(plain.token_ids)
        with torch.no_grad():
            assert plain.token_ids == hf_greedy(hf, ids, session.eos_token_ids), prompt
        for k in DRAFT_LENS:
            spec = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert spec.token_ids == plain.token_ids, (prompt, k)
            assert spec.text == plain.text
            accepted += spec.stats.accepted
            drafted += spec.stats.drafted
    assert drafted > 0
    if name == "llama-same":
        # The target drafting for itself: every draft accepted, each round ends in a bonus token.
        assert accepted == drafted
    if name in ("llama-same", "llama-ngram"):
        assert accepted > 0  # the accept path really ran


def test_mistral_sliding_window_is_exercised(bundles, models):
    """Decode far past Mistral's sliding window: speculative == plain == Hugging Face `generate`
    (which honours the window), and the window changes the logits: every row past it differs
    from attention over the whole prefix, so a runtime that ignored the window would fail here."""
    session = Session(bundles("mistral-model"))
    session.eos_token_ids = []  # run every requested token
    window = session.bundle.model("target").sliding_window
    assert window == 40
    ids = session.encode(PROMPTS[16])
    n_new = 80
    assert len(ids) + n_new <= session.bundle.max_seq and len(ids) + n_new > 2 * window
    plain = session.generate(prompt_ids=ids, max_new_tokens=n_new, speculate=False)
    assert len(plain.token_ids) == n_new
    for k in DRAFT_LENS:
        spec = session.generate(prompt_ids=ids, max_new_tokens=n_new, draft_len=k)
        assert spec.token_ids == plain.token_ids, k
        assert spec.stats.drafted > 0

    # The random draft model is never accepted; an oracle draft (the plain continuation) is
    # always accepted, so multi-row verify passes past the window commit what they judge.
    seq = np.array(ids + plain.token_ids)

    class Oracle:
        engine, cost_ratio = None, 0.1
        proposes_trees = keeps_history = False

        def reset(self):
            pass

        def fused_with(self, target):
            return False

        def propose(self, prefix, k, params, rng, min_confidence=0.0):
            return Proposal(seq[prefix.shape[0] : prefix.shape[0] + k].copy())

    session.drafter = Oracle()
    oracle = session.generate(prompt_ids=ids, max_new_tokens=n_new, draft_len=8)
    assert oracle.token_ids == plain.token_ids
    assert oracle.stats.accepted == oracle.stats.drafted > n_new // 2

    windowed = AutoModelForCausalLM.from_pretrained(models["mistral"], dtype=torch.float32).eval()
    full = AutoModelForCausalLM.from_pretrained(models["mistral"], dtype=torch.float32, sliding_window=None).eval()
    assert (windowed.config.sliding_window, full.config.sliding_window) == (window, None)
    with torch.no_grad():
        hf = {
            name: m.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n_new, eos_token_id=[], pad_token_id=0)[
                0, len(ids) :
            ].tolist()
            for name, m in (("windowed", windowed), ("full", full))
        }
        want = windowed(torch.from_numpy(seq)[None]).logits[0].numpy()
        unwindowed = full(torch.from_numpy(seq)[None]).logits[0].numpy()
    assert plain.token_ids == hf["windowed"]
    assert plain.token_ids != hf["full"]  # the window changes the greedy continuation
    chunk = session.bundle.prefill_chunk
    got = np.concatenate([session.target.forward(seq[a : a + chunk], a).copy() for a in range(0, len(seq), chunk)])
    rel = np.abs(got - want).max(axis=-1) / np.abs(want).max()  # per row, relative to the largest logit
    rel_full = np.abs(got - unwindowed).max(axis=-1) / np.abs(want).max()
    assert rel.max() <= 1e-4  # the engine == the windowed model at every position
    assert rel_full[:window].max() <= 1e-4  # before the window fills, the two agree
    assert rel_full[window:].min() >= 1e-2  # past it, every row differs from full attention


def test_eos_stops_generation_and_is_returned(bundles):
    """Make the first greedy token an EOS id and check both loops stop right there."""
    session = Session(bundles("llama-same"))
    ids = session.encode(PROMPTS[0])
    first = session.generate(prompt_ids=ids, max_new_tokens=1, speculate=False).token_ids[0]
    session.eos_token_ids = [first]
    for speculate in (False, True):
        result = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=speculate)
        assert result.token_ids == [first]


def test_max_new_tokens_is_exact(bundles):
    """With no EOS possible, exactly max_new_tokens come back, finish reason "length", and no
    round drafts past the limit: a round proposes at most (tokens still wanted) - 1, since its
    verify pass adds one token of its own, so nothing is drafted only to be cut off."""
    session = Session(bundles("llama-same"))  # every draft accepted: rounds run as long as allowed
    session.eos_token_ids = []
    ids = session.encode(PROMPTS[3])
    for k in (*DRAFT_LENS, "auto", None):
        for n in (1, 2, 7, 9, 17):
            gen = session.stream(prompt_ids=ids, max_new_tokens=n, draft_len=k, speculate=k is not None)
            got, proposed = [], []
            for piece in gen:
                if not piece.token_ids:
                    continue  # the final text flush
                wanted = n - len(got)
                proposed.append(gen.stats.last_proposed)
                assert gen.stats.last_proposed <= wanted - 1, (k, n, len(got))
                assert len(piece.token_ids) == gen.stats.last_proposed + 1  # committed whole, none cut
                got += piece.token_ids
            assert len(got) == n, (k, n)
            assert gen.stats.new_tokens == n and gen.stats.finish_reason == "length", (k, n)
            if isinstance(k, int):  # the cap is tight: the first round drafts up to k or the limit
                assert proposed[0] == min(k, n - 1), (k, n, proposed)
            if k is None:
                assert sum(proposed) == 0 and gen.stats.target_passes == n


def test_fp16_bundle_is_lossless_against_itself(models, tmp_path):
    """Speculation is lossless with respect to the engine deployed, whatever its dtype."""
    from specdeploy.export import build_bundle

    manifest = build_bundle(models["llama"], "self:layers=1", tmp_path / "fp16", max_seq=96, dtype="fp16").as_dict()
    target = manifest["models"]["target"]
    assert (target["dtype"], target["kv_dtype"]) == ("fp16", "float16")
    assert target["parity"]["max_rel_diff_ort_vs_eager"] <= target["parity"]["bound"]
    session = Session(tmp_path / "fp16")
    assert session.target.kv_arrays[0].dtype == np.float16
    for prompt in PROMPTS[:10]:
        plain = session.generate(prompt, max_new_tokens=24, speculate=False)
        for k in (2, 8):
            assert session.generate(prompt, max_new_tokens=24, draft_len=k).token_ids == plain.token_ids
