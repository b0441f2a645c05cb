"""A mixture of experts (gpt-oss) as two projections the graph and the quantizer already know.

The source (transformers' GptOssMLP) routes each token to `num_experts_per_tok` of
`num_local_experts` experts: router logits (a Linear with bias) -> top-k -> softmax over
the k values; each chosen expert computes its gate|up projection (interleaved columns, with
bias), clamps gate above and up on both sides at `swiglu_limit`, glu = gate *
sigmoid(alpha * gate), (up + 1) * glu, then its down projection (with bias); the outputs
are summed weighted by the routing weights.

Here every expert's gate and up are one Linear each over all experts (E x I outputs), and the
down projections one Linear over all experts' intermediates side by side (E x I inputs):
the routing weights (zero for the experts not chosen) multiply each expert's intermediate
before the down projection, and the experts' down biases enter as routing weights @ biases.
So a token's output is the same sum as the source's, every expert is computed for every
token (dense: E / k times the arithmetic of a sparse kernel, and at one token a pass every
expert's weights are read), and the module is made of the nn.Linear projections the
quantizer replaces by MatMulNBits (gate_proj, up_proj, down_proj: the Llama names), while the
router stays float (a top-k is where rounding would change which experts run).
Each token's row is computed alone, so a verify pass's rows stay those of single steps.
"""
from __future__ import annotations

import torch
from torch import nn


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    out.weight.data = weight.contiguous()
    if bias is not None:
        out.bias.data = bias.contiguous()
    return out.requires_grad_(False)


class DenseExperts(nn.Module):
    """gpt-oss's MLP: the router, then every expert's clamped SwiGLU weighted by it."""

    def __init__(self, mlp: nn.Module, cfg):
        super().__init__()
        experts, router = mlp.experts, mlp.router
        e, hidden, two_i = experts.gate_up_proj.shape
        i = two_i // 2
        self.num_experts, self.top_k, self.width = e, cfg.num_experts_per_tok, i
        self.alpha, self.limit = float(experts.alpha), float(experts.limit)
        self.router = _linear(router.weight.detach(), router.bias.detach())
        gate_up = experts.gate_up_proj.detach()  # [E, H, 2I]: gate and up interleaved along the last dim
        bias = experts.gate_up_proj_bias.detach()  # [E, 2I]
        # [E, H, I] -> [E*I, H]: output e*I + j is expert e's column j
        self.gate_proj = _linear(gate_up[..., ::2].permute(0, 2, 1).reshape(e * i, hidden), bias[:, ::2].reshape(-1))
        self.up_proj = _linear(gate_up[..., 1::2].permute(0, 2, 1).reshape(e * i, hidden), bias[:, 1::2].reshape(-1))
        down = experts.down_proj.detach()  # [E, I, H]
        self.down_proj = _linear(down.reshape(e * i, hidden).T, None)
        self.register_buffer("down_bias", experts.down_proj_bias.detach().clone(), persistent=False)  # [E, H]

    def _gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if "gate_up_proj" in self._modules:  # the quantizer's fusion of gate and up (one MatMulNBits)
            y = self.gate_up_proj(x)
            half = self.num_experts * self.width
            return y[..., :half], y[..., half:]
        return self.gate_proj(x), self.up_proj(x)

    def routing(self, x: torch.Tensor) -> torch.Tensor:
        """[..., E]: each token's weight for each expert (0 for those not chosen)."""
        logits = self.router(x)
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
        return torch.zeros_like(logits).scatter(-1, chosen, weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.routing(x)  # [B, T, E]
        gate, up = self._gate_up(x)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        inner = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # [B, T, E*I]
        b, t, _ = inner.shape
        inner = (inner.view(b, t, self.num_experts, self.width) * weights[..., None]).view(b, t, -1)
        return self.down_proj(inner) + weights @ self.down_bias.to(weights.dtype)


def densify_experts(model: nn.Module) -> None:
    """Replace each layer's mixture of experts by DenseExperts, in place (on a copy of the source:
    the source keeps its own modules, the reference the export is checked against)."""
    for layer in model.model.layers:
        layer.mlp = DenseExperts(layer.mlp, model.config)


__all__ = ["DenseExperts", "densify_experts"]
