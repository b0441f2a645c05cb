"""specdeploy.core: what both halves share, with no heavy dependency (numpy only).

- `manifest`: the bundle contract as typed records; export writes it, the runtime reads it.
- `graph_io`: the graph contract's names, masks and attention windows.
- `analytic`: the speculative-decoding cost model (Leviathan et al.).
- `trt_profiles`: the TensorRT optimization profiles over T (built by export, picked by the runtime).
- `chat_template`: a bundle's chat template, rendered in a worker process under time and memory limits.
- `choices`: the enumerations both halves and the CLI share (dtypes, quant schemes, backends).
- `errors`: the errors a user can cause.

Imports go one way: core <- export, core <- runtime, and the command line above both.
"""
