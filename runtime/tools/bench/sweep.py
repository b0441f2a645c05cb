"""`bench`: the sweep over one bundle on one backend.

For each prompt and repeat, plain decoding and every draft length run in turn on the same
session (alternating, so drift hits them alike); the runs become the report (report.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from specdeploy.core.errors import InputError

from specdeploy.runtime.tools.bench.inputs import DEFAULT_DRAFT_LENS, DEFAULT_PROMPTS, parse_draft_lens
from specdeploy.runtime.tools.bench.report import config_row, device_name, summarise
from specdeploy.runtime.tools.bench.runs import Run, device_timers, timed_generation


def bench(
    bundle: str | Path,
    backend: str = "ort",
    draft_lens: str | Sequence = DEFAULT_DRAFT_LENS,
    prompts: Sequence[str] | None = None,
    max_new_tokens: int = 64,
    repeats: int = 3,
    chat: bool = True,
    threads: int | None = None,
    warmup: bool = True,
    log: Callable[[str], None] = lambda _: None,
    device: str | None = None,
    trt_ep: bool = False,
) -> dict:
    """Profile `bundle` on `backend` (on `device`, with `trt_ep`: as for Session); returns the
    report (see `format_report`, `plot`)."""
    from specdeploy.runtime.decoding.session import Session

    session = Session(bundle, threads=threads, backend=backend, prompt_cache=False,  # every run prefills its prompt
                      device=device, trt_ep=trt_ep)
    lens = parse_draft_lens(draft_lens, session.bundle.max_draft) if session.drafter is not None else []
    prompts = list(prompts or DEFAULT_PROMPTS)
    if not prompts:
        raise InputError("no prompts to benchmark")
    use_chat = chat and bool(session.bundle.tokenizer.chat_template)
    encoded = [session.encode(p, chat=use_chat) for p in prompts]
    for ids in encoded:
        session.check_request(np.asarray(ids), max_new_tokens, 0)
    timers = device_timers(session)
    if warmup:  # first passes pay for allocation and (on CUDA) graph capture
        for k in [None] + lens:
            timed_generation(session, encoded[0], min(8, max_new_tokens), k or 0, k is not None, timers)
    plain_runs: list[Run] = []
    spec_runs: dict = {k: [] for k in lens}
    ratios: dict = {k: [] for k in lens}
    identical: dict = {k: 0 for k in lens}
    for r in range(repeats):
        for i, ids in enumerate(encoded):
            plain = timed_generation(session, ids, max_new_tokens, 0, False, timers)
            plain_runs.append(plain)
            for k in lens:
                run = timed_generation(session, ids, max_new_tokens, k, True, timers)
                spec_runs[k].append(run)
                ratios[k].append(run.tokens_per_second / plain.tokens_per_second if plain.tokens_per_second else 0.0)
                identical[k] += run.tokens == plain.tokens
            log(f"repeat {r + 1}/{repeats}, prompt {i + 1}/{len(encoded)}: plain {plain.tokens_per_second:.1f} tok/s"
                + "".join(f", k={k} {spec_runs[k][-1].tokens_per_second:.1f}" for k in lens))
    plain_summary = summarise(plain_runs)
    return {
        "bundle": str(bundle),
        "backend": backend,
        "device": device_name(session),
        "placement": str(session.choice),
        "clock": "wall-clock + cuda-events" if timers else "wall-clock",
        "draft": session.bundle.draft.as_dict(),
        "prompts": len(prompts),
        "chat": use_chat,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "plain": plain_summary,
        "configs": [config_row(k, spec_runs[k], plain_summary, ratios[k], identical[k]) for k in lens],
    }
