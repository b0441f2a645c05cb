"""Gemma 4 assistants (`--draft assistant:PATH`): a random assistant in the published layout over
a tiny Gemma 4 target. Its drafts are the ones Hugging Face's candidate generator proposes for
the same state; speculation with it is lossless (greedy token for token against plain decoding,
Hugging Face `generate` and Hugging Face's assisted generation with the same assistant, alone
and in a batch; sampled by the suite's chi-square test, with a companion showing that the test
catches misreported draft probabilities); what does not fit is one line."""
import json
import shutil

import numpy as np
import pytest
import torch
import transformers

import tiny
from specdeploy.core.errors import BundleError, ExportError
from specdeploy.runtime import InputError, Session
from specdeploy.runtime.decoding.drafters import AssistantDrafter
from specdeploy.runtime.decoding.loop import prefill
from specdeploy.runtime.decoding.sampling import SamplingParams
from tiny import PROMPTS

NEW_TOKENS = 30
DRAFT_LENS = (1, 3, 8, "auto")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Gemma 4 target (sliding and full layers, K/V sharing, per-layer inputs, experts)
    and an assistant of 2 layers (sliding window 8, shorter than the prompts; centroid-masked head)."""
    root = tmp_path_factory.mktemp("assistant")
    # Seed 3: with 4 experts of which a token takes 2, an int4 rounding flips a token's experts for some
    # seeds and the fast scheme's parity (ONNX Runtime against eager) lands past its bound (seeds 0, 1,
    # 4, 5: 0.37-0.89 against 0.2; without experts 0.03-0.18): the target's parity is not what this file tests.
    tiny.make_model(root / "target", "gemma4_text", layers=3, seed=3)
    tiny.make_gemma4_assistant(root / "assistant", root / "target")
    return root


@pytest.fixture(scope="module")
def bundles(models):
    from specdeploy.export import build_bundle

    made = {}

    def get(name):  # fp32, int4, int4-fast (the 4-bit tables: the assistant's copy of the target's too)
        if name not in made:
            out = models / f"b-{name}"
            dtype, _, scheme = name.partition("-")
            build_bundle(models / "target", f"assistant:{models / 'assistant'}", out, max_seq=128, max_draft=8,
                         prefill_chunk=16, dtype=dtype, quant_scheme=scheme or "exact", max_batch=4,
                         cache=models / "graphs")
            made[name] = out
        return made[name]

    return get


@pytest.fixture(scope="module")
def hf(models):
    target = transformers.AutoModelForCausalLM.from_pretrained(models / "target", dtype=torch.float32).eval()
    assistant = transformers.Gemma4AssistantForCausalLM.from_pretrained(models / "assistant", dtype=torch.float32).eval()
    return target, assistant


def test_drafts_are_the_candidate_generators(bundles, hf):
    """For committed ids X (the target has computed X[:-1]), the assistant's k drafts are what
    transformers' SinglePositionMultiTokenCandidateGenerator proposes from the target's outputs
    over X[:-1]: at lengths inside and well past the assistant's sliding window (8)."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    target, assistant = hf
    session = Session(bundles("fp32"), prompt_cache=False)
    assert isinstance(session.drafter, AssistantDrafter)
    assistant.generation_config.num_assistant_tokens = 8
    text = session.encode(" ".join(PROMPTS))
    checked = 0
    for n in (3, 9, 10, 11, 40, 100):
        ids = np.array(text[:n])
        with torch.no_grad():
            out = target(torch.from_numpy(ids[:-1])[None], output_hidden_states=True, return_shared_kv_states=True)
            generator = SinglePositionMultiTokenCandidateGenerator(assistant, target.get_input_embeddings(),
                                                                   GenerationConfig(max_length=200))
            candidates, _ = generator.get_candidates(torch.from_numpy(ids)[None], model_kwargs={}, model_outputs=out,
                                                     is_first_iteration=False, n_last_matches=0)
        prefill(session.target, ids, 16)
        ours = session.drafter.propose(ids, 8, SamplingParams(), np.random.default_rng(0))
        assert ours.tokens.tolist() == candidates[0, n:].tolist(), n
        assert ours.passes == 8
        checked += 1
    assert checked == 6


def test_the_target_returns_its_final_state(bundles, hf):
    """What the target's graph writes into `features` is Hugging Face's hidden_states[-1] (the final
    norm's output), the state the assistant reads."""
    target, _ = hf
    session = Session(bundles("fp32"))
    ids = np.array(session.encode(PROMPTS[3]))
    session.target.forward(ids, 0)
    with torch.no_grad():
        want = target(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states[-1][0].numpy()
    np.testing.assert_allclose(session.target.features[: ids.shape[0]], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["fp32", "int4", "int4-fast"])
def test_greedy_with_the_assistant_equals_plain_and_hf(dtype, bundles, hf):
    """Speculative == plain at k = 1, 3, 8 and auto; at fp32 plain == HF generate == HF assisted
    generation with the same assistant (k = 1, 3, 8)."""
    target, assistant = hf
    session = Session(bundles(dtype))
    drafted = 0
    for i, prompt in enumerate(PROMPTS[:8]):
        ids = session.encode(prompt)
        plain = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False).token_ids
        for k in DRAFT_LENS:
            spec = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert spec.token_ids == plain, (prompt, k)
            drafted += spec.stats.drafted
        if dtype != "fp32" or i >= 4:  # Hugging Face's side on the first four (its assisted loop is slow)
            continue
        kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=list(session.eos_token_ids), pad_token_id=0)
        with torch.no_grad():
            assert target.generate(torch.tensor([ids]), **kwargs)[0, len(ids):].tolist() == plain, prompt
            for k in (1, 3, 8):
                assistant.generation_config.num_assistant_tokens = k
                assistant.generation_config.num_assistant_tokens_schedule = "constant"
                out = target.generate(torch.tensor([ids]), assistant_model=assistant, **kwargs)
                assert out[0, len(ids):].tolist() == plain, (prompt, k)
    assert drafted > 0


def test_a_batch_drafts_with_the_assistant_and_answers_each_request_as_alone(bundles):
    """Each lane's assistant reads its slot's K/V and states in the batched target: greedy and
    seeded sampled, pinned and auto draft lengths, plain, requests joining as others leave, each
    request's tokens are Session's alone; and the lanes drafted."""
    from test_batch import concurrently, jobs, solo

    from specdeploy.core.manifest import load_bundle
    from specdeploy.runtime.decoding.batch import BatchSession
    from specdeploy.runtime.serving.pool import default_batch

    bundle = bundles("int4")
    work = jobs()
    want = solo(bundle, work)
    batched = BatchSession(bundle, batch=4, max_queue=32)
    try:
        assert concurrently(batched, work, stagger=0.002) == want
        assert any(t > 1 for (_, t) in batched.widths), batched.widths
    finally:
        batched.close()
    assert default_batch(load_bundle(bundle, verify=False))[0] == 4  # so servers batch it by default
    batch, why = default_batch(load_bundle(bundle, verify=False), "torch")
    assert batch is None and "Gemma 4 assistant" in why


def test_the_assistant_runs_on_ort_only_and_says_so(bundles):
    with pytest.raises(InputError) as err:
        Session(bundles("int4"), backend="torch")
    assert "assistant draft runs on --backend ort" in str(err.value) and "\n" not in str(err.value)


def test_inspect_and_the_manifest_say_what_it_reads(bundles):
    from specdeploy.core.manifest import load_bundle

    bundle = load_bundle(bundles("int4"))
    draft, target = bundle.model("draft"), bundle.model("target")
    assert bundle.draft.kind == "assistant" and bundle.draft.aux_layers == [3]
    assert draft.reads_kv == (0, 1) and draft.num_kv_layers == 0 and draft.kv_bytes(128) == 0
    assert target.feature_outputs == {"aux_hidden_states": 64}
    assert draft.parity["max_rel_diff_eager_vs_reference"] < 1e-4 and draft.parity["positions"][-1] > 10
    fast = load_bundle(bundles("int4-fast"))  # the copy of the target's table in 4-bit blocks, as the target's own
    assert fast.model("target").quantization["embedding"].startswith("int4")
    assert fast.path.joinpath("draft.onnx").stat().st_size < bundle.path.joinpath("draft.onnx").stat().st_size


def test_a_manifest_reading_past_the_targets_kv_is_refused(bundles, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(bundles("int4"), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["models"]["draft"]["reads_kv"] = [0, 5]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError) as err:
        Session(copy)
    assert "reads_kv [0, 5] reach past the target's 2 KV pairs" in str(err.value)


def test_parity_catches_a_graph_that_is_not_the_published_forward(models, monkeypatch, tmp_path):
    """The export's check against the published forward is live: a sliding window one slot short
    (the target's own causal window instead of the assistant's flipped one) is refused."""
    from specdeploy.export import build_bundle
    from specdeploy.export import assistant as module

    real = module.AssistantGraph.forward

    def short_window(self, input_ids, hidden, position_ids, attention_mask, past):
        self.core.windows = [w - 1 if w is not None else None for w in self.core.windows]
        try:
            return real(self, input_ids, hidden, position_ids, attention_mask, past)
        finally:
            self.core.windows = [w + 1 if w is not None else None for w in self.core.windows]

    monkeypatch.setattr(module.AssistantGraph, "forward", short_window)
    with pytest.raises(ExportError, match="differs from the published forward"):
        build_bundle(models / "target", f"assistant:{models / 'assistant'}", tmp_path / "b", max_seq=64, max_draft=4,
                     prefill_chunk=16, dtype="fp32")


def _edit_assistant(src, dst, **fields):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in fields.items():
        where = config["text_config"] if key.startswith("text.") else config
        where[key.removeprefix("text.")] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("fields, message", [
    (dict(backbone_hidden_size=80), "backbone_hidden_size is 80; the target's is 64"),
    (dict(num_centroids=7), "num_centroids 7 does not divide vocab_size 320"),
    (dict(centroid_intermediate_top_k=99), "centroid_intermediate_top_k 99: expected 1..16"),
    (dict(**{"text.per_layer_config": {"1": {"head_dim": 16, "num_key_value_heads": 1}}}),
     "layer 1 (full_attention) has head_dim 16; the target's K/V it reads has 32"),
])
def test_an_assistant_that_does_not_fit_is_a_one_line_error(models, tmp_path, fields, message):
    from specdeploy.export import build_bundle

    folder = _edit_assistant(models / "assistant", tmp_path / "a", **fields)
    with pytest.raises(ExportError) as err:
        build_bundle(models / "target", f"assistant:{folder}", tmp_path / "b", max_seq=64, dtype="fp32")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_other_targets_and_choices_are_refused_in_one_line(models, tmp_path):
    from specdeploy.export import build_bundle

    target_folder = tmp_path / "llama"
    tiny.make_model(target_folder, "llama", layers=2)
    cases = [
        (dict(target=target_folder), "a Gemma 4 assistant drafts for a Gemma 4 text model; the target is 'llama'"),
        (dict(draft_dtype="int8"), "--draft-dtype int8 with a Gemma 4 assistant: its graph is exported in fp32 only"),
        (dict(draft=f"assistant:{models / 'target'}"), "not a Gemma 4 assistant folder"),
    ]
    for i, (change, message) in enumerate(cases):
        kwargs = dict(target=models / "target", draft=f"assistant:{models / 'assistant'}", out=tmp_path / f"b{i}",
                      max_seq=64, dtype="fp32")
        kwargs.update(change)
        with pytest.raises(ExportError) as err:
            build_bundle(kwargs.pop("target"), kwargs.pop("draft"), kwargs.pop("out"), **kwargs)
        assert message in str(err.value) and "\n" not in str(err.value), err.value


def test_an_assistant_folder_is_recognised_by_its_config(models):
    from specdeploy.export.drafts import AssistantDraft, ModelDraft, parse_draft

    assert isinstance(parse_draft(str(models / "assistant")), AssistantDraft)
    assert isinstance(parse_draft(f"assistant:{models / 'assistant'}"), AssistantDraft)
    assert isinstance(parse_draft(str(models / "target")), ModelDraft)


# -- sampling ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_assistant(tmp_path_factory):
    """A Gemma 4 target over 16 tokens with broad distributions and an assistant for it: its argmax
    drafts are accepted often enough for the accept and the reject paths to carry weight."""
    from specdeploy.export import build_bundle
    from tiny import VOCAB, prompt_with_a_fair_draft

    root = tmp_path_factory.mktemp("small-assistant")
    tiny.make_model(root / "t", "gemma4_text", seed=11, layers=3, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB,
                    initializer_range=0.5)
    tiny.make_gemma4_assistant(root / "a", root / "t", seed=3, initializer_range=0.5)
    build_bundle(root / "t", f"assistant:{root / 'a'}", root / "b", max_seq=32, max_draft=4, prefill_chunk=8,
                 dtype="fp32")
    session = Session(root / "b")
    session.eos_token_ids = []
    return session, prompt_with_a_fair_draft(session)


@pytest.mark.parametrize("setting", range(3))
def test_sampling_with_the_assistant_has_the_target_distribution(small_assistant, setting):
    from test_sampling import assert_drafts_keep_the_distribution

    assert_drafts_keep_the_distribution(*small_assistant, setting)


def test_the_distribution_test_catches_misreported_draft_probabilities(small_assistant, monkeypatch):
    """An assistant that reports its argmax drafts as drawn from a uniform distribution instead of
    as a point mass: the verifier's p/q is then wrong, and the test must say so. (A draft sampled
    from the assistant's own distribution and reported as a point mass would still be lossless:
    it does not depend on the target's draw.)"""
    from test_sampling import assert_misreported_probabilities_are_caught

    assert_misreported_probabilities_are_caught(*small_assistant, AssistantDrafter,
                                                lambda p, drafter: drafter.engine.vocab_size, monkeypatch)
