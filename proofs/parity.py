"""One engine's logits against another's over a schedule of passes: what the ORT-GPU and the
TensorRT proofs both report."""
from __future__ import annotations

import numpy as np


def compare_passes(got_engine, want_engine, ids: np.ndarray, schedule) -> dict:
    """Run `ids[start:start + t]` at `start` on both engines for each (start, t) of `schedule`;
    the worst difference relative to the largest logit, and the rows whose argmax differs."""
    worst, differ, rows = 0.0, 0, 0
    for start, t in schedule:
        got = got_engine.forward(ids[start : start + t], start).copy()
        want = want_engine.forward(ids[start : start + t], start)
        worst = max(worst, float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max())))
        differ += int((got.argmax(-1) != want.argmax(-1)).sum())
        rows += t
    return {"passes": len(schedule), "max_rel_diff": worst, "argmax_differ": differ, "rows": rows}
