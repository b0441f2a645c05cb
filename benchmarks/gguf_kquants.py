"""Make K-quant GGUF files of a model with llama.cpp's own quantizer, as users download them.

    pip install llama-cpp-python==0.3.36      # llama.cpp's quantizer (it compiles llama.cpp)
    python benchmarks/gguf_kquants.py OUT_DIR [--source FILE.gguf] [--mixes Q4_K_M Q5_K_M]

SOURCE defaults to the embedded SmolLM2-135M-Instruct Q4_1 file; llama.cpp dequantizes its
blocks and quantizes them again to each mix (llama_model_quantize with allow_requantize), the
way such files are made from a float checkpoint. Writes OUT_DIR/<source stem>.<MIX>.gguf.
SmolLM2's 576-wide rows are not a multiple of 256, so llama.cpp falls back from Q4_K/Q5_K/Q6_K
to Q5_0/Q5_1/Q8_0 for them, as it does for the published files of this model.
"""
from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

from specdeploy.export.load import embedded_default


def quantize(source: Path, out: Path, mix: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix}")
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize {mix} failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--source", type=Path, default=None, help="default: the embedded default's Q4_1 file")
    ap.add_argument("--mixes", nargs="+", default=["Q4_K_M", "Q5_K_M"])
    args = ap.parse_args()
    source = args.source or embedded_default()
    args.out.mkdir(parents=True, exist_ok=True)
    for mix in args.mixes:
        out = args.out / f"{source.stem.split('.')[0]}.{mix}.gguf"
        quantize(source, out, mix)
        print(out)


if __name__ == "__main__":
    main()
