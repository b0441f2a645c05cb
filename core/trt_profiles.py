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
    """One optimization profile: token count T in [t_min, t_max], window L in [1, l_max]."""

    name: str
    t_min: int
    t_opt: int
    t_max: int
    l_opt: int
    l_max: int

    def shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """(min, opt, max) of every dynamic input, as IOptimizationProfile.set_shape takes them."""
        ids = ((1, self.t_min), (1, self.t_opt), (1, self.t_max))
        mask = ((1, 1, self.t_min, 1), (1, 1, self.t_opt, self.l_opt), (1, 1, self.t_max, self.l_max))
        return {"input_ids": ids, "position_ids": ids, "attention_mask": mask}

    def as_dict(self) -> dict:
        return {"name": self.name, "T": [self.t_min, self.t_opt, self.t_max], "L": [1, self.l_opt, self.l_max]}

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        (t_min, t_opt, t_max), (_, l_opt, l_max) = d["T"], d["L"]
        return cls(d["name"], t_min, t_opt, t_max, l_opt, l_max)


def profiles_for(max_seq: int, max_draft: int, prefill_chunk: int) -> list[Profile]:
    """Profiles whose T ranges partition 1..max(k+1, chunk): a draft step (T = 1), a verify
    pass (2..k+1) and, when the chunk is longer, a prefill chunk (k+2..chunk).

    >>> [(p.name, p.t_min, p.t_max) for p in profiles_for(1024, 8, 64)]
    [('step', 1, 1), ('verify', 2, 9), ('prefill', 10, 64)]
    """
    l_opt = max(1, max_seq // 2)
    verify = max_draft + 1
    profiles = [Profile("step", 1, 1, 1, l_opt, max_seq), Profile("verify", 2, verify, verify, l_opt, max_seq)]
    if prefill_chunk > verify:
        profiles.append(Profile("prefill", verify + 1, prefill_chunk, prefill_chunk, max(prefill_chunk, l_opt), max_seq))
    return profiles


def select_profile(profiles: list[Profile], t: int) -> int:
    """Index of the profile whose T range holds t, or -1 when none does."""
    for i, p in enumerate(profiles):
        if p.t_min <= t <= p.t_max:
            return i
    return -1
