"""Write a GGUF's weights dequantized to F32 into a new GGUF, metadata unchanged but the file type.

    python benchmarks/gguf_f32.py [SOURCE.gguf] OUT.gguf

SOURCE defaults to the embedded SmolLM2-135M-Instruct Q4_1 file. The F32 file holds the very
values our fp32 export computes with (both dequantize the same blocks the same way), so
llama.cpp plain decoding of it and our fp32 target decode the same weights at the same
precision: what benchmarks/llamacpp.py --gguf compares.
"""
from __future__ import annotations

import argparse

import gguf
import numpy as np

from specdeploy.export.load import embedded_default


def convert(source: str, out: str) -> int:
    """Dequantize every tensor of `source` into `out`; returns the tensors written."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(reader.tensors)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+", help="[SOURCE.gguf] OUT.gguf")
    args = ap.parse_args()
    if len(args.paths) > 2:
        ap.error("expected [SOURCE.gguf] OUT.gguf")
    source = args.paths[0] if len(args.paths) == 2 else str(embedded_default())
    print(f"{convert(source, args.paths[-1])} tensors written to {args.paths[-1]}")


if __name__ == "__main__":
    main()
