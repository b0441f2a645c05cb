"""Tiny models the tests build themselves: a byte-level BPE tokenizer and random
Llama / Qwen2 / Mistral configs a few layers deep, saved as Hugging Face folders."""
from __future__ import annotations

from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Speculative decoding drafts tokens cheaply and verifies them in one pass.",
    "Zürich, Köln and Málaga are cities; 東京 is Tokyo. Emoji: 🚀🙂",
    "Summaries keep the key facts: who, what, where, when and why.",
]

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Speculative decoding",
    "Zürich and Köln",
    "Summaries keep the key facts",
    "print(add(2, 3))",
    "jumps over the lazy dog. The quick",
    "who, what, where",
    "Emoji: 🚀",
    "a",
    "The lazy dog drafts tokens cheaply and verifies them in one pass, then the fox jumps over it again and again.",
    "return a + b",
    "cities; 東京 is Tokyo.",
    "one pass. one pass. one pass.",
    "The The The The",
    "verifies them",
    "brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick brown",
    "Málaga",
    "key facts: who, what",
    "\n\nprint(",
]

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(folder: Path, vocab_size: int = 320, corpus: list[str] = CORPUS):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def make_model(folder: Path, arch: str = "llama", seed: int = 0, layers: int = 3, vocab_size: int = 320, **overrides):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}.get(arch) \
        or getattr(transformers, FAMILY_CONFIGS[arch])
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.08,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    kwargs.update(FAMILY_DEFAULTS.get(arch, {}))
    if arch == "qwen3_5_text":  # linear and full layers alternating, the first and the last linear
        kwargs["layer_types"] = [("linear" if i % 2 == 0 or i == layers - 1 else "full") + "_attention"
                                 for i in range(layers)]
    if arch == "gemma4_text":  # sliding and full layers alternating, the last full; from 3 layers on the last
        kwargs["layer_types"] = [("full" if (layers - i) % 2 else "sliding") + "_attention" for i in range(layers)]
        kwargs["num_kv_shared_layers"] = 1 if layers >= 3 else 0  # reads the K/V of the full layer before it
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**kwargs)).eval()
    for layer in model.model.layers if arch == "gemma4_text" else ():  # ones at init: the graph must show it scales
        layer.layer_scalar.data.uniform_(0.5, 1.5)
        if getattr(layer, "router", None) is not None:
            layer.router.scale.data.uniform_(0.5, 1.5)
            layer.router.per_expert_scale.data.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    make_tokenizer(folder, vocab_size)
    return model


# The families added after Llama / Qwen2 / Mistral: their config classes, and small defaults
# where the family's own are large (Gemma's 256-wide heads) or its quirks should show at once
# (a head_dim that is not hidden / heads, soft-capping on, windows shorter than a test's text).
FAMILY_CONFIGS = {"qwen3": "Qwen3Config", "phi3": "Phi3Config", "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig",
                  "smollm3": "SmolLM3Config", "gpt_oss": "GptOssConfig", "gemma4_text": "Gemma4TextConfig",
                  "qwen3_5_text": "Qwen3_5TextConfig"}
FAMILY_DEFAULTS = {
    "qwen3": dict(head_dim=24),
    "phi3": dict(sliding_window=None),
    "gemma2": dict(head_dim=24, query_pre_attn_scalar=20, sliding_window=24, attn_logit_softcapping=5.0,
                   final_logit_softcapping=4.0, hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(head_dim=24, query_pre_attn_scalar=20, sliding_window=24, sliding_window_pattern=2,
                        rope_theta=40000.0, rope_local_base_freq=1000.0, hidden_activation="gelu_pytorch_tanh"),
    # every second layer without positions (3 layers: rope, none, rope), those sliding
    "smollm3": dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=24),
    # 8 experts, 2 a token, 32 wide (the experts' intermediates side by side: 256); sliding and
    # full layers alternating, yarn rope (the family's default), attention biases and sinks
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=24),
    # Gated DeltaNet layers with 2 key heads, 6 value heads (3 a key head; the attention has 4),
    # 8-wide keys and 16-wide values (96 in all: int4 blocks of 32 divide the output
    # projection's input); attention heads 24 wide (not hidden / heads) with RoPE over a quarter
    # of each (the family's partial_rotary_factor)
    "qwen3_5_text": dict(head_dim=24, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
                         linear_value_head_dim=16, linear_conv_kernel_dim=4),
    # every feature of the text model the graph reproduces at once: sliding (16-wide heads, 2 of
    # them) and full layers (32-wide, 1 head, v = k, proportional rope over a quarter); the last
    # layers reading the K/V of the last earlier layer of their type; their MLP twice as wide;
    # per-layer inputs; a final soft-cap; an experts block beside each MLP (2 of 4 experts a token);
    # layer scalars and router scales other than 1 (make_model sets them)
    "gemma4_text": dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                        hidden_size_per_layer_input=32, vocab_size_per_layer_input=320,
                        use_double_wide_mlp=True, final_logit_softcapping=30.0, sliding_window=24,
                        hidden_activation="gelu_pytorch_tanh", enable_moe_block=True, num_experts=4, top_k_experts=2,
                        moe_intermediate_size=32),
}


def make_eagle3_head(folder: Path, target: Path, draft_vocab: int = 96, seed: int = 0, layers: list[int] | None = None,
                     weights: str = "model.safetensors", scale: float = 0.08, head_scale: float = 10.0, **config):
    """A random EAGLE-3 head for the tiny model folder `target`, in the published layout:
    config.json (LlamaForCausalLMEagle3) and its weights, d2t over a random draft vocabulary."""
    import json

    import torch
    from transformers import AutoConfig

    t = AutoConfig.from_pretrained(target)
    h, heads, kv = t.hidden_size, t.num_attention_heads, t.num_key_value_heads
    d = getattr(t, "head_dim", None) or h // heads
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d,
        "intermediate_size": t.intermediate_size, "vocab_size": t.vocab_size, "draft_vocab_size": draft_vocab,
        "rms_norm_eps": 1e-6, "rope_theta": getattr(t, "rope_theta", 10000.0), "max_position_embeddings": 512,
        "hidden_act": "silu", "tie_word_embeddings": False,
    }
    if layers is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
    cfg.update(config)
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * scale  # noqa: E731
    v = cfg["vocab_size"]
    ids = torch.randperm(v, generator=g)[:draft_vocab].sort().values
    tensors = {
        "fc.weight": rand(h, 3 * h),
        "midlayer.hidden_norm.weight": 1 + rand(h), "midlayer.input_layernorm.weight": 1 + rand(h),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h),
        "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * h), "midlayer.self_attn.k_proj.weight": rand(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv * d, 2 * h), "midlayer.self_attn.o_proj.weight": rand(h, heads * d),
        "midlayer.mlp.gate_proj.weight": rand(t.intermediate_size, h), "midlayer.mlp.up_proj.weight": rand(t.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": rand(h, t.intermediate_size),
        "norm.weight": 1 + rand(h), "lm_head.weight": rand(draft_vocab, h) * head_scale,
        "d2t": ids - torch.arange(draft_vocab), "t2d": torch.zeros(v, dtype=torch.bool).index_fill_(0, ids, True),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    if weights.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(tensors, str(folder / weights))
    else:
        torch.save(tensors, folder / weights)
    return folder


def make_gemma4_assistant(folder: Path, target: Path, seed: int = 0, layers: int = 2, ordered: bool = True,
                          hidden_size: int = 48, sliding_window: int = 8, **overrides):
    """A random Gemma 4 assistant for the tiny Gemma 4 folder `target`, in the published layout
    (Gemma4AssistantForCausalLM's config.json and weights): its layers alternating sliding and
    full, each shaped like the target's K/V it reads; with `ordered`, a centroid-masked head
    over a random token ordering (the published assistants' use_ordered_embeddings)."""
    import torch
    import transformers
    from transformers import AutoConfig

    t = AutoConfig.from_pretrained(target)
    full = t.per_layer_config[t.layer_types.index("full_attention")]
    text = dict(t.to_dict(), global_head_dim=full.head_dim, num_global_key_value_heads=full.num_key_value_heads)
    for key in ("architectures", "model_type", "transformers_version", "per_layer_config", "dtype", "torch_dtype",
                "layer_types", "num_kv_shared_layers"):
        text.pop(key, None)
    text.update(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=layers,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, use_double_wide_mlp=False,
                enable_moe_block=False, sliding_window=sliding_window, final_logit_softcapping=None,
                layer_types=[("sliding" if i % 2 == 0 else "full") + "_attention" for i in range(layers)])
    text.update(overrides)
    text_config = transformers.Gemma4TextConfig(**text)
    config = transformers.Gemma4AssistantConfig(
        text_config=text_config, backbone_hidden_size=t.hidden_size, use_ordered_embeddings=ordered,
        num_centroids=16, centroid_intermediate_top_k=4)
    torch.manual_seed(seed)
    model = transformers.Gemma4AssistantForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.layer_scalar.data.uniform_(0.5, 1.5)
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(t.vocab_size))
    model.save_pretrained(folder)
    return model


VOCAB = 16  # the distribution tests' tiny models (conftest.py small_vocab)


def prompt_with_a_fair_draft(session):
    """A prompt [x, y, z, x, y]: the n-gram drafter proposes z, and the target gives z a
    middling probability, so both the accept and the reject paths carry real weight."""
    from specdeploy.runtime.decoding.sampling import SamplingParams, warp

    best, best_score = None, -1.0
    for x, y, z in np.random.default_rng(0).integers(3, VOCAB, size=(60, 3)):
        prompt = [int(x), int(y), int(z), int(x), int(y)]
        session.target.forward(np.array(prompt), 0)
        p = warp(session.target.forward(np.array(prompt[-1:]), 4).copy(), SamplingParams(1.0))[0, z]
        if min(p, 1 - p) > best_score:
            best, best_score = prompt, min(p, 1 - p)
    return best
