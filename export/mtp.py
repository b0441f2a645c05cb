"""The multi-token-prediction layer a Qwen3.5 checkpoint carries (`mtp.*`), as a draft: `--draft mtp`
(docs/drafters.md, "MTP layers").

The published forward (vLLM's `qwen3_next_mtp`, SGLang's, transformers' `MtpLayer`): the
embedding of the next token and the target's last hidden state (its final norm's output),
each through its own RMSNorm (`pre_fc_norm_embedding`, `pre_fc_norm_hidden`), side by side
(embedding first), projected back to the hidden width (`fc`), one decoder layer of the target's
full-attention kind (gated query, q/k norms, partial rotary), its norm (`norm`), the target's
head. Row p of its cache pairs the target's state at p with the token at p + 1 and predicts
the token at p + 2; a further draft step feeds the layer its own last output (after `norm`) as
the state, with the token it just proposed. That is an EAGLE-3 head's contract
(export/eagle3.py): the graph takes the target's states (AUX_HIDDEN, H wide) or its own
(DRAFT_HIDDEN; the other input zeros, and the two are added), returns its output
(DRAFT_HIDDEN_OUT), and the EAGLE-3 drafter drives it. Positions are the state's (p), as vLLM
feeds them; transformers' candidate generator gives the token's (p + 1): RoPE depends on
differences of positions only, so both attend alike (tests/test_mtp.py checks it against
transformers' module to float tolerance).

The layer is read from the target's own checkpoint files; a checkpoint without one, a .gguf
file, more than one MTP layer, or a tensor missing or of another shape is refused in one line.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from specdeploy.core.errors import ExportError
from specdeploy.core.graph_io import AUX_HIDDEN, DRAFT_HIDDEN, DRAFT_HIDDEN_OUT, graph_facts
from specdeploy.core.manifest import ModelSpec

from .architectures import FULL
from .graph import SpecGraph
from .load import Source

GRAPH_FILE = "draft.onnx"
PREFIX = "mtp."
FAMILIES = ("qwen3_5_text",)  # the families whose MTP layer is implemented


def read_weights(source: Source) -> dict[str, torch.Tensor]:
    """The checkpoint's `mtp.*` tensors in float32, keyed without the prefix."""
    from safetensors import safe_open

    path = Path(source.path)
    if path.suffix == ".gguf":
        raise ExportError(f"--draft mtp: {path}: a .gguf file; the MTP layer is read from a Hugging Face checkpoint's "
                          "safetensors (mtp.* tensors); export from the model folder, or choose another draft")
    found: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.startswith(PREFIX):
                    found[key[len(PREFIX):]] = f.get_tensor(key).float()
    if not found:
        raise ExportError(f"--draft mtp: {path} holds no mtp.* tensors (this checkpoint ships no multi-token-prediction "
                          "layer); choose another draft: a model, self:layers=N, ngram or suffix")
    return found


class MtpInput(nn.Module):
    """What the layer reads: the token's embedding and the state, each normed, side by side, projected."""

    def __init__(self, hidden: int, eps: float, norm_cls: type):
        super().__init__()
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)


@dataclass
class Mtp:
    path: Path
    model: nn.Module  # a one-layer causal LM of the target's family: the MTP layer and norm, the target's embedding and head
    input: MtpInput

    @property
    def config(self):
        return self.model.config


def load_mtp(source: Source) -> Mtp:
    """The target checkpoint's MTP layer as a one-layer model of its family, checked tensor by tensor."""
    cfg = source.config
    if cfg.model_type not in FAMILIES:
        raise ExportError(f"--draft mtp: {source.path} is a {cfg.model_type} model; the MTP draft is implemented for "
                          f"{', '.join(FAMILIES)}")
    weights = read_weights(source)
    layers = sorted({int(k.split(".")[1]) for k in weights if k.startswith("layers.") and k.split(".")[1].isdigit()})
    if len(layers) > 1:
        raise ExportError(f"--draft mtp: {source.path} has {len(layers)} MTP layers (mtp.layers.{layers}); one is "
                          "implemented (each further layer chains on the one before)")
    one = copy.deepcopy(cfg)
    one.num_hidden_layers = 1
    one.layer_types = [FULL]
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(one).eval()
    base = source.model.model
    model.model.embed_tokens, model.lm_head, model.model.rotary_emb = base.embed_tokens, source.model.lm_head, base.rotary_emb
    with torch.device("meta"):
        inputs = MtpInput(cfg.hidden_size, cfg.rms_norm_eps, type(base.norm))
    wanted = {f"layers.0.{k}": v for k, v in model.model.layers[0].state_dict().items()}
    wanted["norm.weight"] = model.model.norm.weight
    wanted.update(inputs.state_dict())
    for key, tensor in wanted.items():
        if key not in weights:
            raise ExportError(f"--draft mtp: {source.path}: tensor {PREFIX}{key} is missing (a {cfg.model_type} MTP layer "
                              f"of full attention has {len(wanted)} tensors)")
        if tuple(weights[key].shape) != tuple(tensor.shape):
            raise ExportError(f"--draft mtp: {source.path}: tensor {PREFIX}{key} has shape {list(weights[key].shape)}, "
                              f"expected {list(tensor.shape)}")
    extra = sorted(set(weights) - set(wanted))
    if extra:
        raise ExportError(f"--draft mtp: {source.path}: tensor {PREFIX}{extra[0]} is not part of a {cfg.model_type} MTP "
                          f"layer of full attention (what this export reads: {PREFIX}fc, {PREFIX}pre_fc_norm_*, "
                          f"{PREFIX}layers.0.*, {PREFIX}norm)")
    model.model.layers[0].load_state_dict({k[len("layers.0."):]: v for k, v in weights.items() if k.startswith("layers.0.")},
                                          assign=True)
    model.model.norm.load_state_dict({"weight": weights["norm.weight"]}, assign=True)
    inputs.load_state_dict({k: weights[k] for k in inputs.state_dict()}, assign=True)
    return Mtp(Path(source.path), model, inputs.eval())


class MtpGraph(SpecGraph):
    """The MTP layer as a graph of the contract (export/graph.py), over one KV buffer pair:

        aux_hidden_states [B, T, H]  the target's final states for rows it computed (else zeros)
        draft_hidden      [B, T, H]  the layer's own last output for a row it drafts (else zeros)
     -> logits [B, R, V], present_key_0 / present_value_0, draft_hidden_out [B, R, H]

    The decoder layer is the family's (SpecGraph's own attention and MLP, exact as for the target)."""

    def __init__(self, model: nn.Module, inputs: MtpInput, inplace: bool = False):
        super().__init__(model, inplace=inplace)
        self.input = inputs
        hidden = model.config.hidden_size
        self.feature_inputs = {AUX_HIDDEN: hidden, DRAFT_HIDDEN: hidden}
        self.feature_outputs = {DRAFT_HIDDEN_OUT: hidden}

    def forward(self, input_ids, position_ids, write_indices, attention_mask, past: list[torch.Tensor],
                logits_rows: torch.Tensor, aux_hidden_states: torch.Tensor, draft_hidden: torch.Tensor):
        inputs = self.input
        embedded = self.embed_tokens(input_ids)
        state = (aux_hidden_states + draft_hidden).to(embedded.dtype)  # one of the two is zeros
        h = inputs.fc(torch.cat([self._rms(inputs.pre_fc_norm_embedding, embedded),
                                 self._rms(inputs.pre_fc_norm_hidden, state)], dim=-1))
        masks = {None: attention_mask[:, :, None].to(h.dtype)}
        x, caches, _ = self.decode(h, None, position_ids, write_indices, attention_mask, masks, past)
        x = x.index_select(1, logits_rows)
        return (self.lm_head(x).float(), *caches, x.float())


class MtpReference(nn.Module):
    """The published forward, written out over K/V kept as tensors: every row of a sequence at
    once (the parity reference, as Eagle3Head.forward is an EAGLE-3 head's)."""

    def __init__(self, mtp: Mtp):
        super().__init__()
        cfg = mtp.config
        self.cfg = cfg
        self.layer, self.norm = mtp.model.model.layers[0], mtp.model.model.norm
        self.input = mtp.input
        self._shared = [mtp.model.model.embed_tokens, mtp.model.lm_head, mtp.model.model.rotary_emb]  # not submodules

    def forward(self, ids, hidden, position_ids, past=None):
        """ids [B, T] (the token after each row's state), hidden [B, T, H], position_ids [B, T];
        past: (keys, values) of the rows before, or None -> (out [B, T, H], logits [B, T, V],
        (keys, values) with these rows appended)."""
        from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

        embed, head, rotary = self._shared
        cfg, layer, inputs = self.cfg, self.layer, self.input
        x = inputs.fc(torch.cat([inputs.pre_fc_norm_embedding(embed(ids)), inputs.pre_fc_norm_hidden(hidden)], dim=-1))
        b, t, _ = x.shape
        d, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        attn, y = layer.self_attn, layer.input_layernorm(x)
        q, gate = attn.q_proj(y).view(b, t, heads, 2 * d).chunk(2, dim=-1)
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(y).view(b, t, kv_heads, d)).transpose(1, 2)
        v = attn.v_proj(y).view(b, t, kv_heads, d).transpose(1, 2)
        cos, sin = rotary(y, position_ids)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        s = k.shape[2]
        groups = heads // kv_heads
        scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * d**-0.5
        scores = scores + torch.full((t, s), float("-inf")).triu(s - t + 1)
        out = torch.softmax(scores.float(), -1) @ v.repeat_interleave(groups, 1)
        out = out.transpose(1, 2).reshape(b, t, heads * d) * torch.sigmoid(gate.reshape(b, t, heads * d))
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        out = self.norm(x)
        return out, head(out).float(), (k, v)


def mtp_graph(mtp: Mtp, dtype: str) -> MtpGraph:
    """The graph module at `dtype`: fp32 over the checkpoint's floats; int8/int4 quantize a copy's
    projections (the layer's, fc, the head as the target's exact scheme does: int8), and int4 the
    token embedding it reads (4-bit blocks: the graph's copy of the table an eighth of its floats)."""
    from .blocks import quantize_float
    from .quantize import SCHEMES, QuantEmbedding, QuantLinear, _key, quantize_model

    model, inputs, record = mtp.model, mtp.input, None
    if dtype in SCHEMES:
        model, inputs = copy.deepcopy(model), copy.deepcopy(inputs)
        record = quantize_model(model, dtype, None, 1, "exact")
        weight = inputs.fc.weight.detach().numpy()
        if weight.shape[1] % 32:
            raise ExportError(f"--draft mtp: fc input dimension {weight.shape[1]} is not a multiple of the 32-weight "
                              "block; use --draft-dtype fp32")
        blocks = quantize_float(weight, SCHEMES[dtype], "min")
        inputs.fc = QuantLinear(blocks, None)
        key = _key(blocks)
        record["tensors"] = dict(sorted({**record["tensors"], key: record["tensors"].get(key, 0) + 1}.items()))
        record["quantized_from_float"] += 1
        if SCHEMES[dtype] == 4:  # the embedding it reads in 4-bit blocks, as an EAGLE-3 head's: a draft only proposes
            model.model.embed_tokens = QuantEmbedding.of(model.model.embed_tokens.weight)
            record["embedding"] = "int4"
    elif dtype != "fp32":
        raise ExportError(f"--draft-dtype {dtype} with --draft mtp: use fp32, int8 or int4")
    graph = MtpGraph(model, inputs).eval()
    graph.quantization = record
    return graph


def export_mtp(mtp: Mtp, target: Source, dtype: str, *, work: Path, max_seq: int, max_draft: int, prefill_chunk: int,
               log: Callable[[str], None], device: str = "cpu") -> ModelSpec:
    """The MTP layer's graph and manifest entry, written into `work`, checked against the eager
    graph module and (fp32) against MtpReference."""
    from .build import model_entry
    from .eagle3_export import check_head_parity, head_parity_line
    from .onnx_export import export_onnx

    if device != "cpu":
        raise ExportError(f"--for {device} with --draft mtp: its target keeps recurrent states, which only ONNX "
                          "Runtime's CPU provider keeps yet; use --for cpu")
    t0 = time.perf_counter()
    graph = mtp_graph(mtp, dtype)
    spec = model_entry(graph, target, "draft", GRAPH_FILE, dtype, max_seq).replace(attention="exact",
                                                                                    parameters=mtp_parameters(mtp))
    export_onnx(graph, work / GRAPH_FILE, max_seq, getattr(torch, spec.kv_dtype), optimize=graph.quantization is None,
                facts=graph_facts(spec), max_batch=2)
    log(f"  draft: exported the checkpoint's MTP layer ({dtype}) in {time.perf_counter() - t0:.1f}s; checking parity")
    parity = check_head_parity(graph, MtpReference(mtp), work / GRAPH_FILE, spec, max_seq, max_draft, prefill_chunk,
                               dtype)
    log(head_parity_line(parity))
    return spec.replace(parity=parity)


def rebuild_mtp(spec: ModelSpec) -> MtpGraph:
    """The MTP layer's graph module as export made it (what the torch backend runs), from the
    target checkpoint the manifest names, checked against its sha256 and parameter count."""
    from specdeploy.core.errors import BundleError

    from .load import check_recorded_source, load_source

    check_recorded_source(spec.source, spec.source_sha256, "MTP layer's checkpoint")
    try:
        mtp = load_mtp(load_source(spec.source))
    except ExportError as e:
        raise BundleError(f"the torch backend rebuilds the MTP layer: {e}") from None
    if mtp_parameters(mtp) != spec.parameters:
        raise BundleError(f"{spec.source}: the MTP layer's parameter count differs from the manifest's; re-export the bundle")
    return mtp_graph(mtp, spec.dtype)


def mtp_parameters(mtp: Mtp) -> int:
    """The layer's own weights (it reads the target's embedding and head)."""
    own = [mtp.model.model.layers[0], mtp.model.model.norm, mtp.input]
    return sum(p.numel() for m in own for p in m.parameters())


__all__ = ["FAMILIES", "GRAPH_FILE", "Mtp", "MtpGraph", "MtpReference", "export_mtp", "load_mtp", "mtp_graph",
           "read_weights", "rebuild_mtp"]
