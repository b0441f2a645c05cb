"""Models with recurrent layers (export/recurrent.py, runtime/backends/recurrent.py): Qwen3.5's
Gated DeltaNet layers beside gated, partially rotated attention.

Tiny random models built here with odd shapes (attention heads 24 wide, not hidden / heads; GQA
4:2; linear key heads 2, value heads 4, neither the attention's; a layer pattern that starts and
ends with linear layers; untied and tied heads) give Hugging Face `generate`'s tokens plainly
and speculatively at every draft length, for every draft kind that applies, at fp32 and int4;
a verify pass's rows equal single steps bit for bit; a rollback that keeps the state after the
last drafted row instead of the last accepted one fails the equality test."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import tiny
from specdeploy.core.errors import ExportError, InputError
from specdeploy.core.manifest import load_bundle
from specdeploy.export import build_bundle
from specdeploy.export.recurrent import GatedDeltaNet, causal_conv, gated_delta_rule, lower_scans
from specdeploy.runtime import Session
from specdeploy.runtime.backends import recurrent
from specdeploy.runtime.backends.ort import OrtEngine
from test_lossless import hf_greedy
from tiny import PROMPTS

MAX_SEQ = 128
NEW_TOKENS = 40
DRAFT_LENS = (1, 3, 8, "auto")
REPEATING = " ".join([PROMPTS[0]] * 3)  # a lookup draft proposes from its first rounds
LINEAR, FULL = "linear_attention", "full_attention"


# -- the layer, against the published one, and its lowering (no bundle) ---------------------

def _hf_layer(seed: int = 0):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(hidden_size=64, **{k: v for k, v in tiny.FAMILY_DEFAULTS["qwen3_5_text"].items()
                                               if k.startswith("linear_")}, num_hidden_layers=2,
                            layer_types=[LINEAR, FULL])
    layer = Qwen3_5GatedDeltaNet(cfg, 0).eval()
    for p in layer.parameters():  # away from the init's ones and zeros
        p.data.normal_(0, 0.3)
    layer.A_log.data.uniform_(-1, 1)
    return layer


def test_the_layer_equals_the_published_one_over_a_prompt_and_step_by_step():
    """Our Gated DeltaNet (states in, states after each row out) against Qwen3_5GatedDeltaNet:
    over a whole prompt (the source's chunked form) and continued one token at a time from the
    states ours returned (the source's recurrent form over its cache's states)."""
    from transformers import DynamicCache

    layer = _hf_layer()
    ours = GatedDeltaNet(layer)
    (c, k1), (h, dk, dv) = ours.state_shapes
    x = torch.randn(1, 11, 64)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = layer(x)
        got, conv, state = ours(x, torch.zeros(1, c, k1), torch.zeros(1, h, dk, dv), torch.arange(11))
        assert conv.shape == (1, 11, c, k1) and state.shape == (1, 11, h, dk, dv)
        assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()
        # the rows' states: continuing from the state after row 6 gives rows 7.. again
        again, _, _ = ours(x[:, 7:], conv[:, 6], state[:, 6], torch.arange(4))
        assert torch.allclose(again, got[:, 7:], atol=1e-6)
        # step by step, against the source's single-token path over its own cache
        cache = DynamicCache(config=layer_config(layer))
        layer(x[:, :7], cache=cache)
        for i in range(7, 11):
            step = layer(x[:, i : i + 1], cache=cache)
            assert torch.allclose(step, got[:, i : i + 1], atol=2e-5), i


def layer_config(layer):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(hidden_size=64, num_hidden_layers=2, layer_types=[LINEAR, FULL],
                             **{k: v for k, v in tiny.FAMILY_DEFAULTS["qwen3_5_text"].items() if k.startswith("linear_")})


class _Recurrences(torch.nn.Module):
    def forward(self, q, k, v, decay, beta, state, x, conv_state, weight, rows):
        out, states = gated_delta_rule(q, k, v, decay, beta, state, rows)
        conv_out, conv_states = causal_conv(x, conv_state, weight, rows)
        return out, states, conv_out, conv_states


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """The recurrence and the convolution exported, their placeholder lowered to Scans, loaded."""
    import onnx
    import onnxruntime as ort

    from specdeploy.export.ops import OPSET, onnx_translations

    b, t, h, dk, dv, c, k = 1, 5, 3, 4, 6, 7, 4
    g = torch.Generator().manual_seed(0)
    example = (torch.randn(b, t, h, dk, generator=g), torch.randn(b, t, h, dk, generator=g),
               torch.randn(b, t, h, dv, generator=g), torch.rand(b, t, h, generator=g), torch.rand(b, t, h, generator=g),
               torch.randn(b, h, dk, dv, generator=g), torch.randn(b, t, c, generator=g),
               torch.randn(b, c, k - 1, generator=g), torch.randn(c, k, generator=g), torch.tensor([0, 1]))
    names = ["q", "k", "v", "decay", "beta", "state", "x", "conv_state", "weight", "rows"]
    dim_t, dim_r = torch.export.Dim("T", min=1, max=64), torch.export.Dim("R", min=1, max=64)
    dynamic = {n: ({1: dim_t} if n in ("q", "k", "v", "decay", "beta", "x") else {0: dim_r} if n == "rows" else None)
               for n in names}
    path = tmp_path_factory.mktemp("scan") / "recurrences.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(_Recurrences(), example, dynamo=True, dynamic_shapes=dynamic, opset_version=OPSET,
                                    custom_translation_table=onnx_translations(), input_names=names,
                                    output_names=["out", "states", "conv_out", "conv_states"], verbose=False)
    program.save(path)
    model = onnx.load(str(path))
    assert lower_scans(model) == 1
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}  # the placeholder is gone
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    weight = example[8]

    def run(t, rows, seed):
        gen = torch.Generator().manual_seed(seed)
        args = (torch.randn(b, t, h, dk, generator=gen), torch.randn(b, t, h, dk, generator=gen),
                torch.randn(b, t, h, dv, generator=gen), torch.rand(b, t, h, generator=gen),
                torch.rand(b, t, h, generator=gen), torch.randn(b, h, dk, dv, generator=gen),
                torch.randn(b, t, c, generator=gen), torch.randn(b, c, k - 1, generator=gen), weight, rows)
        feed = {n: a.numpy() for n, a in zip(names, args) if n in {i.name for i in session.get_inputs()}}
        return args, session.run(None, feed)

    return run, session, names


@pytest.mark.parametrize("t, r", [(1, 1), (4, 4), (5, 2), (7, 3)])
def test_the_lowered_recurrence_equals_eager_and_its_rows_equal_single_steps_bit_for_bit(lowered, t, r):
    """The Scans (the rows before the last R, none for a verify pass; the last R returning their
    states) against the eager op, and each row against a pass of that row alone from the state
    the row before left."""
    run, session, names = lowered
    args, got = run(t, torch.arange(t - r, t), seed=t * 10 + r)
    want = [x.numpy() for x in _Recurrences()(*args)]
    for a, w in zip(got, want):
        assert a.shape == w.shape and np.allclose(a, w, atol=1e-6)
    q, k, v, decay, beta, state, x, conv_state, weight, _ = args
    outs, states, conv_outs, conv_states = [], [], [], []
    for i in range(t):
        one = (q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1], decay[:, i : i + 1], beta[:, i : i + 1], state,
               x[:, i : i + 1], conv_state, weight, torch.tensor([0]))
        feed = {n: a.numpy() for n, a in zip(names, one) if n in {i.name for i in session.get_inputs()}}
        out, s, conv_out, cs = session.run(None, feed)
        outs.append(out), states.append(s), conv_outs.append(conv_out), conv_states.append(cs)
        state, conv_state = torch.from_numpy(s[:, 0]), torch.from_numpy(cs[:, 0])
    assert np.array_equal(np.concatenate(outs, 1), got[0])
    assert np.array_equal(np.concatenate(states, 1)[:, t - r :], got[1])
    assert np.array_equal(np.concatenate(conv_outs, 1), got[2])
    assert np.array_equal(np.concatenate(conv_states, 1)[:, t - r :], got[3])


# -- the states kept by position (no graph) ---------------------------------------------------

class _Binding:
    """Records the arrays RecurrentStates binds, by name (inputs and outputs alike)."""

    def __init__(self):
        self.arrays = {}

    def bind_input(self, name, device, index, dtype, shape, address):
        import ctypes

        pointer = ctypes.cast(address, ctypes.POINTER(ctypes.c_float))
        self.arrays[name] = np.ctypeslib.as_array(pointer, shape=tuple(shape))

    bind_output = bind_input


def test_states_are_kept_by_position_and_a_pass_reads_the_one_at_its_start():
    """Passes of every shape the loop makes (prefill chunks returning one state, steps, verify
    passes returning all, rollbacks of any depth, passes that wrap around the ring): each reads
    the state of exactly its start, `resumable` names only kept positions, and a position past
    a pass's start is never read again before a pass writes it anew."""
    from specdeploy.core.manifest import ModelSpec

    spec = ModelSpec(role="target", graph="g.onnx", num_layers=2, num_kv_heads=1, head_dim=1, vocab_size=4,
                     kv_dtype="float32", inputs={"conv_state_0": ["B", 2, 3], "recurrent_state_0": ["B", 2, 2, 2]})
    states = recurrent.RecurrentStates(spec, keep=6, name="target")
    rng = np.random.default_rng(0)
    length = 0
    for i in range(300):
        start = int(rng.integers(max(0, length - 5), length + 1)) if length else 0
        start = states.resumable(start)
        t = int(rng.integers(1, 7))
        rows = t if rng.random() < 0.6 else 1
        binding = _Binding()
        states.bind(binding, start, t, rows)
        for name in ("conv_state_0", "recurrent_state_0"):  # the state of exactly `start` (0: zeros)
            assert np.all(binding.arrays[name] == start), (i, start, name)
        for name in ("conv_states_0", "recurrent_states_0"):  # the graph, played: row r's state is its position's
            for r in range(rows):
                binding.arrays[name][0, r] = start + t - rows + 1 + r
        states.commit()
        assert all(p <= start + t for p in states.slot_of)
        assert start + t in states.slot_of  # the pass's last state is always kept
        length = start + t


# -- tiny models, exported --------------------------------------------------------------------

MODELS = {
    # name: (layers, make_model overrides)
    "qwen35": (3, dict()),  # linear, full, linear (tiny.make_model's pattern), untied head
    "qwen35-tied": (4, dict(tie_word_embeddings=True, num_key_value_heads=1, layer_types=[LINEAR, FULL, FULL, LINEAR])),  # GQA 4:1
    "qwen35-draft": (2, dict(layer_types=[LINEAR, FULL])),  # a draft model of the same family and tokenizer
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35")
    for seed, (name, (layers, extra)) in enumerate(MODELS.items()):
        tiny.make_model(root / name, "qwen3_5_text", seed=40 + seed, layers=layers, **extra)
    return {name: root / name for name in MODELS}


@pytest.fixture(scope="module")
def bundles(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35-bundles")
    built = {}

    def get(name, draft, dtype="fp32"):
        key = (name, draft, dtype)
        if key not in built:
            out = root / f"{name}-{draft.replace(':', '-').replace('=', '')}-{dtype}"
            spec = str(models["qwen35-draft"]) if draft == "model" else draft
            build_bundle(models[name], spec, out, dtype=dtype, max_seq=MAX_SEQ, max_draft=8, prefill_chunk=16,
                         cache=root / "graphs")  # the target exported once for its drafts
            built[key] = out
        return built[key]

    get.cache = root / "graphs"
    return get


def test_the_tiny_models_have_the_shapes_meant(models):
    import json

    cfg = json.loads((models["qwen35"] / "config.json").read_text())
    assert cfg["layer_types"] == [LINEAR, FULL, LINEAR]
    assert cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    assert cfg["linear_num_key_heads"] < cfg["linear_num_value_heads"] != cfg["num_attention_heads"]
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.25 and not cfg["tie_word_embeddings"]
    tied = json.loads((models["qwen35-tied"] / "config.json").read_text())
    assert tied["layer_types"] == [LINEAR, FULL, FULL, LINEAR] and tied["tie_word_embeddings"]


@pytest.mark.bundle
@pytest.mark.parametrize("name, draft", [("qwen35", "model"), ("qwen35", "self:layers=2"), ("qwen35", "self:dtype=int8"),
                                         ("qwen35", "ngram"), ("qwen35", "suffix"), ("qwen35-tied", "ngram")])
def test_plain_and_speculative_equal_hf_generate(name, draft, models, bundles):
    bundle = bundles(name, draft)
    session = Session(bundle)
    hf = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32).eval()
    lookup = draft in ("ngram", "suffix")
    prompts = [PROMPTS[1], PROMPTS[16]] + ([REPEATING] if lookup else [])
    drafted = accepted = 0
    for prompt in prompts:
        ids = session.encode(prompt)
        plain = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert plain.token_ids == hf_greedy(hf, ids, session.eos_token_ids), prompt
        for k in DRAFT_LENS:
            spec = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert spec.token_ids == plain.token_ids, (prompt, k)
            drafted += spec.stats.drafted
            accepted += spec.stats.accepted
    assert drafted > accepted  # drafts were rejected: rollbacks ran
    # and taken: a self draft agrees often (a random draft model, or lookups in a random model's
    # text, seldom do)
    assert accepted > 0 or not draft.startswith("self")


@pytest.mark.bundle
@pytest.mark.parametrize("dtype", ["fp32", "int4"])
def test_verify_rows_equal_single_steps_bit_for_bit(dtype, bundles):
    """A pass of 4 rows against 4 single steps, after prefixes of 0, 8 and 15 tokens (RoPE's
    angles and the attention window past a 16-float vector)."""
    bundle = load_bundle(bundles("qwen35", "model", dtype))
    ids = np.arange(3, 40, dtype=np.int64)
    for prefix in (0, 8, 15):
        engine = OrtEngine.from_bundle(bundle, bundle.model("target"))
        if prefix:
            engine.forward(ids[:prefix], 0, last=True)
        rows = engine.forward(ids[prefix : prefix + 4], prefix).copy()
        steps = np.stack([engine.forward(ids[prefix + i : prefix + i + 1], prefix + i)[0].copy() for i in range(4)])
        assert np.array_equal(rows, steps), (prefix, np.abs(rows - steps).max())


@pytest.mark.bundle
def test_int4_is_lossless_with_a_model_draft(bundles):
    session = Session(bundles("qwen35", "model", "int4"))
    for prompt in (PROMPTS[1], REPEATING):
        ids = session.encode(prompt)
        plain = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False).token_ids
        for k in (1, 3, 8):
            spec = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert spec.token_ids == plain, (prompt, k)
            assert spec.stats.drafted > spec.stats.accepted


@pytest.mark.bundle
def test_a_rollback_to_the_last_drafted_state_fails_the_equality_test(bundles, monkeypatch):
    """The companion: the engine made to start each pass from the newest state it keeps (after
    the last row it ran, drafted or not) instead of the one at the pass's start."""
    session = Session(bundles("qwen35", "model"))
    ids = session.encode(REPEATING)
    plain = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False).token_ids
    honest = recurrent.RecurrentStates.bind

    def newest(self, binding, start, t, rows):
        if start in self.slot_of:
            self.slot_of[start] = self.slot_of[max(self.slot_of)]
        return honest(self, binding, start, t, rows)

    monkeypatch.setattr(recurrent.RecurrentStates, "bind", newest)
    assert session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=3).token_ids != plain


@pytest.mark.bundle
def test_the_prompt_cache_resumes_from_a_kept_state_or_prefills(bundles):
    """A chat's next turn (the last prompt, its answer, more) reuses the prefix whose state is
    kept, and answers as a session without a cache does; a prompt that shares only a part of the
    last one (no state kept there) prefills, and answers the same."""
    bundle = bundles("qwen35", "ngram")
    cached, fresh = Session(bundle), Session(bundle, prompt_cache=False)
    first = cached.encode(PROMPTS[1])
    answer = cached.generate(prompt_ids=first, max_new_tokens=12, speculate=False).token_ids
    follow = first + answer + cached.encode(PROMPTS[2])
    got = cached.generate(prompt_ids=follow, max_new_tokens=NEW_TOKENS, draft_len=3)
    assert got.stats.cached_tokens > len(first)  # resumed after the answer's kept state
    assert got.token_ids == fresh.generate(prompt_ids=follow, max_new_tokens=NEW_TOKENS, draft_len=3).token_ids
    part = first[: len(first) // 2] + cached.encode(PROMPTS[3])
    again = cached.generate(prompt_ids=part, max_new_tokens=NEW_TOKENS, speculate=False)
    assert again.stats.cached_tokens == 0
    assert again.token_ids == fresh.generate(prompt_ids=part, max_new_tokens=NEW_TOKENS, speculate=False).token_ids


@pytest.mark.bundle
def test_sampled_speculation_keeps_the_distribution(tmp_path):
    """Seeded sampling through an int8 self-draft: the suite's chi-square test (test_sampling.py:
    alpha 1e-3, and its companion showing a broken sampler fails it)."""
    from test_sampling import assert_a_familys_draft_keeps_the_distribution

    assert_a_familys_draft_keeps_the_distribution(tmp_path, "qwen3_5_text", layer_types=[LINEAR, FULL])


@pytest.mark.bundle
@pytest.mark.parametrize("draft", ["model", "self:layers=2", "self:dtype=int8", "ngram", "suffix"])
def test_every_request_in_a_batch_of_4_equals_it_alone(draft, bundles):
    """Each slot keeps its own states by position: greedy and seeded sampled requests, pinned and
    auto draft lengths, plain, prompts of different lengths finishing at different times, joining
    as others leave: token for token what a Session gives each alone. A draft model of the family
    and a self-draft keep theirs in the batch's draft engine, slot by slot."""
    from test_batch import assert_a_batch_of_4_answers_each_as_alone

    assert_a_batch_of_4_answers_each_as_alone(bundles("qwen35", draft), 12)


@pytest.mark.bundle
def test_a_batch_reuses_a_slot_from_its_kept_state_and_fits_rows_after_each_lane(bundles):
    """A prompt that extends a finished one resumes in its slot where a state is kept (after the
    answer), and answers as alone; a lane near the end of the buffer beside one drafting 8 tokens:
    the pass is cut to the room it has after its rows (a pass may not start before a lane's
    length: no state is kept there), and both answer as alone."""
    from specdeploy.runtime.decoding.batch import BatchSession
    from test_batch import Repeats, collect, joined, joined_generations

    bundle = bundles("qwen35", "ngram")
    alone = Session(bundle, prompt_cache=False)
    batched = BatchSession(bundle, batch=2)
    try:
        first = batched.generate(PROMPTS[16], max_new_tokens=10, speculate=False)
        ids = batched.encode(PROMPTS[16]) + first.token_ids + batched.encode(" again")
        second = batched.generate(prompt_ids=ids, max_new_tokens=10)
        assert second.stats.cached_tokens > len(first.token_ids)
        assert second.token_ids == alone.generate(prompt_ids=ids, max_new_tokens=10).token_ids
        # two requests of one prompt at once: one prefills, the other copies its K/V and its state
        twins = joined_generations(batched, [(PROMPTS[5], dict(max_new_tokens=10, speculate=False))] * 2)
        assert [collect(g) for g in twins] == [alone.generate(PROMPTS[5], max_new_tokens=10, speculate=False).token_ids] * 2
        assert max(g.stats.cached_tokens for g in twins) > 0
    finally:
        batched.close()
    long_ids = alone.encode(" ".join(PROMPTS) * 2)[: MAX_SEQ - 12]
    work = [(None, dict(prompt_ids=long_ids, max_new_tokens=12, speculate=False)),
            (PROMPTS[13], dict(max_new_tokens=40, draft_len=8))]
    want = [alone.generate(prompt_ids=long_ids, max_new_tokens=12, speculate=False).token_ids,
            alone.generate(PROMPTS[13], max_new_tokens=40, speculate=False).token_ids]
    batched = BatchSession(bundle, batch=2)
    batched.drafter = Repeats()
    widths = []
    forward = batched.target.forward_batch
    batched.target.forward_batch = lambda tokens, starts, **kw: (widths.append(tokens.shape), forward(tokens, starts, **kw))[1]
    try:
        assert joined(batched, work) == want
        assert (2, 9) in widths and any(b == 2 and t < 9 for b, t in widths)  # wide, then cut to the room left
    finally:
        batched.close()


@pytest.mark.bundle
@pytest.mark.parametrize("draft", ["model", "self:layers=2", "ngram"])
def test_the_torch_backend_keeps_the_states_as_onnx_runtime_does(draft, bundles):
    """The torch backend (eager, the module the graph was exported from, states in a ring of
    tensors): plain and speculative greedy output equal ONNX Runtime's, token for token."""
    bundle = bundles("qwen35", draft)
    ort_session, torch_session = Session(bundle), Session(bundle, backend="torch")
    drafted = accepted = 0
    for prompt in (PROMPTS[1], REPEATING):
        ids = ort_session.encode(prompt)
        plain = ort_session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False).token_ids
        assert torch_session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False).token_ids == plain
        for k in (1, 3, "auto"):
            spec = torch_session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert spec.token_ids == plain, (prompt, k)
            drafted += spec.stats.drafted
            accepted += spec.stats.accepted
    assert drafted > accepted  # rollbacks ran


@pytest.mark.bundle
def test_what_does_not_keep_recurrent_states_is_refused_in_one_line(models, bundles, tmp_path):
    from specdeploy.runtime.decoding.batch import BatchSession
    from specdeploy.runtime.serving.pool import default_batch

    bundle = bundles("qwen35", "ngram")
    batch, why = default_batch(load_bundle(bundle), backend="torch")
    assert batch is None and "recurrent states" in why and "not torch" in why
    assert default_batch(load_bundle(bundle))[0] is not None  # ONNX Runtime's CPU batches them
    with pytest.raises(InputError) as e:
        BatchSession(bundle, batch=2, backend="torch")
    assert "linear-attention" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ExportError, match=r"first 1 layers are all linear attention.*self:layers, take more"):
        build_bundle(models["qwen35"], "self:layers=1", tmp_path / "b", max_seq=MAX_SEQ, max_draft=8,
                     prefill_chunk=16, cache=bundles.cache)  # the target from the cache: the draft is refused
    with pytest.raises(ExportError, match=r"--for tensorrt: .* keep recurrent states, which only ONNX Runtime's CPU"):
        build_bundle(models["qwen35"], "ngram", tmp_path / "t", max_seq=MAX_SEQ, device="tensorrt")
    tiny.make_model(tmp_path / "biased", "qwen3_5_text", layers=3, attention_bias=True)
    with pytest.raises(ExportError, match="config attention_bias: attention biases are not implemented"):
        build_bundle(tmp_path / "biased", "ngram", tmp_path / "biased-b", max_seq=MAX_SEQ)
    # a layer type of another hybrid (transformers' Qwen3.5 config would not load one: checked on the config)
    from transformers import AutoConfig

    from specdeploy.export.architectures import check_config

    cfg = AutoConfig.from_pretrained(models["qwen35"])
    cfg.layer_types = [LINEAR, FULL, "mamba"]
    with pytest.raises(ExportError, match="config layer_types: 'mamba' is not implemented"):
        check_config(cfg)
