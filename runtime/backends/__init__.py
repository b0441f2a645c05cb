"""Engine backends. A backend runs one graph of the bundle over KV buffers it owns.

The protocol is small (see `Engine`): `forward(token_ids, start)` writes the K/V of
`token_ids` at positions `start..start+T-1` and returns logits for every position.
Rollback needs no method: slots at and past the caller's length are never read.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class Engine(Protocol):
    max_seq: int
    vocab_size: int
    runs: int  # passes begun, counted before each one runs: the prompt cache and a model
    # drafter trust what the KV buffers hold only while this is unchanged since they wrote it

    def forward(self, token_ids: np.ndarray, start: int) -> np.ndarray:
        """token_ids [T] int64 at positions start..start+T-1 -> logits [T, V] float32."""
        ...


BACKENDS = ("ort", "torch", "trt")


def make_engine(backend: str, bundle, spec, threads: int | None = None) -> Engine:
    """One engine for one graph of `bundle`. Backends import lazily: choosing `ort` never
    imports torch, and the others' heavy imports happen only when chosen."""
    from ..errors import InputError

    if backend == "ort":
        from .ort import OrtEngine

        return OrtEngine(bundle.file(spec.graph), spec, bundle.max_seq, threads)
    if backend == "torch":  # imports torch and the export stage: the source model is rebuilt
        try:
            from .torch_engine import TorchEngine
        except ImportError as e:
            raise InputError(f"backend 'torch' needs PyTorch ({e}): pip install 'specdeploy[export]'") from None
        return TorchEngine.from_bundle(bundle, spec, threads=threads)
    if backend == "trt":  # importing the module does not import tensorrt; building an engine does
        from .trt import TrtEngine

        return TrtEngine.from_bundle(bundle, spec)
    raise InputError(f"backend {backend!r} is not available (choose from {', '.join(BACKENDS)})")


def attention_mask(start: int, t: int, sliding_window: int | None = None) -> np.ndarray:
    """Additive mask [1, 1, T, L] with L = start + T: row i sees slots 0..start+i.

    >>> attention_mask(2, 2)[0, 0]
    array([[  0.,   0.,   0., -inf],
           [  0.,   0.,   0.,   0.]], dtype=float32)
    """
    length = start + t
    rows = np.arange(start, length)[:, None]
    cols = np.arange(length)[None, :]
    visible = cols <= rows
    if sliding_window is not None:
        visible &= cols > rows - sliding_window
    return np.where(visible, np.float32(0), np.float32(-np.inf))[None, None]


def check_pass(name: str, token_ids: np.ndarray, start: int, max_seq: int, vocab_size: int) -> None:
    """Validate one pass at the engine boundary; errors name the tensor and the allowed range."""
    from ..errors import InputError

    t = token_ids.shape[0]
    if token_ids.ndim != 1 or t < 1:
        raise InputError(f"{name}: input_ids must be a non-empty 1-D array of token ids, got shape {token_ids.shape}")
    if start < 0 or start + t > max_seq:
        raise InputError(
            f"{name}: positions {start}..{start + t - 1} are outside the KV buffer [0, {max_seq}) (max sequence {max_seq})"
        )
    bad = np.flatnonzero((token_ids < 0) | (token_ids >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise InputError(
            f"{name}: token id {int(token_ids[i])} at input position {i} is outside the vocabulary [0, {vocab_size})"
        )
