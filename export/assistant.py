"""The Gemma 4 assistant as a draft (docs/drafters.md, "Gemma 4 assistants"): its graph, its
checks against the target, and the parity check against the published forward.

The assistant keeps no K/V of its own. Every one of its layers attends, from one position (the
last committed token's), over K/V the target wrote: the target's last K/V-keeping layer of the
layer's type (`full_attention`, `sliding_attention`), read in the target's own buffers. Its
input is the target's embedding of that token (scaled as the target scales it) beside the
target's last hidden state (the final norm's output at the row before: the row that predicted
the token), projected down (`pre_projection`); each later step feeds its own state projected
back up (`post_projection`) with the token it just drafted, at the same position. Its logits
come from its own head, or, with `use_ordered_embeddings`, from the head's rows of the
`centroid_intermediate_top_k` clusters its centroids score highest (every other token gets
the smallest of those logits minus one, as in the published forward).

What it reads of the target's K/V at position p (Hugging Face's candidate generator, checked
token for token by tests/test_assistant.py): full layers the slots 0..p-1, sliding layers the
last `sliding_window` + 1 of them (its bidirectional window mask, flipped to look back).
"""
from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from specdeploy.core.errors import ExportError
from specdeploy.core.graph_io import ASSISTANT_HIDDEN, ASSISTANT_STATE
from specdeploy.core.manifest import ModelSpec

from .graph import SpecGraph
from .load import Source, source_digest
from .ops import OPSET, onnx_translations

GRAPH_FILE = "draft.onnx"
MODEL_TYPE = "gemma4_assistant"
HIDDEN_IN, STATE_OUT = ASSISTANT_HIDDEN, ASSISTANT_STATE
KINDS = ("full_attention", "sliding_attention")


def is_assistant_folder(path: Path) -> bool:
    """A folder whose config.json says it is a Gemma 4 assistant."""
    config = Path(path) / "config.json"
    try:
        found = json.loads(config.read_text()) if config.is_file() else None
    except (OSError, ValueError, RecursionError):  # not an assistant's config: the model loader says what it is
        return False
    return isinstance(found, dict) and found.get("model_type") == MODEL_TYPE


def kv_names(pairs: list[int]) -> list[str]:
    """The graph's inputs for the target's KV pairs it reads: key then value of each."""
    return [f"target_{part}_{j}" for j in pairs for part in ("key", "value")]


@dataclass
class Assistant:
    path: Path
    model: Any  # Gemma4AssistantForCausalLM, float32, eval mode
    reads: list[int]  # the target's KV pair each of the assistant's layer types reads, in KINDS order
    kinds: list[str]  # those layer types

    @property
    def config(self):
        return self.model.config

    @property
    def text_config(self):
        return self.model.config.get_text_config()


def target_pairs(target_config) -> dict[str, int]:
    """{layer type: the KV pair (index into the target's buffers) its last K/V-keeping layer
    writes}: what Hugging Face hands an assistant as `shared_kv_states`."""
    pairs, kept = {}, 0
    modes = target_config.kv_sharing_modes[: target_config.num_hidden_layers]
    for kind, mode in zip(target_config.layer_types, modes):
        if mode != "reuse":
            pairs[kind] = kept
            kept += 1
    return pairs


def load_assistant(path: Path, target_config) -> Assistant:
    """The assistant at `path`, checked against the target it will draft for; each mismatch is
    one line naming the field."""
    import transformers
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    path = Path(path)
    if not is_assistant_folder(path):
        raise ExportError(f"--draft assistant:{path}: not a Gemma 4 assistant folder (config.json with model_type "
                          f"{MODEL_TYPE!r})")
    if getattr(target_config, "model_type", None) != "gemma4_text":
        raise ExportError(f"--draft assistant:{path}: a Gemma 4 assistant drafts for a Gemma 4 text model; the target "
                          f"is {getattr(target_config, 'model_type', '?')!r}")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, StrictDataclassError) as e:
        why = " ".join(line.strip() for line in str(e).splitlines()[:2])
        raise ExportError(f"{path}: cannot read the assistant's config ({why})") from None
    text = config.get_text_config()
    text.allow_global_per_layer_attribute_access = True
    where = f"{path}/config.json"
    checks = [
        ("backbone_hidden_size", config.backbone_hidden_size, target_config.hidden_size),
        ("text_config.vocab_size", text.vocab_size, target_config.vocab_size),
    ]
    for field, got, want in checks:
        if got != want:
            raise ExportError(f"{where}: {field} is {got}; the target's is {want} (an assistant drafts for the model it "
                              "was trained with)")
    if config.use_ordered_embeddings and text.vocab_size % config.num_centroids:
        raise ExportError(f"{where}: num_centroids {config.num_centroids} does not divide vocab_size {text.vocab_size}")
    if config.use_ordered_embeddings and not 1 <= config.centroid_intermediate_top_k <= config.num_centroids:
        raise ExportError(f"{where}: centroid_intermediate_top_k {config.centroid_intermediate_top_k}: expected "
                          f"1..{config.num_centroids} (num_centroids)")
    pairs = target_pairs(target_config)
    kinds = [kind for kind in KINDS if kind in text.layer_types[: text.num_hidden_layers]]
    for i, kind in enumerate(text.layer_types[: text.num_hidden_layers]):
        if kind not in KINDS:
            raise ExportError(f"{where}: text_config.layer_types[{i}] is {kind!r}; expected one of {', '.join(KINDS)}")
        if kind not in pairs:
            raise ExportError(f"{where}: layer {i} is {kind}, a type no layer of the target keeps K/V for")
        producer = [j for j, m in enumerate(target_config.kv_sharing_modes) if m == "store"
                    and target_config.layer_types[j] == kind]
        source = target_config.per_layer_config[producer[-1]] if producer else target_config
        mine = text.per_layer_config[i]
        for field in ("num_key_value_heads", "head_dim"):
            if getattr(mine, field) != getattr(source, field):
                raise ExportError(f"{where}: layer {i} ({kind}) has {field} {getattr(mine, field)}; the target's K/V "
                                  f"it reads has {getattr(source, field)}")
    transformers.utils.logging.set_verbosity_error()
    try:
        model = transformers.Gemma4AssistantForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                                         local_files_only=True).eval()
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        why = " ".join(line.strip() for line in str(e).splitlines()[:2])
        raise ExportError(f"{path}: cannot load the assistant's weights ({why[:200]})") from None
    return Assistant(path, model, [pairs[kind] for kind in kinds], kinds)


class _Wrapped(nn.Module):
    """The assistant's decoder in the shape SpecGraph borrows from (config, model, lm_head)."""

    def __init__(self, assistant: Assistant):
        super().__init__()
        config = copy.deepcopy(assistant.text_config)
        # SpecGraph reads the layers' attention shapes from the config; the sharing it would
        # derive (every layer reads another's K/V) is set by AssistantGraph, and its masks too
        config.num_kv_shared_layers = 0
        config.use_bidirectional_attention = None
        self.config = config
        self.model = assistant.model.model
        self.lm_head = assistant.model.lm_head


class AssistantGraph(nn.Module):
    """One draft step of the assistant: (token [1, 1], the target's state or its own [1, 1,
    backbone], position [1, 1], mask [1, 1, 1, L], the target's KV pairs it reads) ->
    (logits [1, 1, V], its state projected to the backbone's width [1, 1, backbone])."""

    def __init__(self, assistant: Assistant, target: Source, table_bits: int | None = None):
        """`table_bits` 4: the copy of the target's embedding table in 4-bit blocks, as a target
        exported with 4-bit embeddings computes its own (None: float32, as the source's)."""
        super().__init__()
        self.core = SpecGraph(_Wrapped(assistant))
        text = assistant.text_config
        n = text.num_hidden_layers
        slot = {kind: i for i, kind in enumerate(assistant.kinds)}
        self.core.kv_of_layer = [slot[kind] for kind in text.layer_types[:n]]
        self.core.keeps_kv = [False] * n
        self.core.kv_layout = [self.core.layer_dims[text.layer_types[:n].index(kind)] for kind in assistant.kinds]
        self.kinds = list(assistant.kinds)
        embed = target.model.model.embed_tokens  # the target's, scaled as its own forward scales it
        self.embed_scale = float(embed.scalar_embed_scale)
        self.embed_weight = embed.weight
        self.table = None
        if table_bits == 4:
            from .quantize import QuantEmbedding

            self.table = QuantEmbedding.of(embed.weight)
        self.pre_projection = assistant.model.pre_projection
        self.post_projection = assistant.model.post_projection
        self.lm_head = assistant.model.lm_head
        self.masked = assistant.model.masked_embedding  # None: the plain head
        self.vocab_size = text.vocab_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's embedding of `input_ids`, as the target's graph computes it."""
        if self.table is not None:  # 4-bit blocks: float32 rows
            return self.table(input_ids) * torch.tensor(self.embed_scale, dtype=torch.float32)
        weight = self.embed_weight
        return nn.functional.embedding(input_ids, weight) * torch.tensor(self.embed_scale, dtype=weight.dtype)

    def forward(self, input_ids, hidden, position_ids, attention_mask, past: list[torch.Tensor]):
        e = self.embed(input_ids)
        h = self.pre_projection(torch.cat((e, hidden.to(e.dtype)), dim=-1))
        mask = attention_mask[:, :, None].to(h.dtype)  # [1, 1, 1, 1, L]: the slots before the position
        masks = {None: mask}
        slots = torch.arange(mask.shape[-1], device=mask.device)
        behind = position_ids[:, None, None, :, None] - slots
        for window in dict.fromkeys(w for w in self.core.windows if w is not None):
            masks[window] = mask.masked_fill(behind > window + 1, float("-inf"))
        write = torch.zeros(1, dtype=torch.int64)  # nothing is written
        x, _, _ = self.core.decode(h, None, position_ids, write, attention_mask, masks, list(past))
        state = self.post_projection(x)
        return self._head(x).float(), state.float()

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if self.masked is None:
            return self.lm_head(x)
        m = self.masked
        top = torch.topk(m.centroids(x), k=m.centroid_intermediate_top_k, dim=-1).indices  # [1, 1, K]
        clusters = m.token_ordering.long().view(m.num_centroids, m.vocab_size_per_centroid)
        tokens = clusters[top].reshape(1, 1, -1)  # [1, 1, K * per cluster]
        rows = self.lm_head.weight[tokens[0, 0]]  # [K * per cluster, H]
        chosen = torch.matmul(x, rows.transpose(0, 1))  # [1, 1, K * per cluster]
        floor = chosen.min() - 1.0
        out = floor.expand(1, 1, self.vocab_size).contiguous()
        return out.scatter(-1, tokens, chosen)


def assistant_entry(assistant: Assistant, target_spec: ModelSpec, max_seq: int) -> ModelSpec:
    text, cfg = assistant.text_config, assistant.config
    kv = {name: [1, *target_spec.kv_shapes[2 * j][:1], max_seq, target_spec.kv_shapes[2 * j][1]]
          for name, j in zip(kv_names(assistant.reads), [j for j in assistant.reads for _ in (0, 1)])}
    return ModelSpec(
        role="draft", graph=GRAPH_FILE, source=str(Path(assistant.path).resolve()),
        source_sha256=source_digest(assistant.path), architecture=MODEL_TYPE, num_layers=text.num_hidden_layers,
        source_layers=text.num_hidden_layers, hidden_size=text.hidden_size, num_heads=text.num_attention_heads,
        num_kv_heads=text.num_key_value_heads, head_dim=text.head_dim, vocab_size=text.vocab_size, dtype="fp32",
        kv_dtype=target_spec.kv_dtype, sliding_window=getattr(text, "sliding_window", None),
        parameters=sum(p.numel() for p in assistant.model.parameters()),
        inputs={"input_ids": ["1", "1"], HIDDEN_IN: ["1", "1", cfg.backbone_hidden_size], "position_ids": ["1", "1"],
                "attention_mask": ["1", "1", "1", "L"], **kv},
        outputs={"logits": ["1", "1", text.vocab_size], STATE_OUT: ["1", "1", cfg.backbone_hidden_size]},
        reads_kv=tuple(assistant.reads),
    )


def export_graph(graph: AssistantGraph, path: Path, spec: ModelSpec, max_seq: int) -> None:
    import warnings

    import onnx

    from .onnx_export import INLINE_BYTES, _quiet_exporter, save_graph, weight_bytes

    names = kv_names(list(spec.reads_kv))
    past = [torch.zeros(spec.inputs[name], dtype=getattr(torch, spec.kv_dtype)) for name in names]
    example = (torch.zeros((1, 1), dtype=torch.int64), torch.zeros((1, 1, spec.inputs[HIDDEN_IN][2])),
               torch.tensor([[3]]), torch.zeros((1, 1, 1, 3)), past)
    dim_l = torch.export.Dim("L", min=1, max=max_seq)
    dynamic = {"input_ids": None, "hidden": None, "position_ids": None, "attention_mask": {3: dim_l},
               "past": [None] * len(names)}
    with warnings.catch_warnings(), _quiet_exporter():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(graph, example, input_names=["input_ids", HIDDEN_IN, "position_ids",
                                                                 "attention_mask", *names],
                                    output_names=["logits", STATE_OUT], opset_version=OPSET, dynamo=True,
                                    dynamic_shapes=dynamic, custom_translation_table=onnx_translations(),
                                    verbose=False, optimize=True)
    external = weight_bytes(graph) > INLINE_BYTES  # its copy of the target's table: 1.5 GiB at E2B
    program.save(path, external_data=external)
    if external:  # one weights file, named as every graph's is
        save_graph(onnx.load(str(path)), path, external)
    onnx.checker.check_model(str(path), full_check=True)


def check_assistant_parity(graph: AssistantGraph, assistant: Assistant, path: Path, spec: ModelSpec, max_seq: int,
                           seed: int = 0) -> dict:
    """Random target K/V and states through ONNX Runtime, the graph module, and the published
    forward (Gemma4AssistantForCausalLM with `shared_kv_states`) at positions inside and past the
    sliding window; the logits and states compared relative to their largest value."""
    from specdeploy.runtime.decoding.drafters.assistant import AssistantEngine
    from .onnx_export import PARITY_RTOL, _rel_diff, check_draft_parity

    rng = np.random.default_rng(seed)
    names = kv_names(list(spec.reads_kv))
    buffers = [rng.standard_normal(spec.inputs[name]).astype(spec.kv_dtype) for name in names]
    engine = AssistantEngine(path, spec, max_seq, buffers)
    window = spec.sliding_window or max_seq
    positions = sorted({p for p in (1, 2, min(window, max_seq - 1), min(window + 2, max_seq - 1), max_seq - 1)
                        if 1 <= p < max_seq})
    worst_ort = worst_ref = 0.0
    backbone = spec.inputs[HIDDEN_IN][2]
    with torch.no_grad():
        for p in positions:
            token = int(rng.integers(0, spec.vocab_size))
            hidden = rng.standard_normal(backbone).astype(np.float32)
            logits, state = graph(torch.tensor([[token]]), torch.from_numpy(hidden)[None, None],
                                  torch.tensor([[p]]), torch.zeros((1, 1, 1, p)),
                                  [torch.from_numpy(b) for b in buffers])
            logits, state = logits[0, 0].numpy(), state[0, 0].numpy()
            got_logits, got_state = engine.step(token, hidden, p)
            worst_ort = max(worst_ort, _rel_diff(got_logits.copy(), logits), _rel_diff(got_state.copy(), state))
            shared = {kind: (torch.from_numpy(buffers[2 * i][:, :, :p]).float(),
                             torch.from_numpy(buffers[2 * i + 1][:, :, :p]).float())
                      for i, kind in enumerate(assistant.kinds)}
            embed = graph.embed(torch.tensor([[token]]))  # the source's table, or its 4-bit blocks as the target's
            out = assistant.model(inputs_embeds=torch.cat((embed, torch.from_numpy(hidden)[None, None]), dim=-1),
                                  position_ids=torch.tensor([[p]]), shared_kv_states=shared, use_cache=False)
            worst_ref = max(worst_ref, _rel_diff(logits, out.logits[0, 0].numpy()),
                            _rel_diff(state, out.last_hidden_state[0, 0].numpy()))
    bound = PARITY_RTOL["fp32"]
    check_draft_parity(path.name, "the assistant's graph module", worst_ort, worst_ref, bound)
    return {"positions": positions, "max_rel_diff_ort_vs_eager": worst_ort, "max_rel_diff_eager_vs_reference": worst_ref,
            "bound": bound}


def check_choices(dtype: str, device: str) -> None:
    """The export choices an assistant's graph takes (export checks them before any work)."""
    if dtype != "fp32":
        raise ExportError(f"--draft-dtype {dtype} with a Gemma 4 assistant: its graph is exported in fp32 only (it is "
                          "small next to its target); leave --draft-dtype out or use fp32")
    if device != "cpu":
        raise ExportError(f"--for {device} with a Gemma 4 assistant: its graph runs on ONNX Runtime's CPU provider for "
                          "now; use --for cpu")


def export_assistant(assistant: Assistant, target: Source, target_spec: ModelSpec, dtype: str, *, work: Path,
                     max_seq: int, log: Callable[[str], None], device: str = "cpu", **_) -> ModelSpec:
    """The assistant's graph and manifest entry, written into `work`, checked for parity."""
    check_choices(dtype, device)
    t0 = time.perf_counter()
    bits = 4 if str((target_spec.quantization or {}).get("embedding", "")).startswith("int4") else None
    graph = AssistantGraph(assistant, target, bits).eval()
    spec = assistant_entry(assistant, target_spec, max_seq)
    export_graph(graph, work / GRAPH_FILE, spec, max_seq)
    table = graph.embed_weight.numel() * (4 if bits is None else 0.5 + 4 / 32) / 2**20  # 4-bit: a scale per 32
    log(f"  draft: exported the Gemma 4 assistant ({assistant.text_config.num_hidden_layers} layers reading the "
        f"target's K/V pairs {list(assistant.reads)}; its graph carries a {'4-bit' if bits else 'float32'} copy of "
        f"the target's embedding table, {table:.1f} MiB) in {time.perf_counter() - t0:.1f}s; checking parity")
    parity = check_assistant_parity(graph, assistant, work / GRAPH_FILE, spec, max_seq)
    log(f"  draft: parity ok (max relative difference {parity['max_rel_diff_ort_vs_eager']:.1e}; eager against the "
        f"published forward {parity['max_rel_diff_eager_vs_reference']:.1e})")
    return spec.replace(parity=parity)


__all__ = ["AssistantGraph", "GRAPH_FILE", "MODEL_TYPE", "export_assistant", "is_assistant_folder", "load_assistant"]
