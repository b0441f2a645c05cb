"""The multi-token-prediction layer a Qwen3.5 checkpoint carries, as a draft (`--draft mtp`,
export/mtp.py). Tiny Qwen3.5 models get a random MTP layer in the published tensor layout
(`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`,
in the checkpoint's own safetensors file, as the released checkpoints keep it):

- its forward equals transformers' `MtpModel`, which reads the same checkpoint through its own
  weight conversions (float tolerance; the graph against our reference is export's parity check);
- the tokens it drafts are the ones transformers' layer proposes, chained on its own output;
- greedy speculative output equals plain and Hugging Face `generate` at k = 1, 3, 8 and auto, at
  fp32 and int4, with drafts rejected and (a layer made to propose repeats) accepted, in a Session
  (ONNX Runtime and the torch backend) and in a batch of 4 with joins and leaves;
- seeded sampling through it passes the suite's chi-square test;
- a checkpoint without the layer, or with one of another shape, is refused in one line."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import tiny
from specdeploy.core.errors import ExportError
from specdeploy.core.manifest import load_bundle
from specdeploy.export import build_bundle
from specdeploy.runtime import Session
from specdeploy.runtime.decoding.sampling import SamplingParams
from test_lossless import hf_greedy
from tiny import PROMPTS

MAX_SEQ = 128
NEW_TOKENS = 40
LINEAR, FULL = "linear_attention", "full_attention"


def mtp_tensors(folder, seed: int) -> dict[str, torch.Tensor]:
    """A random MTP layer for the model in `folder`, in the published layout."""
    cfg = json.loads((folder / "config.json").read_text())
    h, heads, kv, d, inter = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                                "intermediate_size"))
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc": (h, 2 * h), "pre_fc_norm_embedding": (h,), "pre_fc_norm_hidden": (h,), "norm": (h,),
              "layers.0.input_layernorm": (h,), "layers.0.post_attention_layernorm": (h,),
              "layers.0.self_attn.q_proj": (2 * heads * d, h), "layers.0.self_attn.k_proj": (kv * d, h),
              "layers.0.self_attn.v_proj": (kv * d, h), "layers.0.self_attn.o_proj": (h, heads * d),
              "layers.0.self_attn.q_norm": (d,), "layers.0.self_attn.k_norm": (d,),
              "layers.0.mlp.gate_proj": (inter, h), "layers.0.mlp.up_proj": (inter, h), "layers.0.mlp.down_proj": (h, inter)}
    return {f"mtp.{name}.weight": torch.randn(*shape, generator=g) * 0.3 for name, shape in shapes.items()}


def add_mtp(folder, seed: int = 0, repeat: bool = False, edit=None) -> None:
    """Write an MTP layer into the checkpoint's safetensors file beside the model's tensors.
    `repeat`: a layer that proposes the token it reads again (fc reads the embedding only; the
    attention's and the MLP's outputs are zero; unit norms): with tied embeddings its logits are
    the embedding's similarities, highest for the token itself, so a target's repeats are
    accepted. `edit(tensors)`: changes made before writing (the refusals' checkpoints)."""
    from safetensors.torch import load_file, save_file

    tensors = mtp_tensors(folder, seed)
    if repeat:
        h = tensors["mtp.norm.weight"].shape[0]
        tensors["mtp.fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
        for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight"):  # (1 + w) norms: w = 0 scales by one
            tensors[name] = torch.zeros(h)
        for name in ("mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
            tensors[name] = torch.zeros_like(tensors[name])
    if edit is not None:
        edit(tensors)
    path = folder / "model.safetensors"
    save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})


MODELS = {
    # name: (make_model overrides, add_mtp arguments)
    # the last layer full, as the released checkpoints' (transformers' MtpModel takes its norm class from it); GQA 4:2
    "qwen35-mtp": (dict(layers=4, layer_types=[LINEAR, FULL, LINEAR, FULL]), dict(seed=1)),
    # starting and ending with linear layers, tied, GQA 4:1; a layer that proposes repeats
    "qwen35-mtp-tied": (dict(layers=4, layer_types=[LINEAR, FULL, FULL, LINEAR], tie_word_embeddings=True,
                             num_key_value_heads=1), dict(seed=2, repeat=True)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35-mtp")
    for seed, (name, (overrides, extra)) in enumerate(MODELS.items()):
        tiny.make_model(root / name, "qwen3_5_text", seed=50 + seed, **overrides)
        add_mtp(root / name, **extra)
    return {name: root / name for name in MODELS}


@pytest.fixture(scope="module")
def bundles(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35-mtp-bundles")
    built = {}

    def get(name, dtype="fp32"):
        if (name, dtype) not in built:
            out = root / f"{name}-{dtype}"
            build_bundle(models[name], "mtp", out, dtype=dtype, max_seq=MAX_SEQ, max_draft=8, prefill_chunk=16)
            built[name, dtype] = out
        return built[name, dtype]

    return get


def transformers_mtp(folder):
    """(the target, transformers' MtpModel over the checkpoint's mtp.* tensors). Qwen3.5's config
    in transformers 5.25 names no MTP layer count: set as the checkpoint has it."""
    from transformers.modeling_layers import MtpModel

    main = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    main.config.num_mtp_layers = 1
    main.config.mtp_layer_types = [FULL]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main, MtpModel.from_pretrained(main).eval()


def their_chain(main, theirs, committed: list[int], k: int) -> list[int]:
    """transformers' layer over the target's final states for committed[:-1] with the token after
    each (at the token's position, as its candidate generator feeds them), then k - 1 steps
    each on its own last output and the token it proposed: the k greedy draft tokens."""
    from transformers.cache_utils import MtpCache

    n = len(committed)
    ids = torch.tensor([committed])
    cache = MtpCache(config=main.config.get_mtp_config())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        states = main(ids[:, : n - 1], output_hidden_states=True).hidden_states[-1]
        out = theirs.forward_layer(0, states, torch.arange(1, n)[None], cache, input_ids=ids[:, 1:])
        tokens = []
        for i in range(k):
            token = theirs._project_to_logits(out[:, -1:]).argmax(-1)
            tokens.append(int(token))
            out = theirs.forward_layer(0, out[:, -1:], torch.tensor([[n + i]]), cache, input_ids=token)
    return tokens


def test_the_layer_equals_transformers_mtp_model(models):
    """Our reference (positions of the states) against transformers' MtpModel (positions of the
    tokens) over a prompt's rows and three steps on its own output: RoPE sees the same distances."""
    from specdeploy.export.load import load_source
    from specdeploy.export.mtp import MtpReference, load_mtp
    from transformers.cache_utils import MtpCache

    folder = models["qwen35-mtp"]
    main, theirs = transformers_mtp(folder)
    ours = MtpReference(load_mtp(load_source(folder)))
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    n = ids.shape[1]
    cache = MtpCache(config=main.config.get_mtp_config())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        states = main(ids[:, : n - 1], output_hidden_states=True).hidden_states[-1]
        want = theirs.forward_layer(0, states, torch.arange(1, n)[None], cache, input_ids=ids[:, 1:])
        got, logits, past = ours(ids[:, 1:], states, torch.arange(0, n - 1)[None])
        for i in range(4):
            assert torch.allclose(got, want, atol=2e-5), (i, (got - want).abs().max())
            assert torch.allclose(logits, theirs._project_to_logits(want), atol=2e-5), i
            token = logits[:, -1:].argmax(-1)
            want = theirs.forward_layer(0, want[:, -1:], torch.tensor([[n + i]]), cache, input_ids=token)
            got, logits, past = ours(token, got[:, -1:], torch.tensor([[n - 1 + i]]), past)


@pytest.mark.bundle
def test_it_drafts_what_transformers_layer_proposes(models, bundles):
    """After a prompt, the drafter's k greedy tokens (ONNX Runtime, catching up on the target's
    states, then steps on its own) are transformers' chain, token for token; and the export's
    parity check against our reference is in the manifest."""
    bundle = bundles("qwen35-mtp")
    parity = load_bundle(bundle).model("draft").parity
    assert parity["max_rel_diff_ort_vs_eager"] < 1e-4 and parity["max_rel_diff_eager_vs_reference"] < 1e-4
    session = Session(bundle)
    main, theirs = transformers_mtp(models["qwen35-mtp"])
    for prompt in (PROMPTS[1], PROMPTS[16]):
        ids = session.encode(prompt)
        first = session.generate(prompt_ids=ids, max_new_tokens=1, speculate=False).token_ids
        committed = ids + first
        proposal = session.drafter.propose(np.array(committed), 4, SamplingParams(), np.random.default_rng(0))
        assert proposal.tokens.tolist() == their_chain(main, theirs, committed, 4), prompt


@pytest.mark.bundle
@pytest.mark.parametrize("name, dtype", [("qwen35-mtp", "fp32"), ("qwen35-mtp", "int4"), ("qwen35-mtp-tied", "fp32")])
def test_speculative_equals_plain_and_hf_generate(name, dtype, models, bundles):
    session = Session(bundles(name, dtype))
    hf = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32).eval() if dtype == "fp32" else None
    drafted = accepted = 0
    for prompt in (PROMPTS[1], PROMPTS[16], PROMPTS[2]):
        ids = session.encode(prompt)
        plain = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False).token_ids
        if hf is not None:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert plain == hf_greedy(hf, ids, session.eos_token_ids), prompt
        for k in (1, 3, 8, "auto"):
            spec = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert spec.token_ids == plain, (prompt, k)
            drafted += spec.stats.drafted
            accepted += spec.stats.accepted
    assert drafted > accepted  # rejections: the recurrent states rolled back
    if MODELS[name][1].get("repeat"):
        assert accepted > 0  # and acceptances: the layer's own state fed on, the target's states caught up


@pytest.mark.bundle
def test_the_torch_backend_drafts_with_the_layer_as_onnx_runtime_does(bundles):
    """The torch backend rebuilds the layer from the checkpoint: its rounds draft and accept what
    ONNX Runtime's do at a pinned k, and its output is plain decoding's."""
    bundle = bundles("qwen35-mtp-tied")
    ort_session, torch_session = Session(bundle), Session(bundle, backend="torch")
    accepted = 0
    for prompt in (PROMPTS[1], PROMPTS[16]):
        ids = ort_session.encode(prompt)
        plain = ort_session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False).token_ids
        for k in (1, 3):
            got = torch_session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            want = ort_session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert got.token_ids == plain, (prompt, k)
            assert (got.stats.drafted, got.stats.accepted) == (want.stats.drafted, want.stats.accepted), (prompt, k)
            accepted += got.stats.accepted
    assert accepted > 0


@pytest.mark.bundle
def test_every_request_in_a_batch_of_4_equals_it_alone(bundles):
    """One MTP layer per slot reading the hidden states the batched target wrote there, beside the
    slot's recurrent states: greedy and seeded sampled, pinned and auto, plain, joining as others
    leave: each request's tokens are a Session's alone."""
    from test_batch import assert_a_batch_of_4_answers_each_as_alone

    assert_a_batch_of_4_answers_each_as_alone(bundles("qwen35-mtp-tied"), 12)


@pytest.mark.bundle
def test_sampled_speculation_keeps_the_distribution(tmp_path):
    """Seeded sampling through the MTP layer: the suite's chi-square test (test_sampling.py: alpha
    1e-3, and its companion showing a broken sampler fails it)."""
    from test_sampling import assert_a_familys_draft_keeps_the_distribution

    assert_a_familys_draft_keeps_the_distribution(tmp_path, "qwen3_5_text", draft="mtp", prepare=add_mtp,
                                                  layer_types=[LINEAR, FULL])


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _reshape(name):
    return lambda tensors: tensors.update({name: tensors[name][:-1]})


def _second_layer(tensors):
    tensors.update({k.replace("layers.0.", "layers.1."): v.clone() for k, v in list(tensors.items()) if "layers.0." in k})


@pytest.mark.parametrize("edit, message", [
    (None, r"holds no mtp\.\* tensors \(this checkpoint ships no multi-token-prediction layer\); choose another draft"),
    (_drop("mtp.layers.0.self_attn.k_norm.weight"), r"tensor mtp\.layers\.0\.self_attn\.k_norm\.weight is missing"),
    (_reshape("mtp.fc.weight"), r"tensor mtp\.fc\.weight has shape \[63, 128\], expected \[64, 128\]"),
    (_second_layer, r"has 2 MTP layers .*; one is implemented"),
    (lambda t: t.update({"mtp.layers.0.linear_attn.A_log": torch.zeros(6)}),
     r"tensor mtp\.layers\.0\.linear_attn\.A_log is not part of a qwen3_5_text MTP layer of full attention"),
])
def test_a_checkpoint_without_the_layer_or_with_another_is_refused_in_one_line(edit, message, tmp_path):
    tiny.make_model(tmp_path / "m", "qwen3_5_text", layers=2, layer_types=[LINEAR, FULL])
    if edit is not None:
        add_mtp(tmp_path / "m", edit=edit)
    with pytest.raises(ExportError, match=message) as e:
        build_bundle(tmp_path / "m", "mtp", tmp_path / "b", max_seq=32)
    assert "\n" not in str(e.value) and not (tmp_path / "b").exists()


def test_other_families_and_devices_are_refused_in_one_line(tmp_path):
    tiny.make_model(tmp_path / "llama", "llama", layers=2)
    with pytest.raises(ExportError, match=r"is a llama model; the MTP draft is implemented for qwen3_5_text"):
        build_bundle(tmp_path / "llama", "mtp", tmp_path / "b", max_seq=32)
    tiny.make_model(tmp_path / "m", "qwen3_5_text", layers=2, layer_types=[LINEAR, FULL])
    add_mtp(tmp_path / "m")
    with pytest.raises(ExportError, match=r"--for cuda: .* keep recurrent states"):
        build_bundle(tmp_path / "m", "mtp", tmp_path / "c", max_seq=32, device="cuda")
