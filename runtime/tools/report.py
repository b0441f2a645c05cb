"""Human-readable views of bundles and runs."""
from __future__ import annotations

from collections import Counter

from specdeploy.core.manifest import FORMAT, Bundle, graph_bytes, graph_files, mib, not_exact_line
from specdeploy.runtime.decoding.stats import Stats


def describe(bundle: Bundle) -> str:
    from specdeploy.runtime.decoding.drafters import drafter_class

    m = bundle.manifest
    lines = [
        f"bundle      {bundle.path}",
        f"digest      {bundle.digest} (pins the manifest and, through its checksums, every file)",
        f"format      {FORMAT} v{m.format_version}, {m.created_by}, {m.created_at or '?'}",
        f"sequence    max {m.max_seq} tokens (prompt + new), draft up to {m.max_draft} per round, "
        f"prefill chunk {m.prefill_chunk}",
        "batch       one sequence a session: batched passes keep no recurrent states per slot yet" if m.recurrent else
        f"batch       up to {m.max_batch} sequences a pass"
        + (" (serve batches)" if m.max_batch > 1 else " (exported before batched passes)"),
        f"memory      {m.kv_cost()}",
        f"draft       {m.draft.kind}: {drafter_class(m.draft.kind).describe(m.draft)}",
    ]
    for role, e in m.models.items():
        size, files = graph_bytes(bundle.path, e.graph), " + ".join(graph_files(bundle.path, e.graph))
        lines += [
            f"{role:<11} {files} ({mib(size)}): {e.architecture}, {e.num_layers}/{e.source_layers} layers, "
            f"hidden {e.hidden_size}, heads {e.num_heads} "
            + (f"(kv {e.num_kv_heads}) x {e.head_dim}, " if len(set(e.kv_shapes)) == 1 else "(kv and width by layer: KV below), ")
            + f"vocab {e.vocab_size}" + (f" (its head: {e.draft_vocab} draft tokens)" if e.draft_vocab else "")
            + f", {e.parameters / 1e6:.1f}M parameters, {e.dtype}",
            f"            KV: none of its own; reads the target's pairs {list(e.reads_kv)} where they lie"
            + (f", sliding window {e.sliding_window}" if e.sliding_window else "") if e.reads_kv is not None else
            f"            KV: {2 * e.num_kv_layers} buffers " + ", ".join(
                (f"{n} x " if len(set(e.kv_shapes)) > 1 else "") + f"[{'B' if m.max_batch > 1 else 1}, {heads}, "
                f"{m.max_seq}, {dim}]" for (heads, dim), n in Counter(e.kv_shapes).items()) + " "
            f"{e.kv_dtype}, written in place"
            + (f", sliding window {e.sliding_window}" if e.sliding_window else ""),
            *([f"            recurrent states: {len(e.state_names) // 2} linear-attention layers (Gated DeltaNet), "
               "each a convolution state " + str(list(e.state_shape(e.state_names[0][0])[1:])) + " and a recurrent "
               "state " + str(list(e.state_shape(e.state_names[1][0])[1:])) + " float32, returned after each row "
               "a pass returns logits for"] if e.state_names else []),
            "            attention: " + (
                "exact (verify rows equal single steps bit for bit)" if e.attention == "exact" else
                "fused (ONNX Runtime GroupQueryAttention; verify rows equal single steps up to rounding)"),
        ]
        q = e.quantization
        if q:
            tensors = ", ".join(f"{n} {k}" for k, n in q["tensors"].items())
            lines.append(
                f"            weights: {q['scheme']} {q.get('quant_scheme', 'exact')} scheme, blocks of {q['block_size']} "
                f"({'DequantizeLinear + MatMul' if 'dequantize_linear' in q else 'MatMulNBits'}, accuracy level "
                f"{q['accuracy_level']}), head int{q['head_bits']}, embedding {q['embedding']}; {tensors} "
                f"({q['imported_exactly']} imported exactly, {q['quantized_from_float']} quantized from float); "
                "the parameter count above is the float ones"
            )
            lines += [f"            {not_exact_line(entry)}" for entry in q.get("not_exact", [])]
        p = e.parity
        if p:
            src = p.get("max_rel_diff_eager_vs_source")
            published = p.get("max_rel_diff_eager_vs_reference")  # an EAGLE-3 head
            ort_diff = p["max_rel_diff_ort_vs_eager"]
            lines.append(
                "            parity: ONNX Runtime vs eager "
                + (f"{ort_diff:.1e}" if ort_diff is not None else "not run (no bfloat16 CPU kernels)")
                + (f", eager vs source {src:.1e}" if src is not None else "")
                + (f", eager vs the published forward {published:.1e}" if published is not None else "")
                + f" (bound {p['bound']:.2g}, relative to the largest logit"
                + (", float16 KV)" if e.kv_dtype == "float16" and e.dtype != "fp16" else ")")
            )
        lines.append(f"            source: {e.source}")
    tok = m.tokenizer
    lines.append(
        f"tokenizer   {tok.file}, EOS ids {tok.eos_token_ids}, chat template {'yes' if tok.chat_template else 'no'}"
    )
    lines.append(f"files       {len(m.files)} with sha256: {', '.join(m.files)}")
    return "\n".join(lines)


MIN_PAIRS = 3  # fewer alternating pairs than this tell nothing about a speedup on a shared machine


def summary(spec: list[Stats], plain: list[Stats], identical: bool) -> str:
    """Medians over runs of one prompt, speculative and plain alternating. The speedup is the
    median of the per-pair ratios of decode-only tokens/s (first round's end to the last
    token), stated only when every pair lies on the same side of 1.0: otherwise the ratios are
    the machine's noise, and the line says so, and how little speculation had to work with.
    """
    from statistics import median

    def line(name: str, runs: list[Stats]) -> str:
        return (f"{name:<12} {runs[0].new_tokens} tokens: decoding {median(r.decode_tokens_per_second for r in runs):.1f} tok/s, "
                f"whole request {median(r.tokens_per_second for r in runs):.1f} tok/s "
                f"(first token {median(r.first_token_seconds for r in runs) * 1000:.0f} ms)")

    last = spec[-1]
    return "\n".join(
        [
            line("speculative", spec),
            line("plain", plain),
            speedup_line(spec, plain),
            f"acceptance   {last.acceptance_rate:.1%} of {last.drafted} drafted tokens; "
            f"{last.mean_accepted:.2f} tokens per target pass ({last.target_passes} passes)",
            f"identical    {'yes: token for token, every run' if identical else 'NO: outputs differ'}",
        ]
    )


def speedup_line(spec: list[Stats], plain: list[Stats]) -> str:
    """The speedup line of `summary`: stated only when every alternating pair lies on the same
    side of 1.0 and the median is one speculation could have made. A round commits its
    tokens in one target pass that costs at least a plain step, so decoding cannot gain more
    than the tokens committed per pass: a ratio above that is the machine's noise.

    >>> from specdeploy.runtime.decoding.stats import Stats
    >>> def run(seconds, passes=11):
    ...     s = Stats(); s.new_tokens, s.seconds, s.first_token_seconds, s.first_round_tokens = 33, seconds, 0.0, 1
    ...     s.target_passes = passes
    ...     return s
    >>> print(speedup_line([run(1.0), run(1.0), run(1.0)], [run(1.5), run(1.4), run(1.6)]))
    speedup      1.50x decoding (median of 3 alternating pairs, every one faster: 1.50, 1.40, 1.60)
    >>> print(speedup_line([run(1.0, 32)] * 3, [run(1.2), run(1.1), run(1.3)]))  # 1.03 tokens a pass
    speedup      none measurable (median of 3 alternating pairs 1.20x: 1.20, 1.10, 1.30): 1.03 tokens per target pass allow at most 1.03x; the rest is this machine's timing noise
    """
    from statistics import median

    ratios = [s.decode_tokens_per_second / p.decode_tokens_per_second for s, p in zip(spec, plain) if p.decode_tokens_per_second]
    if not ratios:
        return "speedup      not measured (no timed pair decoded past its first token)"
    m, shown = median(ratios), ", ".join(f"{r:.2f}" for r in ratios)
    of = f"median of {len(ratios)} alternating pairs"
    per_pass = median(s.mean_accepted for s in spec)  # tokens committed per target pass
    if len(ratios) < MIN_PAIRS:
        why = f"at least {MIN_PAIRS} pairs are needed to tell"
    elif min(ratios) > 1.0 and m <= per_pass:
        return f"speedup      {m:.2f}x decoding ({of}, every one faster: {shown})"
    elif max(ratios) < 1.0:
        return f"slowdown     {m:.2f}x decoding ({of}, every one slower: {shown})"
    elif m > per_pass:
        why = f"{per_pass:.2f} tokens per target pass allow at most {per_pass:.2f}x; the rest is this machine's timing noise"
    else:
        why = f"the pairs fall on both sides of 1.0 ({per_pass:.2f} tokens per target pass)"
    return f"speedup      none measurable ({of} {m:.2f}x: {shown}): {why}"
