"""One timed generation: the wall clock of each streamed round, and device time from the
engines that can measure it.

Clocks: the loop's own wall clock (every engine pass ends in its one host sync, so a
pass's wall time includes its device time); engines that can time themselves on the
device (`DeviceTimed`: the torch backend on CUDA, with CUDA events) add `device` seconds
per role.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from specdeploy.runtime.decoding.engine import Engine

from specdeploy.runtime.tools.bench.latency import inter_token_gaps


@runtime_checkable
class DeviceTimed(Protocol):
    """An engine that can time its own passes on its device, beyond the `Engine` contract
    (the torch backend: CUDA events around each pass). Optional: engines without it are
    timed by the wall clock alone."""

    device: Any
    time_device: bool  # off by default (events cost a little); on, each pass adds to the next
    stats: Any  # .device_seconds: device time of the passes timed so far


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    ttft: float
    gaps: list[float]
    rounds: list[tuple[int, int]]  # (proposed, accepted) per round
    stats: object  # the loop's Stats
    device: dict[str, float] = field(default_factory=dict)  # role -> device seconds (CUDA events)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else 0.0


def session_engines(session) -> dict[str, Engine]:
    """The session's engines by role: the target's, and the drafter's if it runs a model."""
    engines = {"target": session.target}
    if session.drafter is not None and session.drafter.engine is not None:
        engines["draft"] = session.drafter.engine
    return engines


def device_timers(session) -> dict[str, DeviceTimed]:
    """The session's engines that can time their passes on a CUDA device, by role, with
    their device timing turned on. Checked once per benchmark; pass the result to
    `timed_generation`."""
    timers = {}
    for role, engine in session_engines(session).items():
        # The torch engine offers timing on a CPU too, where it has no events to time with.
        if isinstance(engine, DeviceTimed) and str(engine.device).startswith("cuda"):
            engine.time_device = True
            timers[role] = engine
    return timers


def timed_generation(
    session, prompt_ids: list[int], max_new_tokens: int, draft_len, speculate: bool,
    timers: dict[str, DeviceTimed] | None = None,
) -> Run:
    """One generation through `Session.stream`, timing each round's piece as it arrives;
    `timers` (from `device_timers`) add each role's device seconds."""
    timers = timers or {}
    device0 = {role: e.stats.device_seconds for role, e in timers.items()}
    gen = session.stream(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, draft_len=draft_len, speculate=speculate)
    arrivals, rounds, tokens = [], [], []
    start = time.perf_counter()
    for piece in gen:
        now = time.perf_counter()
        if piece.token_ids:  # one piece per round (a final text flush carries none)
            arrivals.append((now, len(piece.token_ids)))
            rounds.append((gen.stats.last_proposed, gen.stats.last_accepted))
            tokens += piece.token_ids
    seconds = time.perf_counter() - start
    ttft, gaps = inter_token_gaps(start, arrivals)
    device = {role: e.stats.device_seconds - device0[role] for role, e in timers.items()}
    return Run(tokens, seconds, ttft, gaps, rounds, gen.stats, device)
