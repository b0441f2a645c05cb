"""Greedy speculative output == greedy plain output of the same bundle == Hugging Face
`generate(do_sample=False)` of the source model. Token for token, every prompt, no threshold."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdeploy.runtime import Session
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


def test_mistral_sliding_window_is_exercised(bundles):
    session = Session(bundles("mistral-model"))
    window = session.bundle.model("target").sliding_window
    assert window == 40
    long_prompt = session.encode(PROMPTS[16])
    assert len(long_prompt) + NEW_TOKENS > window


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
    session = Session(bundles("llama-same"))
    for n in (1, 2, 7, 9, 17):
        result = session.generate(PROMPTS[3], max_new_tokens=n, draft_len=8)
        assert len(result.token_ids) == n or result.token_ids[-1] in session.eos_token_ids
        assert np.all(np.array(result.stats.proposed_at) >= 0)


def test_fp16_bundle_is_lossless_against_itself(models, tmp_path):
    """Speculation is lossless with respect to the engine deployed, whatever its dtype."""
    from specdeploy.export import build_bundle

    manifest = build_bundle(models["llama"], "self:layers=1", tmp_path / "fp16", max_seq=96, dtype="fp16")
    target = manifest["models"]["target"]
    assert (target["dtype"], target["kv_dtype"]) == ("fp16", "float16")
    assert target["parity"]["max_rel_diff_ort_vs_eager"] <= target["parity"]["bound"]
    session = Session(tmp_path / "fp16")
    assert session.target.kv_arrays[0].dtype == np.float16
    for prompt in PROMPTS[:10]:
        plain = session.generate(prompt, max_new_tokens=24, speculate=False)
        for k in (2, 8):
            assert session.generate(prompt, max_new_tokens=24, draft_len=k).token_ids == plain.token_ids
