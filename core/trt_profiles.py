"""The TensorRT optimization profiles of a bundle: the part of the engine contract that both
halves must agree on, with numpy only (no TensorRT import).

`specdeploy build` (export/trt_build.py) creates the profiles and records them in the
manifest; the TensorRT backend (runtime/backends/trt.py) reads them back and picks one per
pass. A profile ranges over T, the tokens of a pass: a draft step (T = 1), a verify pass
(2..k+1), a prefill chunk (k+2..chunk).

`ARGMAX` names the extra output the build adds for the fused round: each logits row's argmax
([1, T, 1], the dtype of input_ids), so a draft step's token can be copied into the next
step's input on the device. The manifest records it per engine (`argmax_output`).
"""
from __future__ import annotations

from dataclasses import dataclass

ARGMAX = "next_tokens"


@dataclass(frozen=True)
class Profile:
    """One optimization profile: token count T in [t_min, t_max], window L in [1, l_max], and
    sequences per pass B in [1, b_max] (a graph with a batch dimension; b_max 1: one)."""

    name: str
    t_min: int
    t_opt: int
    t_max: int
    l_opt: int
    l_max: int
    b_max: int = 1

    def shapes(self, batched: dict[str, tuple[int, ...]] | None = None
               ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """(min, opt, max) of every dynamic input, as IOptimizationProfile.set_shape takes them.
        `batched`: the graph's other inputs with a dynamic batch dimension, name -> the dims
        after it (write_indices, the KV buffers: batch_inputs), each over B in [1, b_max]. The
        opt shapes are one sequence's."""
        b = self.b_max
        ids = ((1, self.t_min), (1, self.t_opt), (b, self.t_max))
        mask = ((1, 1, self.t_min, 1), (1, 1, self.t_opt, self.l_opt), (b, 1, self.t_max, self.l_max))
        out = {"input_ids": ids, "position_ids": ids, "attention_mask": mask}
        for name, dims in (batched or {}).items():
            out[name] = ((1, *dims), (1, *dims), (b, *dims))
        return out

    def as_dict(self) -> dict:
        d = {"name": self.name, "T": [self.t_min, self.t_opt, self.t_max], "L": [1, self.l_opt, self.l_max]}
        if self.b_max > 1:
            d["B"] = [1, 1, self.b_max]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        (t_min, t_opt, t_max), (_, l_opt, l_max) = d["T"], d["L"]
        return cls(d["name"], t_min, t_opt, t_max, l_opt, l_max, d.get("B", [1, 1, 1])[2])


STEP_SHAPES = ("input_ids", "position_ids", "attention_mask")  # the inputs whose T (and L) a profile ranges over


def batch_inputs(spec) -> dict[str, tuple[int, ...]]:
    """A graph's inputs with a dynamic batch dimension besides STEP_SHAPES (from its manifest
    entry: write_indices, the KV buffers), name -> the dims after B; {} for a graph of B = 1.

    >>> batch_inputs(type("Spec", (), {"inputs": {"input_ids": ["B", "T"], "write_indices": ["B"],
    ...                                             "past_key_0": ["B", 2, 128, 16], "logits_rows": ["R"]}}))
    {'write_indices': (), 'past_key_0': (2, 128, 16)}
    """
    return {name: tuple(int(d) for d in dims[1:]) for name, dims in spec.inputs.items()
            if dims and dims[0] == "B" and name not in STEP_SHAPES}


def profiles_for(max_seq: int, max_draft: int, prefill_chunk: int, max_batch: int = 1) -> list[Profile]:
    """Profiles whose T ranges partition 1..max(k+1, chunk): a draft step (T = 1), a verify
    pass (2..k+1) and, when the chunk is longer, a prefill chunk (k+2..chunk).

    >>> [(p.name, p.t_min, p.t_max) for p in profiles_for(1024, 8, 64)]
    [('step', 1, 1), ('verify', 2, 9), ('prefill', 10, 64)]
    """
    l_opt = max(1, max_seq // 2)
    verify = max_draft + 1
    b = max_batch
    profiles = [Profile("step", 1, 1, 1, l_opt, max_seq, b), Profile("verify", 2, verify, verify, l_opt, max_seq, b)]
    if prefill_chunk > verify:
        profiles.append(Profile("prefill", verify + 1, prefill_chunk, prefill_chunk, max(prefill_chunk, l_opt), max_seq, b))
    return profiles


def select_profile(profiles: list[Profile], t: int) -> int:
    """Index of the profile whose T range holds t, or -1 when none does."""
    for i, p in enumerate(profiles):
        if p.t_min <= t <= p.t_max:
            return i
    return -1
