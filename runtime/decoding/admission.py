"""What a request waiting for a place hears: the one set of admission outcomes that the session
pool (runtime/serving/pool.py) and the batch (runtime/decoding/batch.py) raise, and how often a
waiting request looks at its cancel event. The server and the Triton model map them to 503s
and cancellations once, whichever runs the requests."""
from __future__ import annotations

from specdeploy.core.errors import SpecdeployError

POLL_SECONDS = 0.05  # how often a waiting request looks at its cancel event


class Overloaded(SpecdeployError):
    """Every place is taken and the wait queue is full."""


class QueueTimeout(Overloaded):
    """No place came free within the wait allowed."""


class Cancelled(SpecdeployError):
    """The request was cancelled (its client left, or the server shut down) while it waited."""


__all__ = ["Cancelled", "Overloaded", "POLL_SECONDS", "QueueTimeout"]
