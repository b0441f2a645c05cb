"""The TensorRT backend's bookkeeping, with no TensorRT and no GPU: testable anywhere.

- `plan_layout`: one device pool, every tensor at a 256-byte aligned offset; `step_slot`:
  where the host staging of one single step of a draft chain lands in it.
- (the optimization profiles over T that the build creates and the runtime picks from, and
  the argmax output's name: `specdeploy.core.trt_profiles`, the bundle contract's side.)
- (the attention window L rounded up to a power-of-two bucket, so a captured CUDA graph
  serves many write positions, and its mask: `specdeploy.core.graph_io`.)
- `StepGraphs`: one CUDA graph per distinct pass shape, captured after a warm-up run and
  replayed, falling back to plain enqueue when capture fails; driven through `Driver`,
  a handful of stream operations, so a fake stream can test it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from specdeploy.core.trt_profiles import ARGMAX

# TensorRT: "The pointer must have at least 256-byte alignment" (IExecutionContext::
# setTensorAddress, include/NvInferRuntime.h of TensorRT 10.15 and 11.1). cudaMalloc returns
# addresses aligned to at least 256 bytes (CUDA C++ Programming Guide, device memory accesses),
# so offsets that are multiples of 256 inside one cudaMalloc'd pool keep every view aligned.
ALIGNMENT = 256


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """Round n up to a multiple of `alignment`.

    >>> align_up(1), align_up(256), align_up(257)
    (256, 256, 512)
    """
    return -(-n // alignment) * alignment


@dataclass(frozen=True)
class Layout:
    """Named byte ranges inside one pool: name -> (offset, nbytes), offsets aligned."""

    slots: dict[str, tuple[int, int]]
    total: int
    alignment: int = ALIGNMENT

    def offset(self, name: str) -> int:
        return self.slots[name][0]

    def nbytes(self, name: str) -> int:
        return self.slots[name][1]

    def end(self, name: str) -> int:
        offset, nbytes = self.slots[name]
        return offset + nbytes


def plan_layout(items: list[tuple[str, int]], alignment: int = ALIGNMENT) -> Layout:
    """Place the named byte sizes one after another, each at an aligned offset.

    >>> plan_layout([("a", 10), ("b", 300), ("c", 1)]).slots
    {'a': (0, 10), 'b': (256, 300), 'c': (768, 1)}
    """
    slots, offset = {}, 0
    for name, nbytes in items:
        if name in slots:
            raise ValueError(f"{name}: placed twice")
        slots[name] = (offset, nbytes)
        offset = align_up(offset + nbytes, alignment)
    return Layout(slots, offset, alignment)


# The small inputs first and the mask last: one host->device copy of [0, mask offset + T*L)
# carries every input of a pass, whatever T and L.
STAGED_INPUTS = ("input_ids", "position_ids", "write_indices", "attention_mask")

def engine_layout(
    t_max: int, max_seq: int, vocab_size: int, kv_names: list[str], kv_nbytes: int | list[int],
    itemsize: dict[str, int], max_chain: int = 0,
) -> Layout:
    """The pool of one engine: staged inputs, then (an engine with the ARGMAX output, max_chain
    > 0) the argmax rows and `chain`, the up to max_chain tokens of a draft chain, then the
    logits and the KV buffers (one per layer and kind, each bound as both the aliased input and
    output; `kv_nbytes` each one's bytes, or one figure for all). Everything before the logits is
    small, and mirrored in pinned host memory."""
    kv_sizes = kv_nbytes if isinstance(kv_nbytes, list) else [kv_nbytes] * len(kv_names)
    sizes = {
        "input_ids": t_max * itemsize["input_ids"],
        "position_ids": t_max * itemsize["position_ids"],
        "write_indices": itemsize["write_indices"],
        "attention_mask": t_max * max_seq * itemsize["attention_mask"],
        ARGMAX: t_max * itemsize["input_ids"],
        "chain": max_chain * itemsize["input_ids"],
        "logits": t_max * vocab_size * itemsize["logits"],
    }
    small = [*STAGED_INPUTS, ARGMAX, "chain"] if max_chain else list(STAGED_INPUTS)
    return plan_layout([(n, sizes[n]) for n in small] + [("logits", sizes["logits"])]
                       + list(zip(kv_names, kv_sizes)))


def step_slot(layout: Layout, max_seq: int, mask_itemsize: int) -> tuple[int, int]:
    """(pool offset, aligned size) of the host staging of one single step (T = 1) of a draft
    chain: the pool's bytes from position_ids to the end of a one-row mask of max_seq slots.
    The step's token is not in it: the previous step's argmax is copied into input_ids on the
    device. Each step of a chain stages into a slot of its own (see TrtEngine.draft_chain).

    >>> step_slot(plan_layout([("input_ids", 8), ("position_ids", 8), ("write_indices", 8),
    ...                        ("attention_mask", 4 * 128)]), 100, 4)
    (256, 1024)
    """
    first = layout.offset("position_ids")
    return first, align_up(layout.offset("attention_mask") - first + max_seq * mask_itemsize)


# -- CUDA graphs, one per pass shape -----------------------------------------------------------------


class ShapeKey(NamedTuple):
    profile: int
    t: int
    length: int


class CaptureError(RuntimeError):
    """A CUDA graph could not be captured. The pass itself already ran: only replay is lost."""


class EnqueueError(RuntimeError):
    """TensorRT refused to enqueue a pass (execute_async_v3 returned False)."""


class Driver(Protocol):
    """The stream operations `StepGraphs` needs; the TensorRT engine implements them over
    cuda-python, tests over a fake stream."""

    is_default_stream: bool

    def run_eager(self, key: ShapeKey) -> None:
        """Set the pass shapes on the profile's shared context and enqueue it."""

    def new_executor(self, key: ShapeKey) -> object:
        """An execution context of its own for `key`: profile, addresses and shapes set once."""

    def run(self, executor: object) -> None:
        """Enqueue one pass on `executor` (raises EnqueueError)."""

    def begin_capture(self) -> None: ...

    def end_capture(self) -> object:
        """End the capture and instantiate the graph (raises CaptureError when invalidated)."""

    def abort_capture(self) -> None:
        """End a capture whose enqueue failed, leaving the stream usable."""

    def launch(self, graph: object) -> None: ...

    def release(self, executor: object, graph: object | None = None) -> None: ...


@dataclass
class StepGraphs:
    """One CUDA graph per distinct pass shape (profile, T, L bucket), each with its own
    execution context, captured the first time the shape runs and replayed after. With T up to
    k+1 and power-of-two windows the shapes number at most (k+1) * log2(max_seq / min bucket + 1):
    45 for k = 8 over 64..1024; `max_graphs` bounds the contexts (and their TensorRT memory).

    The first pass of a shape runs eagerly on its new context: that is the pass's result and
    the warm-up TensorRT asks for ("call enqueueV3() once after an input shape change to update
    internal state", TensorRT best practices, CUDA Graphs); the capture follows on the same
    non-default stream. A context is never reshaped after its capture, so state TensorRT keeps
    per context can never go stale under a graph. Capture failure (e.g. cudaErrorStreamCapture*
    from an engine that cannot be captured) leaves that shape on plain enqueue, recorded in
    `status`; the context stays usable without the graph.
    """

    enabled: bool = True
    max_t: int | None = None  # longer passes (prefill chunks) run eagerly
    max_graphs: int = 64
    status: dict[ShapeKey, str] = field(default_factory=dict)  # "graph" or "eager: <why>"
    counts: dict[str, int] = field(
        default_factory=lambda: {"captured": 0, "replayed": 0, "eager": 0, "capture_failed": 0}
    )
    _graphs: dict[ShapeKey, tuple[object, object]] = field(default_factory=dict)

    def run(self, key: ShapeKey, driver: Driver) -> str:
        """Run one pass of shape `key`; returns "replay", "captured" or "eager"."""
        held = self._graphs.get(key)
        if held is not None:
            driver.launch(held[1])
            self.counts["replayed"] += 1
            return "replay"
        reason = self._eager_reason(key, driver)
        if reason is not None:
            self.status.setdefault(key, f"eager: {reason}")
            driver.run_eager(key)
            self.counts["eager"] += 1
            return "eager"
        executor = driver.new_executor(key)
        try:
            driver.run(executor)  # this pass's result, and the warm-up before capture
        except BaseException:
            driver.release(executor)
            raise
        try:
            graph = self._capture(executor, driver)
        except CaptureError as e:
            driver.release(executor)
            self.status[key] = f"eager: capture failed ({e})"
            self.counts["capture_failed"] += 1
            return "eager"
        self._graphs[key] = (executor, graph)
        self.status[key] = "graph"
        self.counts["captured"] += 1
        return "captured"

    @staticmethod
    def _capture(executor: object, driver: Driver) -> object:
        driver.begin_capture()
        try:
            driver.run(executor)  # recorded, not executed
        except EnqueueError as e:
            driver.abort_capture()
            raise CaptureError(f"enqueue under capture failed: {e}") from None
        except BaseException:
            driver.abort_capture()
            raise
        return driver.end_capture()

    def _eager_reason(self, key: ShapeKey, driver: Driver) -> str | None:
        if key in self.status:
            return self.status[key].removeprefix("eager: ")
        if not self.enabled:
            return "CUDA graphs off"
        if driver.is_default_stream:
            return "the default stream cannot be captured"
        if self.max_t is not None and key.t > self.max_t:
            return f"T={key.t} is above the capture limit {self.max_t}"
        if len(self._graphs) >= self.max_graphs:
            return f"graph cache full ({self.max_graphs} graphs)"
        return None

    def close(self, driver: Driver) -> None:
        for executor, graph in self._graphs.values():
            driver.release(executor, graph)
        self._graphs.clear()

    def stats(self) -> dict:
        return {
            **self.counts,
            "graphs": len(self._graphs),
            "status": {f"{k.profile}/T={k.t}/L={k.length}": v for k, v in sorted(self.status.items())},
        }
