"""The enumerations both halves, the CLI and the servers share, each defined once here (the CLI
reads them without importing torch or a backend)."""

DTYPES = ("fp32", "fp16", "bf16", "int8", "int4")  # a graph's weights (ModelSpec.dtype)
FLOAT_DTYPES = ("fp32", "fp16", "bf16")  # float weights, standard ONNX ops only: TensorRT parses them, trees verify on them
KV_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "float32", "int4": "float32"}  # each dtype's KV buffers
# export --kv-dtype: a target whose activations are float32 (fp32, int8, int4) may keep its KV
# buffers in float16, half the bytes a long context reads and holds (written rounded, read back
# exactly, so verify rows still equal single steps bit for bit).
KV_CHOICES = {"fp32": "float32", "fp16": "float16"}
# bf16 graphs run where there are bfloat16 kernels and buffers: the torch backend (CPU or GPU).
# ONNX Runtime's CPU provider has no bfloat16 kernels, and its Python bindings and the trt
# backend's host staging are numpy, which has no bfloat16: they refuse bf16 bundles in one line.
NUMPY_DTYPES = ("fp32", "fp16", "int8", "int4")
QUANT_SCHEMES = ("exact", "fast")  # how int8/int4 weights are made (export/quantize.py's plans)
BACKENDS = ("ort", "torch", "trt")  # the runtime's engines (runtime/backends' registry has one entry each)
GPU_BACKENDS = ("torch", "trt")  # run on a GPU only where they are given one (ort picks its provider)
# Where a bundle will run (export --for): the defaults and the graph forms export picks for it.
#   cpu       ONNX Runtime's CPU provider: int4 weights (MatMulNBits, its fused ops where they pay)
#   cuda      ONNX Runtime's CUDA provider or the torch backend: fp16
#   tensorrt  TensorRT: fp16; standard ONNX ops only (int8/int4 as DequantizeLinear + MatMul), checked by check-trt
DEVICES = ("cpu", "cuda", "tensorrt")
DEVICE_DTYPE = {"cpu": "int4", "cuda": "fp16", "tensorrt": "fp16"}  # --dtype's default per --for
