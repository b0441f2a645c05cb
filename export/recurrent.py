"""Layers with a recurrent state: Qwen3.5's Gated DeltaNet (linear attention), exported exactly.

A linear-attention layer keeps no K/V. It keeps two states per sequence, carried from pass to
pass: the last K-1 inputs of its causal convolution, `[B, C, K-1]`, and the delta rule's
matrix, `[B, H, Dk, Dv]`, which every token updates. A state has no length to move back, so
the graph contract takes each state as an input (the state before the pass's first row) and
returns it after each of the pass's last R rows, the rows whose logits it returns
(`logits_rows`): a verify pass of k+1 rows returns k+1 states, and accepting j drafts makes the
state the one after row j with no second pass (runtime/backends/recurrent.py keeps them). A
prefill chunk asks for its last row only, so it returns one state, not one per token.

Exactness: a verify pass's rows must equal single steps bit for bit (greedy speculative output
then equals plain). Everything else in the layer works row by row; the recurrence runs as
ONNX `Scan`, the same few nodes per token (element-wise products and small matmuls) whatever T
is, so row i of a pass
computes exactly what a single step at that position computes. The convolution is spelled as
K shifted products added in a fixed order, for the same reason.

`gated_delta_rule` is a custom op: its eager body is the recurrence (the parity reference and
what the graph module runs); the exporter writes it as a placeholder node that `lower_scans`
replaces with two Scans (the rows before the last R, whose states nobody keeps, and the last
R, whose states the graph returns).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops import aligned, register_schema

DOMAIN = "specdeploy"  # the placeholder's domain: no graph that leaves export contains it


def _step(s, q, k, v, decay, beta):
    """One token of the gated delta rule: s [B, H, Dk, Dv]; q, k [B, H, Dk]; v [B, H, Dv];
    decay (exp of the gate) and beta [B, H] -> (the state after it, its output [B, H, Dv]).
    The products with the state are matmuls (a row times the state reads it once; the source's
    multiply-and-sum writes and reads a copy), the outer product one of inner size 1 (exact)."""
    s = s * decay[..., None, None]
    kv_mem = (k[..., None, :] @ s)[..., 0, :]
    delta = (v - kv_mem) * beta[..., None]
    s = s + k[..., :, None] @ delta[..., None, :]
    return s, (q[..., None, :] @ s)[..., 0, :]


@torch.library.custom_op("specdeploy::gated_delta_rule", mutates_args=())
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, H, Dk] (l2-normed; q scaled), v [B, T, H, Dv], decay, beta [B, T, H], state
    [B, H, Dk, Dv] float32 -> (outputs [B, T, H, Dv], the states after each of the last R rows
    [B, R, H, Dk, Dv], R = rows.shape[0])."""
    t, r = q.shape[1], rows.shape[0]
    s, outs, states = state, [], []
    for i in range(t):
        s, o = _step(s, q[:, i], k[:, i], v[:, i], decay[:, i], beta[:, i])
        outs.append(o)
        if i >= t - r:
            states.append(s)
    return torch.stack(outs, 1), torch.stack(states, 1)


@gated_delta_rule.register_fake
def _(q, k, v, decay, beta, state, rows):
    b, t, h, dv = v.shape
    return v.new_empty((b, t, h, dv)), state.new_empty((b, rows.shape[0], *state.shape[1:]))


def gated_delta_rule_onnx(q, k, v, decay, beta, state, rows):
    from onnxscript import values

    register_schema(
        "GatedDeltaRule",
        [("q", "T"), ("k", "T"), ("v", "T"), ("decay", "T"), ("beta", "T"), ("state", "T"), ("rows", "M")],
        {"T": ["tensor(float)"], "M": ["tensor(int64)"]}, {},
        outputs=[("output", "T"), ("states", "T")], domain=DOMAIN,
    )
    return values.Opset(DOMAIN, 1).GatedDeltaRule(q, k, v, decay, beta, state, rows)


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution with SiLU over x [B, T, C] after `state` [B, C, K-1]
    (the K-1 inputs before the pass) -> (outputs [B, T, C], the states after each of the last R
    rows [B, R, C, K-1]). weight [C, K]. Tap j of row i reads input i + j of the joined
    sequence; the products are added in tap order, the same for any T."""
    t, r = x.shape[1], rows.shape[0]
    kernel = weight.shape[-1]
    joined = torch.cat((state.to(x.dtype), x.transpose(1, 2)), dim=-1)  # [B, C, K-1+T]
    out = joined[:, :, 0:t] * weight[:, 0:1]
    for j in range(1, kernel):
        out = out + joined[:, :, j : j + t] * weight[:, j : j + 1]
    out = aligned(F.silu, out.transpose(1, 2))  # [B, T, C]
    # the state after row i: inputs i+1 .. i+K-1 of the joined sequence
    index = (torch.arange(r, device=x.device) + (t - r + 1))[:, None] + torch.arange(kernel - 1, device=x.device)
    states = joined[:, :, index].permute(0, 2, 1, 3)  # [B, R, C, K-1]
    return out, states


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As the source computes it (the FLA library's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNet:
    """A Qwen3.5 linear-attention layer's forward over the graph contract's states, reading the
    source module's own weights (in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, conv1d, A_log,
    dt_bias, the gated norm, out_proj)."""

    def __init__(self, module: torch.nn.Module):
        self.m = module
        self.key_dim, self.value_dim = module.key_dim, module.value_dim
        self.k_heads, self.v_heads = module.num_k_heads, module.num_v_heads
        self.dk, self.dv = module.head_k_dim, module.head_v_dim
        self.kernel = module.conv_kernel_size

    @property
    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(convolution state [C, K-1], recurrent state [H, Dk, Dv]) of one sequence."""
        return (self.key_dim * 2 + self.value_dim, self.kernel - 1), (self.v_heads, self.dk, self.dv)

    def __call__(self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, rows: torch.Tensor):
        """x [B, T, hidden] (the layer's normed input) -> (output [B, T, hidden], convolution
        states [B, R, C, K-1], recurrent states [B, R, H, Dk, Dv])."""
        m = self.m
        b, t, _ = x.shape
        mixed, conv_states = causal_conv(m.in_proj_qkv(x), conv_state, m.conv1d.weight[:, 0], rows)
        q, k, v = mixed[..., : self.key_dim], mixed[..., self.key_dim : 2 * self.key_dim], mixed[..., 2 * self.key_dim :]
        q = q.reshape(b, t, self.k_heads, self.dk).float()
        k = k.reshape(b, t, self.k_heads, self.dk).float()
        v = v.reshape(b, t, self.v_heads, self.dv).float()
        # [B, T, heads]: a few floats a row (ops.aligned)
        beta = aligned(torch.sigmoid, m.in_proj_b(x)).float()
        g = -m.A_log.float().exp() * aligned(F.softplus, m.in_proj_a(x).float() + m.dt_bias)
        if self.k_heads != self.v_heads:  # each q/k head serves v_heads / k_heads consecutive value heads
            q = q.repeat_interleave(self.v_heads // self.k_heads, dim=2)
            k = k.repeat_interleave(self.v_heads // self.k_heads, dim=2)
        q = l2norm(q) * (self.dk**-0.5)
        k = l2norm(k)
        out, states = gated_delta_rule(q, k, v, aligned(torch.exp, g), beta, state, rows)
        z = m.in_proj_z(x).reshape(b, t, self.v_heads, self.dv)
        out = _gated_norm(m.norm, out.to(x.dtype), z)
        return m.out_proj(out.reshape(b, t, self.value_dim)), conv_states, states


def _gated_norm(norm: torch.nn.Module, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The source's RMSNormGated: the graph's RMSNorm (normed in float32, times the weight in the
    input's dtype), times SiLU(gate) in float32."""
    from .graph import rms_norm  # graph.py builds these layers: imported here, not at the top

    return (rms_norm(norm, x, norm.variance_epsilon) * aligned(F.silu, gate.float())).to(x.dtype)


# -- the placeholder lowered to standard ONNX

def _body(keep_states: bool):
    """The Scan body: (state, q_t, k_t, v_t, decay_t, beta_t) -> (state, output_t[, state])."""
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, f, None) for n in ("s_in", "q", "k", "v", "decay", "beta")]
    nodes = [  # as _step: [B, H, ...] throughout
        helper.make_node("Constant", [], ["ax23"], value_ints=[2, 3]),
        helper.make_node("Constant", [], ["ax3"], value_ints=[3]),
        helper.make_node("Constant", [], ["ax2"], value_ints=[2]),
        helper.make_node("Unsqueeze", ["decay", "ax23"], ["decay4"]),
        helper.make_node("Mul", ["s_in", "decay4"], ["s1"]),
        helper.make_node("Unsqueeze", ["k", "ax2"], ["k_row"]),  # [B, H, 1, Dk]
        helper.make_node("MatMul", ["k_row", "s1"], ["kv_mem4"]),
        helper.make_node("Squeeze", ["kv_mem4", "ax2"], ["kv_mem"]),
        helper.make_node("Sub", ["v", "kv_mem"], ["diff"]),
        helper.make_node("Unsqueeze", ["beta", "ax2"], ["beta3"]),
        helper.make_node("Mul", ["diff", "beta3"], ["delta"]),
        helper.make_node("Unsqueeze", ["k", "ax3"], ["k_col"]),  # [B, H, Dk, 1]
        helper.make_node("Unsqueeze", ["delta", "ax2"], ["delta_row"]),
        helper.make_node("MatMul", ["k_col", "delta_row"], ["outer"]),
        helper.make_node("Add", ["s1", "outer"], ["s_out"]),
        helper.make_node("Unsqueeze", ["q", "ax2"], ["q_row"]),
        helper.make_node("MatMul", ["q_row", "s_out"], ["o4"]),
        helper.make_node("Squeeze", ["o4", "ax2"], ["o"]),
    ]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("s_out", "o")]
    if keep_states:
        nodes.append(helper.make_node("Identity", ["s_out"], ["s_row"]))
        outputs.append(helper.make_tensor_value_info("s_row", f, None))
    return helper.make_graph(nodes, "gated_delta_step" + ("_kept" if keep_states else ""), inputs, outputs)


def lower_scans(model) -> int:
    """Replace each GatedDeltaRule placeholder with standard ONNX: the rows before the last R
    through one Scan, the last R through another that also returns its states. Returns how many
    it replaced."""
    from onnx import TensorProto, helper

    graph = model.graph
    count, nodes = 0, []
    for node in graph.node:
        if node.domain != DOMAIN:
            nodes.append(node)
            continue
        count += 1
        q, k, v, decay, beta, state, rows = node.input
        out, states = node.output
        p = f"gdr{count}_"
        new = [
            helper.make_node("Shape", [q], [p + "t"], start=1, end=2),
            helper.make_node("Shape", [rows], [p + "r"], start=0, end=1),
            helper.make_node("Sub", [p + "t", p + "r"], [p + "split"]),
            helper.make_node("Constant", [], [p + "zero"], value_ints=[0]),
            helper.make_node("Constant", [], [p + "axis"], value_ints=[1]),
        ]
        heads, tails = [], []
        for name in (q, k, v, decay, beta):
            new.append(helper.make_node("Slice", [name, p + "zero", p + "split", p + "axis"], [p + name + "_head"]))
            new.append(helper.make_node("Slice", [name, p + "split", p + "t", p + "axis"], [p + name + "_tail"]))
            heads.append(p + name + "_head")
            tails.append(p + name + "_tail")
        # ONNX Runtime refuses a Scan of no iterations: with no rows before the last R (every
        # verify pass and single step) the head is the state and an empty output as they are
        scan = helper.make_node("Scan", [state, *heads], ["mid", "out"], body=_body(False),
                                num_scan_inputs=5, scan_input_axes=[1] * 5, scan_output_axes=[1])
        empty = [helper.make_node("Identity", [state], ["mid"]), helper.make_node("Identity", [heads[2]], ["out"])]
        branch = lambda nodes, name: helper.make_graph(  # noqa: E731
            nodes, name, [], [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("mid", "out")])
        new.append(helper.make_node("Greater", [p + "split", p + "zero"], [p + "some"]))
        new.append(helper.make_node("Squeeze", [p + "some"], [p + "cond"]))
        new.append(helper.make_node("If", [p + "cond"], [p + "mid", p + "out_head"],
                                    then_branch=branch([scan], p + "head"), else_branch=branch(empty, p + "none")))
        new.append(helper.make_node("Scan", [p + "mid", *tails], [p + "end", p + "out_tail", states], body=_body(True),
                                    num_scan_inputs=5, scan_input_axes=[1] * 5, scan_output_axes=[1, 1]))
        new.append(helper.make_node("Concat", [p + "out_head", p + "out_tail"], [out], axis=1))
        nodes.extend(new)
    if count:
        del graph.node[:]
        graph.node.extend(nodes)
        kept = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return count


__all__ = ["GatedDeltaNet", "causal_conv", "gated_delta_rule", "lower_scans"]
