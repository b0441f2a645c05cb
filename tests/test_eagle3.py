"""EAGLE-3 heads: the published layout loads and is checked, the head's graph equals the
published forward, speculation with a head is lossless (greedy token for token against
plain decoding and Hugging Face `generate`; sampled by the suite's chi-square test, with a
companion showing the test catches a head whose probabilities are misreported), and
`specdeploy distill --kind eagle3` writes a head in the published layout that drafts."""
import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import tiny
from specdeploy.core.errors import ExportError
from specdeploy.runtime import InputError, Session
from specdeploy.runtime.decoding.drafters import Eagle3Drafter
from tiny import PROMPTS

NEW_TOKENS = 40
DRAFT_LENS = (1, 2, 4, 8, "auto")
TINY_DISTILL = dict(tokens=3000, steps=60, batch=4, draft_vocab=128, max_new_tokens=48, evaluate_every=30)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """An 8-layer target (its default layers 2, 4, 5 are distinct), random heads in the published
    layout (safetensors; a .bin with explicit layer ids), and one `distill --kind eagle3` trained."""
    from specdeploy.export.distill_eagle3 import HeadSettings, distill_head

    root = tmp_path_factory.mktemp("eagle3")
    tiny.make_model(root / "t8", "llama", seed=5, layers=8)
    tiny.make_eagle3_head(root / "random", root / "t8")
    tiny.make_eagle3_head(root / "bin", root / "t8", seed=1, layers=[1, 3, 6], weights="pytorch_model.bin")
    record = distill_head(root / "t8", root / "distilled", HeadSettings(**TINY_DISTILL), progress=False)
    return root, record


@pytest.fixture(scope="module")
def eagle_bundles(heads):
    from specdeploy.export import build_bundle

    root, _ = heads
    made = {}

    def get(name):
        if name not in made:
            head, dtype = {"random": ("random", "fp32"), "bin": ("bin", "fp32"), "distilled": ("distilled", "fp32"),
                           "distilled-int4": ("distilled", "int4")}[name]
            build_bundle(root / "t8", str(root / head), root / f"b-{name}", max_seq=128, max_draft=8, prefill_chunk=16,
                         dtype=dtype, cache=root / "graphs")  # one target graph for the heads that read the same layers
            made[name] = root / f"b-{name}"
        return made[name]

    return get


@pytest.mark.parametrize("name, backend", [("distilled", "ort"), ("distilled-int4", "ort"), ("distilled", "torch")])
def test_a_batch_drafts_with_the_head_and_answers_each_request_as_alone(name, backend, eagle_bundles):
    """Each lane's head reads the hidden states the batched target wrote in its slot: greedy and
    seeded sampled, pinned and auto draft lengths, plain, requests joining as others leave, each
    request's tokens are Session's alone (on the same backend: the torch backend's batched passes
    return the hidden states too); and the heads drafted (passes wider than one token)."""
    from test_batch import concurrently, jobs, solo

    from specdeploy.core.manifest import load_bundle
    from specdeploy.runtime.decoding.batch import BatchSession
    from specdeploy.runtime.serving.pool import default_batch

    bundle = eagle_bundles(name)
    work = jobs()
    want = solo(bundle, work, backend=backend)
    batched = BatchSession(bundle, batch=4, max_queue=32, backend=backend)
    try:
        assert concurrently(batched, work, stagger=0.002) == want
        assert any(t > 1 for (_, t) in batched.widths), batched.widths
    finally:
        batched.close()
    assert default_batch(load_bundle(bundle, verify=False), backend)[0] == 8  # so servers batch it by default


def hf_greedy(model, ids, eos_ids):
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos_ids,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["random", "bin", "distilled", "distilled-int4"])
def test_greedy_with_a_head_equals_plain_and_hf_generate(name, heads, eagle_bundles):
    root, _ = heads
    session = Session(eagle_bundles(name))
    assert session.drafter.kind == "eagle3"
    hf = AutoModelForCausalLM.from_pretrained(root / "t8", dtype=torch.float32).eval() if "int" not in name else None
    accepted = drafted = 0
    for prompt in PROMPTS:
        ids = session.encode(prompt)
        plain = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False)
        if hf is not None:
            with torch.no_grad():
                assert plain.token_ids == hf_greedy(hf, ids, session.eos_token_ids), prompt
        for k in DRAFT_LENS:
            spec = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert spec.token_ids == plain.token_ids, (prompt, k)
            accepted += spec.stats.accepted
            drafted += spec.stats.drafted
    assert drafted > 0
    if name.startswith("distilled"):
        assert accepted > 0  # the accept path ran: the trained head drafts some of what the target says


def test_the_layers_a_head_reads(heads, eagle_bundles):
    """The default ids (2, N // 2, N - 3), or the config's; the target's graph returns those states."""
    from specdeploy.core.manifest import load_bundle

    for name, layers in (("random", [2, 4, 5]), ("bin", [1, 3, 6])):
        bundle = load_bundle(eagle_bundles(name))
        assert bundle.draft.aux_layers == layers
        assert bundle.model("target").feature_outputs == {"aux_hidden_states": 3 * 64}
        assert bundle.model("draft").parity["max_rel_diff_eager_vs_reference"] < 1e-4


def test_target_states_are_the_hf_hidden_states(heads, eagle_bundles):
    """What the target's graph writes into `features` is Hugging Face's hidden_states[i] of the
    head's layers (the input of layer i), side by side."""
    root, _ = heads
    session = Session(eagle_bundles("bin"))
    ids = np.array(session.encode(PROMPTS[10]))
    session.target.forward(ids, 0)
    hf = AutoModelForCausalLM.from_pretrained(root / "t8", dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in (1, 3, 6)], -1).numpy()
    np.testing.assert_allclose(session.target.features[: ids.shape[0]], want, rtol=1e-4, atol=1e-4)


def test_parity_catches_a_graph_that_is_not_the_published_forward(heads, tmp_path):
    """The head's graph is checked against the reference written from the published definition:
    a graph that concatenates [state | embedding] (the wrong order) fails it."""
    from specdeploy.export.eagle3 import load_head
    from specdeploy.export.eagle3_export import check_head_parity, head_entry, head_graph
    from specdeploy.export.load import load_source
    from specdeploy.export.onnx_export import export_onnx

    root, _ = heads
    source = load_source(root / "t8")
    head = load_head(root / "random", source.config)
    graph, reference = head_graph(head, source, "fp32")
    spec = head_entry(graph, reference, head, "fp32", 64)
    with torch.no_grad():  # swap the two norms' roles: the [embedding | state] order reversed, in effect
        swap = graph.layer.self_attn
        for proj in (swap.q_proj, swap.k_proj, swap.v_proj):
            proj.weight.copy_(torch.cat([proj.weight[:, 64:], proj.weight[:, :64]], 1))
    export_onnx(graph, tmp_path / "draft.onnx", 64, torch.float32)
    with pytest.raises(ExportError, match="published forward"):
        check_head_parity(graph, reference, tmp_path / "draft.onnx", spec, 64, 4, 16, "fp32")


# -- the published layout, checked ----------------------------------------------------------------

@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):  # 7 layers: default ids 2, 3, 4
    root = tmp_path_factory.mktemp("t6")
    tiny.make_model(root / "t", "llama", seed=7, layers=7)
    return root / "t"


def _broken(tmp_path, target, edit_tensors=None, **config):
    folder = tiny.make_eagle3_head(tmp_path / "h", target, **config)
    if edit_tensors:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(folder / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("edit, config, message", [
    (lambda t: t.update({"fc.weight": torch.zeros(64, 100)}), {}, r"tensor 'fc.weight' is \[64, 100\]; the head's config makes it \[64, 192\]"),
    (lambda t: t.pop("midlayer.self_attn.q_proj.weight"), {}, "tensor 'midlayer.self_attn.q_proj.weight' is missing"),
    (lambda t: t.update({"extra.weight": torch.zeros(2)}), {}, "'extra.weight' is not part of an EAGLE-3 head"),
    (lambda t: t.update({"d2t": t["d2t"] + 10_000}), {}, "'d2t' maps draft ids outside"),
    (None, {"hidden_size": 32, "num_attention_heads": 2}, "hidden size 32 .* the target's is 64"),
    (None, {"vocab_size": 300}, "vocab_size 300; the target has 320 tokens"),
    (None, {"layers": [1, 2, 9]}, r"reads target layers \[1, 2, 9\]; expected three distinct layers of the target's 0..6"),
    (None, {"num_hidden_layers": 2}, "an EAGLE-3 head has one layer"),
    (None, {"rms_norm_eps": -1}, "'rms_norm_eps' must be a positive number"),
])
def test_a_head_that_does_not_fit_is_a_one_line_error(target_folder, tmp_path, edit, config, message):
    from specdeploy.export.eagle3 import load_head

    folder = _broken(tmp_path, target_folder, edit, **config)
    with pytest.raises(ExportError, match=message) as err:
        load_head(folder, AutoConfig.from_pretrained(target_folder))
    assert "\n" not in str(err.value)


def test_a_head_folder_is_recognised_by_its_config(target_folder, tmp_path):
    from specdeploy.export.drafts import Eagle3Draft, ModelDraft, parse_draft

    folder = tiny.make_eagle3_head(tmp_path / "h", target_folder)
    assert isinstance(parse_draft(str(folder)), Eagle3Draft)
    assert isinstance(parse_draft(str(target_folder)), ModelDraft)


# -- sampling ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_head(tmp_path_factory):
    from specdeploy.export import build_bundle
    from tiny import VOCAB, prompt_with_a_fair_draft as _prompt_with_a_fair_draft

    root = tmp_path_factory.mktemp("small-eagle3")
    tiny.make_model(root / "t", "llama", seed=11, layers=3, vocab_size=VOCAB, initializer_range=0.5)
    # 12 of the 16 tokens: the others are never drafted, only verified and emitted by the target
    # a head of broad distributions: its drafts are accepted often enough for both paths to carry weight
    tiny.make_eagle3_head(root / "h", root / "t", draft_vocab=12, layers=[0, 1, 2], scale=0.3, head_scale=1.0)
    build_bundle(root / "t", str(root / "h"), root / "b", max_seq=32, max_draft=4, prefill_chunk=8)
    session = Session(root / "b")
    session.eos_token_ids = []
    return session, _prompt_with_a_fair_draft(session)


@pytest.mark.parametrize("setting", range(3))
def test_sampling_with_a_head_has_the_target_distribution(small_head, setting):
    from test_sampling import assert_drafts_keep_the_distribution

    assert_drafts_keep_the_distribution(*small_head, setting)


def test_the_distribution_test_catches_misreported_head_probabilities(small_head, monkeypatch):
    """A head that reports uniform probabilities for the tokens it sampled from its own
    distribution: the verifier's p/q is then wrong, and the test must say so."""
    from test_sampling import assert_misreported_probabilities_are_caught

    assert_misreported_probabilities_are_caught(*small_head, Eagle3Drafter,
                                                lambda p, head: None if p.probs is None else p.probs.shape[1],
                                                monkeypatch)


# -- distill --kind eagle3 --------------------------------------------------------------------------

def test_distilled_head_is_in_the_published_layout(heads):
    from safetensors.torch import load_file

    from specdeploy.export.eagle3 import HeadConfig, is_head_folder

    root, record = heads
    folder = root / "distilled"
    assert is_head_folder(folder)
    cfg = HeadConfig.read(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    assert set(tensors) == set(cfg.shapes())
    assert all(tuple(tensors[k].shape) == shape for k, shape in cfg.shapes().items())
    ids = torch.arange(cfg.draft_vocab_size) + tensors["d2t"]
    assert torch.equal(tensors["t2d"].nonzero()[:, 0], ids)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and "eagle_config" not in config  # default layers
    assert record["held_out_agreement"]["trained"][0] > record["held_out_agreement"]["untrained"][0]
    assert [c["step"] for c in record["curve"]] == [30, 60]


def test_an_interrupted_distill_resumes_to_the_same_head(heads, tmp_path):
    from safetensors.torch import load_file

    from specdeploy.export.distill_eagle3 import HeadSettings, distill_head

    root, _ = heads
    with pytest.raises(KeyboardInterrupt):
        distill_head(root / "t8", tmp_path / "h", HeadSettings(**TINY_DISTILL), progress=False, stop_after=40)
    assert (tmp_path / "h.work" / "checkpoint.pt").is_file() and not (tmp_path / "h").exists()
    distill_head(root / "t8", tmp_path / "h", HeadSettings(**TINY_DISTILL), progress=False)
    got, want = load_file(str(tmp_path / "h" / "model.safetensors")), load_file(str(root / "distilled" / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_the_torch_backend_drafts_with_a_head_as_ort_does(eagle_bundles):
    """The torch backend rebuilds the target (returning the head's states) and the head from
    their sources: greedy speculative output equals ort's plain output, and the head drafts.
    An int4 target it refuses to speculate with, in one line: its verify rows are not
    bit-identical to single steps on PyTorch."""
    name = "distilled"
    ort, torch_session = Session(eagle_bundles(name)), Session(eagle_bundles(name), backend="torch")
    assert torch_session.drafter.kind == "eagle3"
    accepted = 0
    for prompt in PROMPTS[:8]:
        ids = ort.encode(prompt)
        plain = ort.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False)
        for k in (1, 3, "auto"):
            spec = torch_session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert spec.token_ids == plain.token_ids, (prompt, k)
            accepted += spec.stats.accepted
    assert accepted > 0
    with pytest.raises(InputError, match="int4 target on --backend torch: its verify rows are not bit-identical") as err:
        Session(eagle_bundles("distilled-int4"), backend="torch")
    assert "\n" not in str(err.value)


def test_the_trt_backend_refuses_a_head_in_one_line(eagle_bundles):
    with pytest.raises(InputError, match="its eagle3 draft runs on --backend ort or torch for now, not trt") as err:
        Session(eagle_bundles("random"), backend="trt")
    assert "\n" not in str(err.value)


def test_a_bundle_without_its_vocabulary_map_is_refused(eagle_bundles, tmp_path):
    from specdeploy.core.errors import BundleError

    copy = tmp_path / "b"
    shutil.copytree(eagle_bundles("random"), copy)
    (copy / "draft_vocab.npy").unlink()
    with pytest.raises(BundleError, match="draft_vocab.npy"):
        Session(copy)


def test_the_server_drafts_with_a_head_on_every_worker(eagle_bundles):
    """Over real loopback HTTP, two workers (a fork attaches the head to its own target):
    concurrent completions equal plain decoding, and the head drafted."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from loopback import Server

    from specdeploy.runtime.serving.pool import SessionPool

    bundle = eagle_bundles("distilled")
    session = Session(bundle)
    want = {p: session.generate(p, max_new_tokens=24, speculate=False).text for p in PROMPTS[:6]}
    pool = SessionPool(bundle, workers=2, max_queue=16)
    assert all(s.drafter.target is s.target for s in pool.sessions)

    def ask(prompt):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        return prompt, r.json()

    with Server(pool) as server, ThreadPoolExecutor(3) as threads:
        answers = list(threads.map(ask, PROMPTS[:6] * 2))
    assert all(out["choices"][0]["text"] == want[p] for p, out in answers)
    assert sum(out["specdeploy"]["drafted"] for _, out in answers) > 0


def test_a_bundle_for_tensorrt_passes_check_trt_and_its_plans_are_refused_in_one_line(heads, tmp_path):
    """--for tensorrt: both graphs standard ONNX that TensorRT's parser takes (export runs the
    check); building plans of an EAGLE-3 bundle is not done yet, and says so."""
    from specdeploy.export import build_bundle
    from specdeploy.export.trt_build import build_engines
    from specdeploy.export.trt_ops import check_bundle

    root, _ = heads
    build_bundle(root / "t8", str(root / "distilled"), tmp_path / "b", max_seq=64, max_draft=4, prefill_chunk=16,
                 dtype="int4", device="tensorrt")
    assert check_bundle(tmp_path / "b") == []
    with pytest.raises(ExportError, match="EAGLE-3 bundle runs on --backend ort") as err:
        build_engines(tmp_path / "b")
    assert "\n" not in str(err.value)
