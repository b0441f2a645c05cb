"""The graph contract as a PyTorch module (docs/design.md, "The graph contract").

One forward serves every pass: T = 1 for a draft step, k+1 for a verify pass, a chunk
for prefill.

    input_ids       [B, T]        int64
    position_ids    [B, T]        int64   absolute positions, for RoPE
    write_indices   [B]           int64   slot where this pass's K/V are written
    attention_mask  [B, 1, T, L]  float32 additive (0 or -inf); L = write index + T
    past_key_i      [B, Hkv, S, D]        static buffers, S = max sequence
    past_value_i    [B, Hkv, S, D]
    logits_rows     [R]           int64   the rows (0..T-1) whose logits the pass returns
 -> logits          [B, R, V]     float32 (a verify pass asks for all k+1 rows; a prefill
                                          chunk or a draft's catch-up only for its last)
    present_key_i   [B, Hkv, S, D]        the same buffer, written in place at write_indices

The head reads only the rows asked for: it is a fifth of SmolLM2's weights and of a
prefill chunk's arithmetic, and a prefill chunk needs none of its rows (the prompt's last
token opens the first round). The rows are data with a shape of their own (R), so one
graph serves both.

The write position is data, never a shape: one graph serves every step. Attention reads
only the first L slots of the buffer, L taken from the mask's shape, so its cost follows
the real context, and slots at and past the written length are never read: rollback after
a rejection is moving the length back, with no copy.

`kv_write` is a custom op (export/ops.py) so the exporter emits ONNX `TensorScatter` (opset 24),
which ONNX Runtime and TensorRT execute in place when the output aliases the input buffer.
"""
from __future__ import annotations

import torch
from torch import nn

from .ops import attention_reference, fused_attention_eager, group_query_attention, kv_write, rope_caches, rotary, skip_rms_norm


def kv_write_inplace(cache: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor) -> torch.Tensor:
    """The same contract written in place, for eager runs that keep their own buffers.

    The slots are computed on the tensor's device and never read back to the host, so the
    write needs no synchronisation and a CUDA graph can capture it and replay it at any
    write position (the torch backend does)."""
    slots = write_indices[:, None] + torch.arange(update.shape[2], device=write_indices.device)  # [B, T]
    for b in range(cache.shape[0]):
        cache[b].index_copy_(1, slots[b], update[b])
    return cache


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The source's RMSNorm, spelled x / sqrt(mean(x^2) + eps) * w: ONNX Runtime fuses this
    form into one SimplifiedLayerNormalization node (the rsqrt form stays six nodes)."""
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps")
    x32 = x.float()
    return norm.weight * (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _split(y: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    """Slices of the last dim (one Slice node each; a split exports as a sequence op)."""
    out, at = [], 0
    for w in widths:
        out.append(y[..., at : at + w])
        at += w
    return out


def _mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if hasattr(mlp, "gate_up_proj"):  # fused by export/quantize.py
        gate, up = _split(mlp.gate_up_proj(x), mlp.gate_up_proj.split)
        return mlp.down_proj(mlp.act_fn(gate) * up)
    return mlp(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _packed_qkv(attn: nn.Module) -> nn.Module:
    """One Linear computing q | k | v (their weights and biases stacked), or the module's own
    qkv_proj where it has one (export/quantize.py fuses the quantized projections itself).
    The source's projections stay as they are: its modules are shared with the source model."""
    if hasattr(attn, "qkv_proj"):
        return attn.qkv_proj
    parts = (attn.q_proj, attn.k_proj, attn.v_proj)
    weight = torch.cat([p.weight.detach() for p in parts])
    packed = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None,
                       dtype=weight.dtype, device=weight.device)
    packed.weight.data = weight
    if packed.bias is not None:
        packed.bias.data = torch.cat([p.bias.detach() for p in parts])
    return packed.requires_grad_(False)


def restrict_head(hf_model: nn.Module, vocab: list[int]) -> None:
    """Give the model a head over `vocab`'s tokens only, in place (a distilled draft: N of
    V rows, so the head costs N/V). SpecGraph(head_vocab=vocab) then gives every other
    token -inf: the output keeps the contract's [B, T, V] and those tokens are never drafted."""
    old = hf_model.lm_head
    ids = torch.tensor(vocab, dtype=torch.long)
    head = nn.Linear(old.in_features, len(vocab), bias=old.bias is not None)
    head.weight.data = old.weight.data[ids].clone()
    if old.bias is not None:
        head.bias.data = old.bias.data[ids].clone()
    hf_model.lm_head = head.to(old.weight.dtype)


class SpecGraph(nn.Module):
    """A Llama-family decoder (Llama, Qwen2, Mistral) over static, in-place KV buffers.

    It borrows the source model's own modules (projections with their biases, norms,
    MLP), so numerics follow the source, and keeps only the first `num_layers` layers
    (a layer-truncated self-draft uses the target's first N layers, its norm and head).
    """

    def __init__(
        self, hf_model: nn.Module, num_layers: int | None = None, inplace: bool = False,
        head_vocab: list[int] | None = None,
    ):
        super().__init__()
        cfg = hf_model.config
        base = hf_model.model
        n = cfg.num_hidden_layers if num_layers is None else num_layers
        self.embed_tokens = base.embed_tokens
        self.layers = nn.ModuleList(list(base.layers)[:n])
        self.norm = base.norm
        self.lm_head = hf_model.lm_head
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = base.rotary_emb
        self.register_buffer("inv_freq", rotary.inv_freq.detach().clone().float(), persistent=False)
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.scaling = self.head_dim**-0.5
        self.inplace = inplace  # eager runs over caller-owned buffers write in place
        self.contrib_ops = False  # see use_contrib_ops
        self.fused = False
        self.qkv = None  # the fused graphs' packed q|k|v projections, one a layer (see use_contrib_ops)
        self.skip_norms = False  # see use_contrib_ops
        self.vocab_size = cfg.vocab_size
        # A distilled draft's head covers these tokens only (see restrict_head); None: all.
        # A buffer, so `.to(device)` moves it with the weights (a copy inside a pass would not capture).
        self.register_buffer("head_vocab", None if head_vocab is None else torch.tensor(head_vocab, dtype=torch.long),
                             persistent=False)

    def use_contrib_ops(self, positions: int, fused: bool = False) -> None:
        """Spell RoPE as ONNX Runtime's RotaryEmbedding (one node for what is otherwise about
        seven per tensor) over cos/sin caches of `positions` rows, and each residual add with
        the norm after it as SkipSimplifiedLayerNormalization (row by row: verify rows stay
        bit-identical to single steps). `fused`: also each attention with its rotary
        embedding and KV write (GroupQueryAttention), one node; its verify rows equal single
        steps only up to rounding (README: exact and fused graphs). For ONNX Runtime only:
        TensorRT's parser does not read contrib ops."""
        cos, sin = rope_caches(self.inv_freq, self.rope_scale, positions)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        self.contrib_ops = True
        self.skip_norms = True
        self.fused = fused
        if fused:
            # GroupQueryAttention reads q|k|v packed: one MatMul a layer, not three and a Concat
            # (at T = 1 a node's own cost is a large part of its time)
            self.qkv = nn.ModuleList(_packed_qkv(layer.self_attn) for layer in self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _norm(self, norm: nn.Module, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h + delta), h + delta): a block's output joins the residual stream, then the
        next norm reads it (one node in ONNX Runtime's graphs)."""
        if delta is None:
            return rms_norm(norm, h), h
        if self.skip_norms:
            eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps")
            return skip_rms_norm(h, delta, norm.weight, eps)
        h = h + delta
        return rms_norm(norm, h), h

    def _attention(self, layer: int, attn: nn.Module, x, position_ids, write_indices, attention_mask, mask, cos, sin,
                   key_cache, value_cache):
        """-> (output [B, T, H*D], key cache, value cache) for layer `layer`. `mask`: the
        additive mask as attention_reference reads it."""
        b, t, _ = x.shape
        write = kv_write_inplace if self.inplace else kv_write
        d = self.head_dim
        fused_qkv = hasattr(attn, "qkv_proj")  # by export/quantize.py: one node for the three
        if self.fused:
            qkv = self.qkv[layer](x)
            args = (qkv, key_cache, value_cache, write_indices, attention_mask, self.cos_cache.to(x.dtype),
                    self.sin_cache.to(x.dtype), self.num_heads, self.num_kv_heads, self.scaling)
            return fused_attention_eager(*args, write=write) if self.inplace else group_query_attention(*args)
        if fused_qkv:
            q, k, v = _split(attn.qkv_proj(x), attn.qkv_proj.split)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if self.contrib_ops:
            q = rotary(q, position_ids, self.cos_cache.to(q.dtype), self.sin_cache.to(q.dtype), self.num_heads)
            k = rotary(k, position_ids, self.cos_cache.to(k.dtype), self.sin_cache.to(k.dtype), self.num_kv_heads)
        q = q.view(b, t, self.num_heads, d).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, d).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, d).transpose(1, 2)
        if not self.contrib_ops:
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        return attention_reference(q, k, v, key_cache, value_cache, write_indices, mask, self.scaling, write)

    def forward(self, input_ids, position_ids, write_indices, attention_mask, past: list[torch.Tensor],
                logits_rows: torch.Tensor | None = None):
        """`logits_rows` [R]: the rows whose logits are returned (None: every row)."""
        b, t = input_ids.shape
        h = self.embed_tokens(input_ids)
        cos = sin = None
        if not self.contrib_ops:
            freqs = position_ids[..., None].float() * self.inv_freq  # [B, T, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * self.rope_scale).to(h.dtype)[:, None]  # [B, 1, T, D]
            sin = (emb.sin() * self.rope_scale).to(h.dtype)[:, None]
        mask = attention_mask[:, :, None].to(h.dtype)  # [B, 1, 1, T, L]
        presents = []
        delta = None  # the last block's output, not yet added to the residual stream h
        for i, layer in enumerate(self.layers):
            x, h = self._norm(layer.input_layernorm, h, delta)
            out, key_cache, value_cache = self._attention(
                i, layer.self_attn, x, position_ids, write_indices, attention_mask, mask, cos, sin, past[2 * i], past[2 * i + 1]
            )
            presents += [key_cache, value_cache]
            x, h = self._norm(layer.post_attention_layernorm, h, layer.self_attn.o_proj(out))
            delta = _mlp(layer.mlp, x)
        x, h = self._norm(self.norm, h, delta)
        if logits_rows is not None:
            x = x.index_select(1, logits_rows)  # one Gather: the head reads R rows, not T
        logits = self.lm_head(x).float()
        if self.head_vocab is not None:  # one ScatterElements into rows of -inf
            r = logits.shape[1]
            full = logits.new_full((b, r, self.vocab_size), float("-inf"))
            logits = full.scatter(-1, self.head_vocab.expand(b, r, -1), logits)
        return (logits, *presents)
