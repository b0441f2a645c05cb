"""GGUF files as llama.cpp's quantizer writes them (tests/fixtures/gguf, made by make.py there):
every block-quantized tensor imported as it is, whatever its type, and a bundle of them lossless.

The decoders themselves are checked bit for bit against gguf-py on random blocks of every type
(test_quant.py); here the files are real: mixed K-quant files with llama.cpp's fallback types."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from specdeploy.export import build_bundle
from specdeploy.export.gguf_blocks import GGUF_TYPES, GgufWeights
from specdeploy.export.load import load_source
from specdeploy.export.quantize import quantize_model
from specdeploy.runtime import Session
from tiny import PROMPTS

FIXTURES = Path(__file__).parent / "fixtures" / "gguf"
FILES = sorted(FIXTURES.glob("*.gguf"))
QUANTIZED = [f for f in FILES if "f16" not in f.name]


def _types(path: Path) -> set[str]:
    """The types of a file's matrices (its 1-D norms stay F32)."""
    import gguf

    return {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) > 1}


def test_the_fixtures_hold_every_type_common_files_do():
    held = set().union(*(_types(f) for f in FILES))
    # Q4_1: the embedded default's own file (test_smollm2.py); F16: a tensor with no blocks
    assert held == (set(GGUF_TYPES) - {"Q4_1"}) | {"F16"}


@pytest.mark.parametrize("path", QUANTIZED, ids=lambda p: p.stem)
def test_every_block_quantized_tensor_is_imported_exactly(path):
    """Each matrix's blocks dequantize bit for bit to the float weight transformers read from
    the same file (checked on import), so none is quantized a second time, at either --dtype."""
    source = load_source(path)
    for dtype in ("int4", "int8"):
        record = quantize_model(copy.deepcopy(source.model), dtype, path)
        assert record["quantized_from_float"] == 0 and record["not_exact"] == [], record
        origins = {kind for key in record["tensors"] for kind in key.split("->")[0].split("+")}
        assert origins == _types(path)


def test_blocks_that_do_not_give_the_weight_are_not_taken():
    """Companion: the import's comparison refuses blocks one ulp off the weight, saying why."""
    path = FIXTURES / "llama-Q4_K_M.gguf"
    weights = GgufWeights(path)
    down = load_source(path).model.model.layers[0].mlp.down_proj.weight.detach().numpy()
    blocks, why = weights.blocks("blk.0.ffn_down.weight", down, None)
    assert blocks is not None and why == ""
    off = down.copy()
    off[3, 5] = np.nextafter(off[3, 5], np.float32(np.inf))
    blocks, why = weights.blocks("blk.0.ffn_down.weight", off, None)
    assert blocks is None and "do not dequantize" in why


@pytest.mark.bundle
@pytest.mark.parametrize("name", ["llama-Q4_K_M", "qwen3-Q4_K_M", "llama-Q2_K", "llama-IQ4_XS"])
def test_k_quant_bundles_speculate_losslessly_near_the_files_own_floats(name, tmp_path):
    """An int4 bundle of a mixed file (target and its self-draft, every block imported): speculative
    == plain token for token at draft lengths 1, 3 and 8, and its logits near the file's dequantized
    float model (what transformers computes from it): only MatMulNBits' int8 activation rounding
    differs, well inside the bound for weights rounded a second time (test_quant.py: 0.35)."""
    path = FIXTURES / f"{name}.gguf"
    out = tmp_path / "b"
    build_bundle(path, "self:layers=1", out, max_seq=128, max_draft=8, prefill_chunk=16, dtype="int4")
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["models"].values():
        assert entry["quantization"]["quantized_from_float"] == 0
    session = Session(out)
    session.eos_token_ids = []  # every requested token comes back
    for prompt in (PROMPTS[0], PROMPTS[1], PROMPTS[16], PROMPTS[13]):
        ids = session.encode(prompt)
        plain = session.generate(prompt_ids=ids, max_new_tokens=24, speculate=False)
        assert len(plain.token_ids) == 24
        for k in (1, 3, 8):
            spec = session.generate(prompt_ids=ids, max_new_tokens=24, draft_len=k)
            assert spec.token_ids == plain.token_ids, (prompt, k)
    from specdeploy.runtime.backends import make_engine

    ids = np.array(session.encode(" ".join(PROMPTS[:6])))[:60]
    engine = make_engine("ort", session.bundle, session.bundle.model("target"), None)
    got = np.concatenate([engine.forward(ids[a : a + 16], a).copy() for a in range(0, len(ids), 16)])
    with torch.no_grad():
        want = load_source(path).model(torch.from_numpy(ids)[None]).logits[0].numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 0.1


@pytest.mark.bundle
def test_a_tensor_without_blocks_is_quantized_here_and_said_on_the_terminal(tmp_path):
    """llama-quantize --token-embedding-type f16: the tied head has no blocks to import; export says
    so on the terminal, naming the tensor, and the manifest records it."""
    lines: list[str] = []
    build_bundle(FIXTURES / "llama-Q4_K_M-f16-embedding.gguf", "none", tmp_path / "b", max_seq=64, dtype="int4",
                 log=lines.append)
    said = [line for line in lines if "not imported exactly" in line]
    assert said == ["  target: not imported exactly: token_embd.weight (F16 in the file), quantized here from its "
                    "floats as int8"]
    q = json.loads((tmp_path / "b" / "manifest.json").read_text())["models"]["target"]["quantization"]
    assert q["not_exact"] == [{"tensor": "token_embd.weight", "why": "F16 in the file", "as": "float->int8"}]
    assert q["quantized_from_float"] == 1 and q["imported_exactly"] == 21
