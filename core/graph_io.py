"""The graph contract (docs/design.md, "The graph contract"): tensor names, the attention mask, the window.

One graph per model takes `input_ids [1, T]`, `position_ids [1, T]`, `write_indices [1]`
(data, never a shape), `attention_mask [1, 1, T, L]`, per layer `past_key_i`,
`past_value_i` `[1, Hkv, S_max, D]` bound in and out (written in place) and, from format
version 2 on, `logits_rows [R]` (the rows whose logits the pass returns), and returns
`logits [1, R, V]` (format 1: `[1, T, V]`) and the `present_*` aliases of the buffers. L,
the mask's last dimension, is how much of the buffer attention reads: the live slots, or a
power-of-two bucket of them on engines that capture a graph per shape.
"""
from __future__ import annotations

import numpy as np

from .errors import InputError

STEP_INPUTS = ("input_ids", "position_ids", "write_indices", "attention_mask")


def kv_names(num_layers: int) -> list[tuple[str, str]]:
    """(input, output) names of the KV buffers, in layer order: key then value.

    >>> kv_names(1)
    [('past_key_0', 'present_key_0'), ('past_value_0', 'present_value_0')]
    """
    return [(f"past_{kind}_{i}", f"present_{kind}_{i}") for i in range(num_layers) for kind in ("key", "value")]


LOGITS_ROWS = "logits_rows"

# A graph states the manifest fields that change how the runtime drives it, in the ONNX model's
# metadata under this key (JSON), so that a manifest that contradicts its graph (an exact graph
# said to be fused, a window the graph does not have) is refused when the graph loads.
GRAPH_FACTS = "specdeploy.graph"


def graph_facts(spec) -> dict:
    """The facts of a ModelSpec that its graph must agree with."""
    return {"attention": spec.attention, "dtype": spec.dtype, "sliding_window": spec.sliding_window}


# Hidden states an EAGLE-3 draft reads (docs/drafters.md, "EAGLE-3 heads"), each [1, rows, width]
# float32 after the contract's own tensors: a target exported for such a draft returns the
# states of its chosen layers for every row of a pass (AUX_HIDDEN, the layers side by side);
# the head takes them (AUX_HIDDEN) or its own last state (DRAFT_HIDDEN) and returns its new
# state for the rows whose logits it returns (DRAFT_HIDDEN_OUT).
AUX_HIDDEN = "aux_hidden_states"
DRAFT_HIDDEN = "draft_hidden"
DRAFT_HIDDEN_OUT = "draft_hidden_out"
FEATURE_INPUTS = (AUX_HIDDEN, DRAFT_HIDDEN)
# A Gemma 4 assistant (export/assistant.py): the target's last hidden state it takes (the target's
# AUX_HIDDEN, exported with aux_layers = [its layer count]), and its own state projected back
ASSISTANT_HIDDEN = "target_hidden"
ASSISTANT_STATE = "assistant_state"
FEATURE_OUTPUTS = (AUX_HIDDEN, DRAFT_HIDDEN_OUT)


def state_names(num_layers: int) -> list[tuple[str, str]]:
    """(input, output) names of the recurrent states of a model's linear-attention layers, in
    layer order: the convolution's, then the recurrence's. The input is the state before the
    pass [B, ...]; the output the states after each row the pass returns logits for [B, R, ...].

    >>> state_names(1)
    [('conv_state_0', 'conv_states_0'), ('recurrent_state_0', 'recurrent_states_0')]
    """
    return [(f"{kind}_state_{i}", f"{kind}_states_{i}") for i in range(num_layers) for kind in ("conv", "recurrent")]


def io_names(num_layers: int, logits_rows: bool = True, inputs: tuple[str, ...] = (),
             outputs: tuple[str, ...] = (), state_layers: int = 0) -> tuple[list[str], list[str]]:
    """The graph's input and output names, in order (`logits_rows`: a graph that takes the
    rows whose logits it returns, as every ONNX graph from format version 2 on; `inputs`,
    `outputs`: the hidden states of FEATURE_INPUTS / FEATURE_OUTPUTS it takes and returns;
    `state_layers`: its linear-attention layers, whose states it takes and returns).

    >>> io_names(1, outputs=(AUX_HIDDEN,))[1]
    ['logits', 'present_key_0', 'present_value_0', 'aux_hidden_states']
    """
    kv = kv_names(num_layers)
    rows = [LOGITS_ROWS] if logits_rows else []
    states = state_names(state_layers)
    return (list(STEP_INPUTS) + [p for p, _ in kv] + rows + list(inputs) + [i for i, _ in states],
            ["logits"] + [p for _, p in kv] + [o for _, o in states] + list(outputs))


def window_length(start: int, t: int, min_window: int | None = None, max_seq: int | None = None) -> int:
    """The attention window L for a pass of T tokens written at `start`: the live slots
    start + T, or with `min_window` that rounded up to a power of two (at least min_window,
    at most max_seq). A captured graph fixes its shapes; with L bucketed, one graph per
    (T, bucket) serves every write position in the bucket, and a handful of buckets cover
    the whole buffer (5 for 64..1024). Attention then reads at most twice the live slots;
    the extra slots are masked (-inf) and zero-filled at allocation, so they add exact zeros.

    >>> [window_length(s, 1, 64, 1024) for s in (0, 63, 64, 300, 1020)]
    [64, 64, 128, 512, 1024]
    >>> window_length(300, 1)
    301
    """
    length = start + t
    if min_window is None:
        return length
    return min(max_seq, max(min_window, 1 << (length - 1).bit_length()))


def fill_mask(out: np.ndarray, start: int, sliding_window: int | None = None) -> np.ndarray:
    """Write the additive mask [T, L] for a pass at `start` into `out`, in place: row i sees
    slots 0..start+i (within the sliding window); every other slot, padding included, is -inf.
    Positions past the write position are masked, so rollback is moving the length back.

    >>> fill_mask(np.empty((2, 4), np.float32), 1)
    array([[  0.,   0., -inf, -inf],
           [  0.,   0.,   0., -inf]], dtype=float32)
    """
    out.fill(-np.inf)
    for i in range(out.shape[0]):
        last = start + i
        first = 0 if sliding_window is None else max(0, last - sliding_window + 1)
        out[i, first : last + 1] = 0
    return out


def fill_tree_mask(out: np.ndarray, start: int, visible: np.ndarray) -> np.ndarray:
    """Write the additive mask [T, L] of a tree pass at `start` into `out`, in place: every row
    sees slots 0..start-1 and, of the pass's own slots start..start+T-1, those `visible` [T, T]
    marks (its ancestors and itself); every other slot is -inf.

    >>> fill_tree_mask(np.empty((3, 4), np.float32), 1, np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool))
    array([[  0.,   0., -inf, -inf],
           [  0.,   0.,   0., -inf],
           [  0.,   0., -inf,   0.]], dtype=float32)
    """
    t = out.shape[0]
    out.fill(-np.inf)
    out[:, :start] = 0
    out[:, start : start + t][visible] = 0
    return out


def attention_mask(start: int, t: int, sliding_window: int | None = None, window: int | None = None) -> np.ndarray:
    """Additive mask [1, 1, T, L] with L = `window` (default start + T): row i sees slots
    0..start+i.

    >>> attention_mask(2, 2)[0, 0]
    array([[  0.,   0.,   0., -inf],
           [  0.,   0.,   0.,   0.]], dtype=float32)
    """
    length = start + t if window is None else window
    return fill_mask(np.empty((t, length), dtype=np.float32), start, sliding_window)[None, None]


def check_pass(name: str, token_ids: np.ndarray, start: int, max_seq: int, vocab_size: int) -> None:
    """Validate one pass at the engine boundary; errors name the tensor and the allowed range."""
    t = token_ids.shape[0] if token_ids.ndim else 0
    if token_ids.ndim != 1 or t < 1:
        raise InputError(f"{name}: input_ids must be a non-empty 1-D array of token ids, got shape {token_ids.shape}")
    if start < 0 or start + t > max_seq:
        raise InputError(
            f"{name}: positions {start}..{start + t - 1} are outside the KV buffer [0, {max_seq}) (max sequence {max_seq})"
        )
    if t == 1:  # a single step, the common pass: no array temporaries
        if 0 <= int(token_ids[0]) < vocab_size:
            return
    elif int(token_ids.min()) >= 0 and int(token_ids.max()) < vocab_size:
        return
    bad = np.flatnonzero((token_ids < 0) | (token_ids >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise InputError(
            f"{name}: token id {int(token_ids[i])} at input position {i} is outside the vocabulary [0, {vocab_size})"
        )


def bypass_nodes(graph, nodes, rename: dict[str, str]) -> None:
    """Remove `nodes` from an ONNX `graph`; whatever read a name in `rename` reads its replacement."""
    for node in nodes:
        graph.node.remove(node)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
