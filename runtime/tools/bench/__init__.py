"""`specdeploy bench`: a latency profile of one bundle on one backend.

Per draft length the report gives time to first token, inter-token latency (median, p90),
tokens/s, the time split (prefill / draft / verify / host), acceptance per draft position,
the measured speedup over plain decoding (the median of the per-cycle ratios) and beside it
the analytic model's prediction from the measured acceptance and cost ratio (docs/design.md,
"The cost model"; the model itself is specdeploy.core.analytic).

Modules, by job; imports run down this list, never up:
  inputs   prompts (the prompts-file format, shared with `eval`) and draft lengths
  latency  pure arithmetic on timings: percentiles, per-token gaps
  runs     one timed generation (wall clock; device time where an engine offers it)
  report   summaries, measured vs predicted speedup, the report as text and JSON
  sweep    `bench`: plain and every draft length, alternating over prompts and repeats
  plot     the report as a figure (matplotlib, imported only when plotting)
"""
from specdeploy.runtime.tools.bench.inputs import DEFAULT_DRAFT_LENS, DEFAULT_PROMPTS, parse_draft_lens, read_prompts
from specdeploy.runtime.tools.bench.latency import inter_token_gaps, percentile
from specdeploy.runtime.tools.bench.plot import plot
from specdeploy.runtime.tools.bench.report import format_report, write_json
from specdeploy.runtime.tools.bench.runs import DeviceTimed, Run, device_timers, timed_generation
from specdeploy.runtime.tools.bench.sweep import bench

__all__ = [
    "DEFAULT_DRAFT_LENS", "DEFAULT_PROMPTS", "DeviceTimed", "Run", "bench", "device_timers", "format_report",
    "inter_token_gaps", "parse_draft_lens", "percentile", "plot", "read_prompts", "timed_generation", "write_json",
]
