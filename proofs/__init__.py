"""Proofs for hardware this project's CI does not have: the GPU check of the torch backend, the
onnxruntime-gpu check, the TensorRT check. Each is a script (`python -m proofs.NAME --help`),
rehearsed on the CPU by the tests. Not installed: they run from a checkout."""
