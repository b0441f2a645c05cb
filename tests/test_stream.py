"""Streaming text: pieces are whole characters even when one spans several tokens."""
import numpy as np
from transformers import AutoTokenizer

from specdeploy.runtime import Session, load_bundle
from specdeploy.runtime.decoding.tokenizer import TextStream, Tokenizer


def _tokenizer(bundles):
    b = load_bundle(bundles("llama-self"))
    return Tokenizer(b.file(b.tokenizer.file), b.tokenizer)


def test_multibyte_characters_never_split(bundles):
    tok = _tokenizer(bundles)
    text = "Zürich 東京 🚀🙂 naïve — done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # the rare characters really span several tokens
    stream = TextStream(tok)
    pieces = [stream.push([i]) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_stream_and_collect_agree(bundles):
    session = Session(bundles("llama-ngram"))
    gen = session.stream("Zürich and Köln", max_new_tokens=30)
    pieces = list(gen)
    collected = session.generate("Zürich and Köln", max_new_tokens=30)
    assert "".join(p.text for p in pieces) == collected.text
    assert sum((p.token_ids for p in pieces), []) == collected.token_ids
    assert collected.text == session.tokenizer.decode(collected.token_ids)
    assert gen.stats.new_tokens == len(collected.token_ids)


def test_chat_template_matches_hugging_face(bundles, models):
    tok = _tokenizer(bundles)
    hf = AutoTokenizer.from_pretrained(models["llama"])
    messages = [{"role": "user", "content": "What is 2+2?"}]
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(messages) == want
    assert tok.encode_chat("What is 2+2?") == hf(want, add_special_tokens=False).input_ids


def test_plain_encoding_matches_hugging_face(bundles, models):
    tok = _tokenizer(bundles)
    hf = AutoTokenizer.from_pretrained(models["llama"])
    for text in ["Hello there", "def f(x):\n  return x", "東京 🚀"]:
        assert tok.encode(text) == hf(text).input_ids
        assert np.array_equal(tok.encode(text), hf.encode(text))
