"""Long contexts, exactly: on a tiny model with a few hundred slots of context, a verify
pass's rows equal single steps bit for bit, and greedy speculative output equals plain and
Hugging Face `generate`, with float32 KV buffers and with float16 ones (export --kv-dtype), and
on an int8 graph, which reads its K/V as bound, at capacities that move with the window."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdeploy.core.errors import ExportError
from specdeploy.export import build_bundle
from specdeploy.runtime import Session
from specdeploy.runtime.backends.ort import OrtEngine
from tiny import CORPUS

MAX_SEQ = 512  # the tiny models' context
NEW_TOKENS = 96


@pytest.fixture(scope="module")
def long_bundles(models, tmp_path_factory):
    """The tiny Llama with itself as its draft (each draft token its target's own choice, so
    verify passes commit many rows), its KV buffers float32 and float16; and int8 (float16 K/V,
    read as bound: runtime/backends/ort.py kv_capacity), its draft its own int8 copy."""
    root = tmp_path_factory.mktemp("long")
    for kv in ("fp32", "fp16"):
        build_bundle(models["llama"], str(models["llama"]), root / kv, max_seq=MAX_SEQ, max_draft=8, prefill_chunk=64,
                     kv_dtype=kv)
    build_bundle(models["llama"], str(models["llama"]), root / "int8", max_seq=MAX_SEQ, max_draft=8, prefill_chunk=64,
                 dtype="int8")
    return {kv: root / kv for kv in ("fp32", "fp16", "int8")}


KV_DTYPE = {"fp32": "float32", "fp16": "float16", "int8": "float16"}


def long_prompt(session: Session, tokens: int) -> list[int]:
    text = " ".join(CORPUS[i % len(CORPUS)] for i in range(64))
    ids = session.encode(text)
    assert len(ids) >= tokens
    return ids[:tokens]


@pytest.mark.parametrize("kv", ["fp32", "fp16", "int8"])
def test_verify_rows_equal_single_steps_deep_in_the_context(kv, long_bundles):
    session = Session(long_bundles[kv])
    spec = session.bundle.model("target")
    assert spec.kv_dtype == KV_DTYPE[kv]
    engine = OrtEngine.from_bundle(session.bundle, spec)
    ids = np.array(long_prompt(session, 440), np.int64)
    for start in range(0, 300, 64):
        engine.forward(ids[start:min(start + 64, 300)], start, last=True)
    for start in (300, 420):  # a verify pass of 9 rows, then the same tokens one at a time
        if start > 300:
            engine.forward(ids[300:start], 300, last=True)
        rows = engine.forward(ids[start:start + 9], start).copy()
        for i in range(9):
            step = engine.forward(ids[start + i:start + i + 1], start + i)
            assert np.array_equal(step[0], rows[i]), (start, i)


@pytest.mark.parametrize("kv", ["fp32", "fp16", "int8"])
def test_long_prompt_speculative_equals_plain_and_hf_generate(kv, long_bundles, models):
    session = Session(long_bundles[kv])
    session.eos_token_ids = []  # decode every requested token, to the end of the buffer
    hf = AutoModelForCausalLM.from_pretrained(models["llama"], dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as the session: every requested token
    for length in (250, MAX_SEQ - NEW_TOKENS):
        ids = long_prompt(session, length)
        plain = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, speculate=False)
        assert len(plain.token_ids) == NEW_TOKENS
        for k in (2, 8):
            spec = session.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, draft_len=k)
            assert spec.token_ids == plain.token_ids, (length, k)
            assert spec.stats.target_passes < NEW_TOKENS  # drafts were accepted: multi-row passes committed
        if kv == "fp32":  # float16 KV rounds what the source keeps in float32: another model's numerics
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                  pad_token_id=0)[0, len(ids):].tolist()
            assert plain.token_ids == ref, length


def test_the_kv_capacity_follows_the_window_and_keeps_what_is_read(long_bundles):
    """The target reads its K/V as bound, laid out at a capacity a little above each pass's window
    (runtime/backends/ort.py kv_capacity): grown as a context lengthens, shrunk for a shorter
    prompt that reuses a cached prefix, grown again. Every generation equals the same request in a
    session that caches no prompt (its K/V all written by the request itself), and the cached
    prefixes are reused across each move."""
    import onnx

    session, fresh = Session(long_bundles["int8"]), Session(long_bundles["int8"], prompt_cache=False)
    session.eos_token_ids = fresh.eos_token_ids = []
    graph = onnx.load(str(session.bundle.file("target.onnx")), load_external_data=False).graph
    kv_names = {v.name for v in graph.input if v.name.startswith("past_")}
    assert not [n for n in graph.node if n.op_type == "Slice" and n.input[0].replace("present_", "past_") in kv_names]
    assert all(v.type.tensor_type.shape.dim[2].dim_param == "L" for v in graph.input if v.name in kv_names)
    engine = session.target
    assert engine.windowed and engine.capacity == MAX_SEQ  # laid out at max_seq until the first pass
    ids = long_prompt(session, 440)
    capacities = []
    for prompt, cached, k in ((ids[:100], 0, 4), (ids[:380], 100, 8), (ids[:150], 140, 2), (ids[:150] + ids[:150], 150, 8)):
        got = session.generate(prompt_ids=prompt, max_new_tokens=60, draft_len=k)
        capacities.append(engine.capacity)
        assert got.stats.cached_tokens >= cached, (len(prompt), got.stats.cached_tokens)
        assert got.token_ids == fresh.generate(prompt_ids=prompt, max_new_tokens=60, speculate=False).token_ids
    # grown with the context, shrunk for the shorter prompt (its cached prefix moved), grown again
    assert capacities[0] < capacities[1] > capacities[2] < capacities[3] < MAX_SEQ, capacities


def test_a_batch_lets_a_finished_requests_long_kv_go_and_reuses_what_is_left(long_bundles):
    """In a batch a finished request's slot keeps its K/V for a later prompt that shares them, but
    releases them: the running lane's passes lay the buffers out at its own, smaller, capacity,
    which cuts the held K/V to it. A later request sharing the long prompt reuses what is left
    (less than it would have) and answers as it would alone; so do the requests before it."""
    from specdeploy.runtime import BatchSession
    from test_batch import joined_generations

    bundle = long_bundles["int8"]
    alone = Session(bundle, prompt_cache=False)
    alone.eos_token_ids = []
    batched = BatchSession(bundle, batch=2)
    batched.eos_token_ids = frozenset()
    ids = long_prompt(alone, 440)
    short = ids[200:230]
    try:
        long_gen, short_gen = joined_generations(batched, [(None, dict(prompt_ids=ids[:400], max_new_tokens=8,
                                                                         draft_len=4)),
                                                           (None, dict(prompt_ids=short, max_new_tokens=90, draft_len=4))])
        got_long, got_short = Session.collect(long_gen), Session.collect(short_gen)
        assert batched.target.capacity < 400  # the short lane's passes alone: the long K/V let go
        again = batched.generate(prompt_ids=ids[:420], max_new_tokens=40, draft_len=4)
        assert 0 < again.stats.cached_tokens < 399, again.stats.cached_tokens
    finally:
        batched.close()
    for prompt, new, got in ((ids[:400], 8, got_long), (short, 90, got_short), (ids[:420], 40, again)):
        assert got.token_ids == alone.generate(prompt_ids=prompt, max_new_tokens=new, speculate=False).token_ids


def test_kv_cost_is_stated_and_fp16_halves_it(long_bundles):
    full, half = (Session(long_bundles[kv]).bundle.manifest for kv in ("fp32", "fp16"))
    t = full.models["target"]
    per_layer = 2 * t.num_kv_heads * MAX_SEQ * t.head_dim
    assert t.kv_bytes(MAX_SEQ) == per_layer * t.num_layers * 4
    assert half.models["target"].kv_bytes(MAX_SEQ) * 2 == t.kv_bytes(MAX_SEQ)
    assert half.models["draft"].kv_dtype == "float32"  # --kv-dtype is the target's
    line = half.kv_cost()
    assert f"{half.kv_bytes() / 2**20:.1f} MiB per sequence at max_seq {MAX_SEQ}" in line
    assert f"{half.kv_bytes() * half.max_batch / 2**20:.1f} MiB for {half.max_batch} batch slots" in line


@pytest.mark.parametrize("kwargs, words", [
    (dict(kv_dtype="int8"), "--kv-dtype 'int8': expected one of fp32, fp16"),
    (dict(kv_dtype="fp32", dtype="fp16"), "--kv-dtype fp32 with --dtype fp16"),
    (dict(kv_dtype="fp16", attention="fused"), "--kv-dtype fp16 with --attention fused"),
    (dict(kv_dtype="fp16", dtype="int4", device="tensorrt"), "--kv-dtype fp16 with --for tensorrt"),
])
def test_kv_dtype_refusals_name_the_flag(kwargs, words, tmp_path):
    with pytest.raises(ExportError) as e:
        build_bundle(tmp_path / "no-such-model", "none", tmp_path / "out", **{"dtype": "fp32", **kwargs})
    assert words in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("context, want, says", [
    (8192, 8192, "--max-seq 8192: the model's context"),
    (512, 512, "--max-seq 512: the model's context"),
    (131072, 8192, "--max-seq 8192: the model reads up to 131072 tokens"),
    (None, 2048, "--max-seq 2048: the model's config names no context"),
])
def test_max_seq_defaults_to_the_models_context_within_a_cap(context, want, says):
    from types import SimpleNamespace

    from specdeploy.export.build import default_max_seq

    said = []
    assert default_max_seq(SimpleNamespace(max_position_embeddings=context), said.append) == want
    assert said and said[0].startswith(says)
