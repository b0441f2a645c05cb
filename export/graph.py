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

A model with linear-attention layers (Qwen3.5) also takes, per such layer, its convolution and
recurrent states before the pass (`conv_state_i` [B, C, K-1], `recurrent_state_i` [B, H, Dk, Dv],
float32) and returns them after each of the R rows (`conv_states_i`, `recurrent_states_i`
[B, R, ...]): export/recurrent.py.

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
from transformers.activations import ACT2FN

from specdeploy.core.errors import ExportError

from .architectures import LINEAR, Architecture, check_config
from .experts import gemma4_routing
from .quantize import QuantEmbedding
from .ops import aligned, attention_reference, fused_attention_eager, group_query_attention, kv_write, rope_caches, rotary, skip_rms_norm
from .recurrent import GatedDeltaNet


def kv_write_inplace(cache: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor) -> torch.Tensor:
    """The same contract written in place, for eager runs that keep their own buffers.

    The slots are computed on the tensor's device and never read back to the host, so the
    write needs no synchronisation and a CUDA graph can capture it and replay it at any
    write position (the torch backend does)."""
    slots = write_indices[:, None] + torch.arange(update.shape[2], device=write_indices.device)  # [B, T]
    for b in range(cache.shape[0]):
        cache[b].index_copy_(1, slots[b], update[b])
    return cache


def rms_norm(norm: nn.Module, x: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """The source's RMSNorm, spelled x / sqrt(mean(x^2) + eps) * w: ONNX Runtime fuses this
    form into one SimplifiedLayerNormalization node (the rsqrt form stays six nodes).
    `unit_offset` (Gemma): (1 + w) * x^, multiplied in float32 and then cast, as its reference does."""
    x32 = x.float()
    normed = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if getattr(norm, "weight", None) is None:  # a norm without a scale (Gemma 4's v_norm)
        return normed.to(x.dtype)
    if unit_offset:
        return (normed * (1.0 + norm.weight.float())).to(x.dtype)
    return norm.weight * normed.to(x.dtype)


def _split(y: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    """Slices of the last dim (one Slice node each; a split exports as a sequence op)."""
    out, at = [], 0
    for w in widths:
        out.append(y[..., at : at + w])
        at += w
    return out




def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Concat(nn.Module):
    """Projections of one input computed apart, their outputs side by side (q | k | v)."""

    def __init__(self, parts):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _packed_qkv(attn: nn.Module, packed: bool) -> nn.Module:
    """One Linear computing q | k | v (their weights and biases stacked), or the module's own
    qkv_proj where it has one (`packed`: the source's, or export/quantize.py's).
    The source's projections stay as they are: its modules are shared with the source model."""
    if packed:
        return attn.qkv_proj
    parts = (attn.q_proj, attn.k_proj, attn.v_proj)
    if not all(isinstance(p, nn.Linear) for p in parts):  # quantized in different forms: a node each
        return _Concat(parts)
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
    """A decoder of a family export/architectures.py lists, over static, in-place KV buffers.

    It borrows the source model's own modules (projections with their biases, norms,
    MLP), so numerics follow the source, and keeps only the first `num_layers` layers
    (a layer-truncated self-draft uses the target's first N layers, its norm and head).
    What differs by family (norms, q/k norms, packed projections, windows, RoPE per layer
    type, soft-caps, the embedding scale) is read from the family's entry, never probed.
    """

    def __init__(
        self, hf_model: nn.Module, num_layers: int | None = None, inplace: bool = False,
        head_vocab: list[int] | None = None, aux_layers: tuple[int, ...] | None = None,
    ):
        super().__init__()
        cfg = hf_model.config
        base = hf_model.model
        arch: Architecture = check_config(cfg)
        self.arch = arch
        n = cfg.num_hidden_layers if num_layers is None else num_layers
        self.embed_tokens = base.embed_tokens
        self.layers = nn.ModuleList(list(base.layers)[:n])
        self.norm = base.norm
        self.lm_head = hf_model.lm_head
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        rotary = base.rotary_emb
        if arch.rope_by_layer_type:
            # one set of angles per layer type (Gemma 3: local and global bases): buffers
            # inv_freq (full attention) and inv_freq_sliding, each layer naming its own; a model
            # with layers of one type only (a one-layer draft) has that type's alone
            kinds = cfg.layer_types[:n]
            self.rope_of_layer = ["inv_freq" if k == "full_attention" else "inv_freq_sliding" for k in kinds]
            self.rope_scales = {}
            for kind, name in (("full_attention", "inv_freq"), ("sliding_attention", "inv_freq_sliding")):
                if kind in cfg.layer_types:
                    self.register_buffer(name, getattr(rotary, f"{kind}_inv_freq").detach().clone().float(),
                                         persistent=False)
                    self.rope_scales[name] = float(getattr(rotary, f"{kind}_attention_scaling"))
            self.rope_scale = self.rope_scales.get("inv_freq")  # the contrib-op graphs' (families without them: unused)
        else:
            self.register_buffer("inv_freq", rotary.inv_freq.detach().clone().float(), persistent=False)
            self.rope_scale = float(rotary.attention_scaling)
            self.rope_of_layer = ["inv_freq"] * n
            self.rope_scales = {"inv_freq": self.rope_scale}
        self.scaling = arch.scaling(cfg, self.head_dim)
        self.attn_softcap, self.final_softcap = arch.softcaps(cfg)
        self.windows = arch.layer_windows(cfg)[:n]  # windows the graph applies itself, per layer
        self.rotates = arch.rope_layers(cfg)[:n]  # False: a layer that attends without positions
        # The KV buffers: (num_kv_heads, head_dim) of each layer that keeps K/V, and the pair of
        # buffers each layer reads (and writes, where it keeps its own)
        self.kv_layout = [(self.num_kv_heads, self.head_dim)] * n
        self.kv_of_layer = list(range(n))
        self.layer_dims = [(self.num_kv_heads, self.head_dim)] * n  # each layer's (num_kv_heads, head_dim)
        self.keeps_kv = [True] * n  # False: the layer reads an earlier layer's K/V and writes none
        self.k_eq_v = [False] * n  # True: v is k's projection (normed apart, not rotated)
        self.per_layer_width = 0  # Gemma 4's per-layer input embeddings: each layer's slice width
        self.experts_beside = False
        if arch.layer_configs:
            self._layer_configs(cfg, base, n)
        # Qwen3.5's linear-attention layers (export/recurrent.py): their forward by layer, and the
        # (convolution, recurrent) state shapes of each, in order; None for a layer that keeps K/V
        self.linear: dict[int, GatedDeltaNet] = {}
        self.state_layout: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.state_of_layer: list[int | None] = [None] * n
        self.gated_query = False  # q_proj emits q | gate per head; attention's output times sigmoid(gate)
        self.rotary_dim = self.head_dim  # RoPE rotates the first rotary_dim of each head
        if arch.linear_attention:
            self._linear_layers(cfg, n)
        self.embed_scale = cfg.hidden_size**0.5 if arch.embed_scale else None
        # Widths of the packed projections' outputs: q | k | v and gate | up.
        self.qkv_widths = [self.num_heads * self.head_dim * (2 if self.gated_query else 1),
                           self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim]
        self.gate_up_widths = [cfg.intermediate_size, cfg.intermediate_size]
        self.act = ACT2FN[getattr(cfg, arch.activation_field)]
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
        # A target exported for an EAGLE-3 head also returns, for every row, the states at the
        # inputs of these layers side by side (core/graph_io.py AUX_HIDDEN), in float32.
        self.aux_layers = tuple(sorted(aux_layers)) if aux_layers else ()
        self.feature_inputs: dict[str, int] = {}
        self.feature_outputs = {"aux_hidden_states": len(self.aux_layers) * cfg.hidden_size} if self.aux_layers else {}

    def _layer_configs(self, cfg, base: nn.Module, n: int) -> None:
        """Gemma 4's per-layer attention shapes, K/V sharing and per-layer inputs (Architecture.layer_configs)."""
        self.layer_dims = [(cfg.per_layer_config[i].num_key_value_heads, cfg.per_layer_config[i].head_dim)
                           for i in range(n)]
        modes, kinds = cfg.kv_sharing_modes[:n], cfg.layer_types[:n]
        producer: dict[str, int] = {}  # layer type -> the pair kept by the last layer of that type so far
        self.kv_layout, self.kv_of_layer, self.keeps_kv = [], [], []
        for i in range(n):
            keeps = modes[i] != "reuse"
            if keeps:
                producer[kinds[i]] = len(self.kv_layout)
                self.kv_layout.append(self.layer_dims[i])
            self.kv_of_layer.append(producer[kinds[i]])
            self.keeps_kv.append(keeps)
        self.k_eq_v = [bool(cfg.attention_k_eq_v) and kind == "full_attention" for kind in kinds]
        self.experts_beside = self.arch.dense_experts(cfg)  # each layer's experts block beside its MLP
        self.per_layer_width = cfg.hidden_size_per_layer_input or 0
        if self.per_layer_width:
            self.embed_tokens_per_layer = base.embed_tokens_per_layer
            self.per_layer_model_projection = base.per_layer_model_projection
            self.per_layer_projection_norm = base.per_layer_projection_norm
            self.source_layers = cfg.num_hidden_layers  # the per-layer table holds a slice for each

    def _linear_layers(self, cfg, n: int) -> None:
        """Qwen3.5: which layers are Gated DeltaNet (no K/V, two states each), the gated query and
        the partial rotary of the others (Architecture.linear_attention)."""
        self.kv_layout, self.kv_of_layer, self.keeps_kv = [], [], []
        for i, kind in enumerate(cfg.layer_types[:n]):
            if kind == LINEAR:
                self.linear[i] = GatedDeltaNet(self.layers[i].linear_attn)
                self.state_of_layer[i] = len(self.state_layout)
                self.state_layout.append(self.linear[i].state_shapes)
                self.kv_of_layer.append(None)
            else:
                self.kv_of_layer.append(len(self.kv_layout))
                self.kv_layout.append((self.num_kv_heads, self.head_dim))
            self.keeps_kv.append(kind != LINEAR)
        if not self.kv_layout:
            raise ExportError(f"{self.arch.family}: the first {n} layers are all linear attention (layer_types "
                              f"{cfg.layer_types[:n]}); a graph needs a full-attention layer (for self:layers, take more)")
        self.gated_query = True
        self.rotary_dim = 2 * self.inv_freq.shape[0]

    def _per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[B, T, layers, width]: Gemma 4's per-layer inputs, as its model computes them: the token's
        row of the per-layer table (times sqrt(width)) and a projection of its embedding (times
        hidden^-1/2, normed), added and times 2^-1/2."""
        b, t, hidden = h.shape
        table = self.embed_tokens_per_layer
        scale = self.per_layer_width**0.5
        if isinstance(table, QuantEmbedding):  # the fast scheme's 4-bit table, as the main one: float32 rows
            rows = table(input_ids) * torch.tensor(scale, dtype=torch.float32)
        else:  # the lookup, then the scale rounded to the weights' dtype, as the source's embedding does
            rows = nn.functional.embedding(input_ids, table.weight) * torch.tensor(scale, dtype=table.weight.dtype)
        rows = rows.view(b, t, self.source_layers, self.per_layer_width)
        projected = self.per_layer_model_projection(h) * hidden**-0.5
        projected = self._rms(self.per_layer_projection_norm, projected.view(b, t, self.source_layers, self.per_layer_width))
        return (projected + rows) * 2.0**-0.5

    def _experts_beside(self, layer: nn.Module, h: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
        """Gemma 4's feed-forward with an experts block: the router reads the residual stream h, the
        experts its own norm of it; each output normed, then added."""
        weights = gemma4_routing(layer.router, h, layer.experts.num_experts)
        experts = layer.experts(self._rms(layer.pre_feedforward_layernorm_2, h), weights)
        return self._rms(layer.post_feedforward_layernorm_1, mlp_out) + self._rms(layer.post_feedforward_layernorm_2,
                                                                                 experts)

    def _layer_end(self, i: int, layer: nn.Module, h: torch.Tensor, per_layer: torch.Tensor | None) -> torch.Tensor:
        """Gemma 4's end of layer i, on the residual stream with the MLP's output joined: the
        per-layer input's gated block, then the layer's scalar."""
        if per_layer is not None:
            y = self.act(layer.per_layer_input_gate(h)) * per_layer[:, :, i]
            h = h + self._rms(layer.post_per_layer_input_norm, layer.per_layer_projection(y))
        return h * layer.layer_scalar

    def use_contrib_ops(self, positions: int, fused: bool = False) -> None:
        """Spell RoPE as ONNX Runtime's RotaryEmbedding (one node for what is otherwise about
        seven per tensor) over cos/sin caches of `positions` rows, and each residual add with
        the norm after it as SkipSimplifiedLayerNormalization (row by row: verify rows stay
        bit-identical to single steps). `fused`: also each attention with its rotary
        embedding and KV write (GroupQueryAttention), one node; its verify rows equal single
        steps only up to rounding (docs/backends.md, "Exact and fused graphs"). For ONNX Runtime only:
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
            self.qkv = nn.ModuleList(_packed_qkv(layer.self_attn, self._packed(layer.self_attn, "qkv_proj"))
                                     for layer in self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _packed(self, owner: nn.Module, name: str) -> bool:
        """Whether `owner` computes its projections as one packed Linear `name`: the family's
        own weights (packed_qkv, packed_gate_up), or export/quantize.py's fusion of them."""
        declared = self.arch.packed_qkv if name == "qkv_proj" else self.arch.packed_gate_up
        return declared or name in owner._modules

    def _rms(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(norm, x, self.eps, self.arch.unit_offset_norm)

    def _norm(self, norm: nn.Module, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h + delta), h + delta): a block's output joins the residual stream, then the
        next norm reads it (one node in ONNX Runtime's graphs)."""
        if delta is None:
            return self._rms(norm, h), h
        if self.skip_norms:
            return skip_rms_norm(h, delta, norm.weight, self.eps)
        h = h + delta
        return self._rms(norm, h), h

    def _mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.arch.experts:  # export/experts.py's DenseExperts, which reads its own packed form
            return mlp(x)
        if self._packed(mlp, "gate_up_proj"):
            gate, up = _split(mlp.gate_up_proj(x), self.gate_up_widths)
            return mlp.down_proj(self.act(gate) * up)
        return mlp(x)

    def _attention(self, layer: int, attn: nn.Module, x, position_ids, write_indices, attention_mask, mask, cos, sin,
                   key_cache, value_cache):
        """-> (output [B, T, H*D], key cache, value cache) for layer `layer`. `mask`: the
        additive mask as attention_reference reads it."""
        b, t, _ = x.shape
        write = kv_write_inplace if self.inplace else kv_write
        if self.arch.layer_configs:
            return self._layer_attention(layer, attn, x, write, write_indices, mask, cos, sin, key_cache, value_cache)
        d = self.head_dim
        if self.fused:
            qkv = self.qkv[layer](x)
            args = (qkv, key_cache, value_cache, write_indices, attention_mask, self.cos_cache.to(x.dtype),
                    self.sin_cache.to(x.dtype), self.num_heads, self.num_kv_heads, self.scaling)
            return fused_attention_eager(*args, write=write) if self.inplace else group_query_attention(*args)
        if self._packed(attn, "qkv_proj"):
            q, k, v = _split(attn.qkv_proj(x), self.qkv_widths)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        gate = None
        if self.gated_query:  # each head's q then its gate, side by side
            qg = q.view(b, t, self.num_heads, 2 * d)
            q, gate = qg[..., :d].reshape(b, t, self.num_heads * d), qg[..., d:].reshape(b, t, self.num_heads * d)
        if self.arch.qk_norm:  # over each head's D values, before RoPE
            q = self._rms(attn.q_norm, q.view(b, t, self.num_heads, d)).view(b, t, self.num_heads * d)
            k = self._rms(attn.k_norm, k.view(b, t, self.num_kv_heads, d)).view(b, t, self.num_kv_heads * d)
        rotates = self.rotates[layer]
        if self.contrib_ops and rotates:
            q = rotary(q, position_ids, self.cos_cache.to(q.dtype), self.sin_cache.to(q.dtype), self.num_heads)
            k = rotary(k, position_ids, self.cos_cache.to(k.dtype), self.sin_cache.to(k.dtype), self.num_kv_heads)
        q = q.view(b, t, self.num_heads, d).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, d).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, d).transpose(1, 2)
        if not self.contrib_ops and rotates:
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        out, key_cache, value_cache = attention_reference(
            q, k, v, key_cache, value_cache, write_indices, mask, self.scaling, write, softcap=self.attn_softcap,
            sinks=attn.sinks if self.arch.sinks else None)
        if gate is not None:
            out = out * aligned(torch.sigmoid, gate)
        return out, key_cache, value_cache

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on [B, heads, T, D]: the first rotary_dim of each head (all of it but for a
        partial_rotary_factor), the rest as it is."""
        r = self.rotary_dim
        if r == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        part = x[..., :r]
        return torch.cat((part * cos + _rotate_half(part) * sin, x[..., r:]), dim=-1)

    def _layer_attention(self, layer: int, attn: nn.Module, x, write, write_indices, mask, cos, sin, key_cache,
                         value_cache):
        """Gemma 4's attention of layer `layer`: its own heads and width; q (and, where the layer
        keeps K/V, k and v) normed per head; v from k's projection on attention_k_eq_v layers, its
        norm without a scale; a layer that reads an earlier layer's K/V writes none."""
        b, t, _ = x.shape
        kv_heads, d = self.layer_dims[layer]
        q = self._rms(attn.q_norm, attn.q_proj(x).view(b, t, self.num_heads, d)).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = v = None
        if self.keeps_kv[layer]:
            k = attn.k_proj(x).view(b, t, kv_heads, d)
            v = k if self.k_eq_v[layer] else attn.v_proj(x).view(b, t, kv_heads, d)
            k = self._rms(attn.k_norm, k).transpose(1, 2)
            k = k * cos + _rotate_half(k) * sin
            v = self._rms(attn.v_norm, v).transpose(1, 2)
        return attention_reference(q, k, v, key_cache, value_cache, write_indices, mask, self.scaling, write,
                                   softcap=self.attn_softcap)

    def _rope(self, inv_freq: torch.Tensor, scale: float, position_ids: torch.Tensor, dtype: torch.dtype):
        """cos, sin [B, 1, T, D] at position_ids, as the source's rotary module computes them
        (over D padded to a multiple of 16: ops.aligned)."""
        freqs = position_ids[..., None].float() * inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = aligned(torch.cos, emb), aligned(torch.sin, emb)
        return (cos * scale).to(dtype)[:, None], (sin * scale).to(dtype)[:, None]

    def _window_mask(self, mask: torch.Tensor, position_ids: torch.Tensor, window: int) -> torch.Tensor:
        """`mask` [B, 1, 1, T, L] with slots `window` or more positions behind each row's also -inf:
        a sliding-window layer's mask, made here from position_ids so that the runtime's mask
        stays the full-attention layers'. Slot j holds position j for every committed token; a
        tree's nodes sit at slots at or past their positions, and export requires window > max
        draft, so every ancestor a tree row sees is inside its window either way."""
        slots = torch.arange(mask.shape[-1], device=mask.device)  # [L]
        behind = position_ids[:, None, None, :, None] - slots  # [B, 1, 1, T, L]
        return mask.masked_fill(behind >= window, float("-inf"))

    def decode(self, h, per_layer, position_ids, write_indices, attention_mask, masks: dict, past: list[torch.Tensor],
               states: list[torch.Tensor] | None = None, rows: torch.Tensor | None = None):
        """The layers over the embedded rows `h` [B, T, H] -> (the final norm's output, the KV
        buffers as the pass left them, the states `aux_layers` asks for). `masks`: the additive
        mask of each window (None: full attention), as attention_reference reads it. A model with
        linear-attention layers takes their `states` (convolution, recurrent per layer) before
        the pass; its states after each of the `rows` [R] follow the KV buffers in the second item."""
        ropes = {}
        if not self.contrib_ops:
            for name in dict.fromkeys(self.rope_of_layer):
                ropes[name] = self._rope(getattr(self, name), self.rope_scales[name], position_ids, h.dtype)
        norms = self.arch.norms
        caches, aux = list(past), []  # each KV pair as the layers before have left it in this pass
        state_outputs: list[torch.Tensor] = []
        delta = None  # the last block's output, not yet added to the residual stream h
        for i, layer in enumerate(self.layers):
            x, h = self._norm(getattr(layer, norms.attention_in), h, delta)
            if i in self.aux_layers:  # the state entering layer i (Hugging Face's hidden_states[i])
                aux.append(h.float())
            cos, sin = ropes.get(self.rope_of_layer[i], (None, None))
            j = self.kv_of_layer[i]
            if j is None:  # a linear-attention layer: its states in, its states after the rows out
                s = self.state_of_layer[i]
                out, conv, recurrent = self.linear[i](x, states[2 * s], states[2 * s + 1], rows)
                state_outputs += [conv, recurrent]
            else:
                out, caches[2 * j], caches[2 * j + 1] = self._attention(
                    i, layer.self_attn, x, position_ids, write_indices, attention_mask, masks[self.windows[i]], cos,
                    sin, caches[2 * j], caches[2 * j + 1]
                )
                out = layer.self_attn.o_proj(out)
            if norms.attention_out is not None:
                out = self._rms(getattr(layer, norms.attention_out), out)
            x, h = self._norm(getattr(layer, norms.mlp_in), h, out)
            delta = self._mlp(layer.mlp, x)
            if self.experts_beside:  # Gemma 4: the MLP's and the experts' outputs, each normed, added
                delta = self._experts_beside(layer, h, delta)
            if norms.mlp_out is not None:
                delta = self._rms(getattr(layer, norms.mlp_out), delta)
            if self.arch.layer_configs:
                h, delta = self._layer_end(i, layer, h + delta, per_layer), None
        x, h = self._norm(self.norm, h, delta)
        if self.num_layers in self.aux_layers:  # Hugging Face's hidden_states[-1]: the final norm's output
            aux.append(x.float())
        return x, caches + state_outputs, aux

    def forward(self, input_ids, position_ids, write_indices, attention_mask, past: list[torch.Tensor],
                logits_rows: torch.Tensor | None = None, states: list[torch.Tensor] | None = None):
        """`logits_rows` [R]: the rows whose logits are returned (None: every row). `states`: a
        model with linear-attention layers' states before the pass (convolution, recurrent per
        layer); it returns them after each of the same R rows, after the KV buffers."""
        b, t = input_ids.shape
        if self.embed_scale is None:
            h = self.embed_tokens(input_ids)
        elif isinstance(self.embed_tokens, QuantEmbedding):  # the fast scheme's 4-bit table: float32 rows
            h = self.embed_tokens(input_ids) * torch.tensor(self.embed_scale, dtype=torch.float32)
        else:  # the lookup, then the scale rounded to the weights' dtype, as the source's embedding does
            weight = self.embed_tokens.weight
            h = nn.functional.embedding(input_ids, weight) * torch.tensor(self.embed_scale, dtype=weight.dtype)
        per_layer = self._per_layer_inputs(input_ids, h) if self.per_layer_width else None
        mask = attention_mask[:, :, None].to(h.dtype)  # [B, 1, 1, T, L]
        masks = {None: mask}
        for window in dict.fromkeys(w for w in self.windows if w is not None):
            masks[window] = self._window_mask(mask, position_ids, window)
        rows = logits_rows if logits_rows is not None else torch.arange(t, device=input_ids.device)
        x, caches, aux = self.decode(h, per_layer, position_ids, write_indices, attention_mask, masks, past, states,
                                     rows if self.linear else None)
        if logits_rows is not None:
            x = x.index_select(1, logits_rows)  # one Gather: the head reads R rows, not T
        logits = self.lm_head(x)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        logits = logits.float()
        if self.head_vocab is not None:  # one ScatterElements into rows of -inf
            r = logits.shape[1]
            full = logits.new_full((b, r, self.vocab_size), float("-inf"))
            logits = full.scatter(-1, self.head_vocab.expand(b, r, -1), logits)
        if aux:
            return (logits, *caches, torch.cat(aux, dim=-1))
        return (logits, *caches)
