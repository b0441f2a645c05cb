"""specdeploy runtime: a lean speculative-decoding loop over exported bundles.

    from specdeploy.runtime import Session
    session = Session("engines/smollm2")
    for piece in session.stream("Write a haiku about the sea.", chat=True):
        print(piece.text, end="", flush=True)

Imports numpy, onnxruntime and tokenizers only; never torch or transformers.
"""
from specdeploy.core.manifest import Bundle, load_bundle
from specdeploy.core.errors import BundleError, ExportError, InputError, SpecdeployError
from specdeploy.runtime.decoding.stats import Stats
from specdeploy.runtime.serving.pool import Overloaded, SessionPool
from specdeploy.runtime.decoding.session import Generation, Piece, Result, Session
from specdeploy.runtime.decoding.batch import BatchSession
from .backends.ort import share_cpu_threads

__all__ = [
    "BatchSession",
    "Bundle",
    "BundleError",
    "ExportError",
    "Generation",
    "InputError",
    "Overloaded",
    "Piece",
    "Result",
    "Session",
    "SessionPool",
    "SpecdeployError",
    "Stats",
    "load_bundle",
    "share_cpu_threads",
]
