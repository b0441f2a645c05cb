"""`export --cache DIR`: a graph is reused only where the source and every choice that reaches it
are the same, and a reused graph gives the bundle a fresh export would (export/graph_cache.py)."""
from __future__ import annotations

import json
import shutil

import pytest

from specdeploy.export import build_bundle
from specdeploy.export.graph_cache import GraphCache
from specdeploy.runtime import Session
from tiny import PROMPTS

pytestmark = pytest.mark.bundle

REUSED = "from the cache"


def _export(target, draft, out, cache, **choices):
    lines: list[str] = []
    build_bundle(target, draft, out, max_seq=64, max_draft=4, prefill_chunk=16, cache=cache, log=lines.append,
                 **choices)
    return [line for line in lines if REUSED in line]


def _target(bundle):
    entry = json.loads((bundle / "manifest.json").read_text())["models"]["target"]
    return {k: v for k, v in entry.items() if k != "source"}


def test_a_target_exported_for_one_draft_is_reused_for_another_and_decodes_the_same(models, tmp_path):
    cache = tmp_path / "cache"
    assert _export(models["llama"], "ngram", tmp_path / "a", cache) == []  # a miss: exported and kept
    reused = _export(models["llama"], "suffix", tmp_path / "b", cache)
    assert len(reused) == 1 and reused[0].lstrip().startswith("target:")
    assert (tmp_path / "a" / "target.onnx").read_bytes() == (tmp_path / "b" / "target.onnx").read_bytes()
    assert _target(tmp_path / "a") == _target(tmp_path / "b")  # parity figures included
    # the bundle made from the cache is whole (its checksums are its own files') and decodes
    want = Session(tmp_path / "a").generate(PROMPTS[1], max_new_tokens=12, speculate=False).token_ids
    assert Session(tmp_path / "b").generate(PROMPTS[1], max_new_tokens=12, speculate=False).token_ids == want
    # the draft graph of a model draft is kept too: a second bundle with it reuses both
    _export(models["llama"], str(models["llama_draft"]), tmp_path / "c", cache)
    assert len(_export(models["llama"], str(models["llama_draft"]), tmp_path / "d", cache)) == 2


@pytest.mark.parametrize("change", ["dtype", "max_seq", "source"])
def test_any_other_choice_or_source_is_a_miss(change, models, tmp_path):
    cache = tmp_path / "cache"
    source = tmp_path / "m"
    shutil.copytree(models["llama"], source)
    _export(source, "ngram", tmp_path / "a", cache)
    choices = {}
    if change == "dtype":
        choices = dict(dtype="int8")
    elif change == "source":  # one byte of one file: the folder's digest moves
        config = source / "config.json"
        config.write_text(config.read_text() + " ")
    lines: list[str] = []
    build_bundle(source, "ngram", tmp_path / "b", max_seq=32 if change == "max_seq" else 64, max_draft=4,
                 prefill_chunk=16, cache=cache, log=lines.append, **choices)
    assert not any(REUSED in line for line in lines)
    assert any("checking parity" in line for line in lines)  # exported and checked again


@pytest.mark.parametrize("damage", ["graph gone", "entry not a manifest entry"])
def test_an_entry_that_is_not_whole_is_a_miss(damage, models, tmp_path):
    cache = tmp_path / "cache"
    _export(models["llama"], "ngram", tmp_path / "a", cache)
    (entry,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    if damage == "graph gone":
        (entry / "target.onnx").unlink()
    else:
        (entry / "entry.json").write_text('{"role": "target", "spec": {"graph": "../x"}}')
    assert _export(models["llama"], "ngram", tmp_path / "b", cache) == []
    assert GraphCache(cache).get(entry.name, tmp_path, models["llama"]) is not None  # kept again, whole
