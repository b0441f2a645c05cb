"""A mixture of experts (gpt-oss's MLP, Gemma 4's experts block) as three projections the graph
and the quantizer already know.

gpt-oss's source (transformers' GptOssMLP) routes each token to `num_experts_per_tok` of
`num_local_experts` experts: router logits (a Linear with bias) -> top-k -> softmax over
the k values; each chosen expert computes its gate|up projection (interleaved columns, with
bias), clamps gate above and up on both sides at `swiglu_limit`, glu = gate *
sigmoid(alpha * gate), (up + 1) * glu, then its down projection (with bias); the outputs
are summed weighted by the routing weights. Gemma 4's experts (beside its MLP) are the same
with GELU-gated experts, no biases and its own router module (gemma4_experts, gemma4_routing).

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
    """A mixture of experts over projections of all experts at once (see the module's docstring):
    gate_proj and up_proj [E*I outputs], down_proj [E*I inputs], the experts' down biases apart.
    `routing(x)` gives each token's weight per expert; `glu(gate, up)` an expert's intermediate."""

    def __init__(self, gate: tuple, up: tuple, down: torch.Tensor, down_bias: torch.Tensor | None, glu,
                 num_experts: int, router: nn.Module | None = None, top_k: int = 0):
        super().__init__()
        self.num_experts, self.width, self.top_k = num_experts, gate[0].shape[0] // num_experts, top_k
        self.glu = glu
        self.router = router
        self.gate_proj, self.up_proj = _linear(*gate), _linear(*up)
        self.down_proj = _linear(down, None)
        self.register_buffer("down_bias", None if down_bias is None else down_bias.detach().clone(), persistent=False)

    def _gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if "gate_up_proj" in self._modules:  # the quantizer's fusion of gate and up (one MatMulNBits)
            y = self.gate_up_proj(x)
            half = self.num_experts * self.width
            return y[..., :half], y[..., half:]
        return self.gate_proj(x), self.up_proj(x)

    def routing(self, x: torch.Tensor) -> torch.Tensor:
        """[..., E]: gpt-oss's routing: router logits (with bias) -> top-k -> softmax over the k
        (0 for the experts not chosen)."""
        logits = self.router(x)
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        return torch.zeros_like(logits).scatter(-1, chosen, torch.softmax(top, dim=-1))

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, H]; `weights` [B, T, E] (None: this module's own routing of x)."""
        weights = self.routing(x) if weights is None else weights
        inner = self.glu(*self._gate_up(x))  # [B, T, E*I]
        b, t, _ = inner.shape
        inner = (inner.view(b, t, self.num_experts, self.width) * weights[..., None].to(inner.dtype)).view(b, t, -1)
        out = self.down_proj(inner)
        return out if self.down_bias is None else out + weights.to(out.dtype) @ self.down_bias.to(out.dtype)


def _by_expert(weight: torch.Tensor) -> torch.Tensor:
    """[E, I, H] (each expert's rows) -> [E*I, H]: output e*I + j is expert e's row j."""
    e, i, h = weight.shape
    return weight.reshape(e * i, h)


def gpt_oss_experts(mlp: nn.Module, cfg) -> DenseExperts:
    """gpt-oss's MLP (router with bias; experts' gate|up interleaved [E, H, 2I] with bias; the
    clamped SwiGLU: gate clamped above, up on both sides, at swiglu_limit; (up + 1) * gate *
    sigmoid(alpha * gate); down [E, I, H] with bias)."""
    experts, router = mlp.experts, mlp.router
    alpha, limit = float(experts.alpha), float(experts.limit)
    gate_up, bias = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()  # [E, H, 2I], [E, 2I]
    e = gate_up.shape[0]

    def glu(gate, up):
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return DenseExperts((_by_expert(gate_up[..., ::2].permute(0, 2, 1)), bias[:, ::2].reshape(-1)),
                        (_by_expert(gate_up[..., 1::2].permute(0, 2, 1)), bias[:, 1::2].reshape(-1)),
                        _by_expert(experts.down_proj.detach()).T, experts.down_proj_bias, glu, e,
                        _linear(router.weight.detach(), router.bias.detach()), cfg.num_experts_per_tok)


def gemma4_experts(experts: nn.Module) -> DenseExperts:
    """Gemma 4's experts block (gate|up concatenated [E, 2I, H], no bias; act(gate) * up; down
    [E, H, I]); its router stays the source's module (SpecGraph._experts_beside calls it)."""
    gate_up, i = experts.gate_up_proj.detach(), experts.intermediate_dim  # [E, 2I, H]
    act = experts.act_fn
    return DenseExperts((_by_expert(gate_up[:, :i]), None), (_by_expert(gate_up[:, i:]), None),
                        experts.down_proj.detach().permute(1, 0, 2).reshape(gate_up.shape[2], -1), None,
                        lambda gate, up: act(gate) * up, gate_up.shape[0])


def gemma4_routing(router: nn.Module, h: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[B, T, E]: the weights Gemma 4's router gives each expert (its own forward: the top-k of a
    softmax over all experts, renormalized, times each chosen expert's scale), 0 for the rest."""
    _, weights, chosen = router(h)
    return torch.zeros(*h.shape[:-1], num_experts, dtype=weights.dtype, device=h.device).scatter(-1, chosen, weights)


def densify_experts(model: nn.Module) -> None:
    """Replace each layer's mixture of experts by a DenseExperts, in place (on a copy of the
    source: the source keeps its own modules, the reference the export is checked against):
    gpt-oss's MLP, Gemma 4's experts block beside its MLP."""
    for layer in model.model.layers:
        if model.config.model_type == "gpt_oss":
            layer.mlp = gpt_oss_experts(layer.mlp, model.config)
        elif getattr(layer, "experts", None) is not None:
            layer.experts = gemma4_experts(layer.experts)


__all__ = ["DenseExperts", "densify_experts", "gemma4_experts", "gemma4_routing", "gpt_oss_experts"]
