"""Train an EAGLE-3 head for a target (`specdeploy distill --kind eagle3`).

    our prompts -> the target answers them (export/distill.py: the same answers, top-K
    log-probs at every answer token) -> teacher-forced target passes give its hidden states
    at the inputs of three layers for every row -> the draft vocabulary: the N tokens the
    target picks most -> the head (one layer, initialised from the target's last layer, its
    final norm and head rows) learns the target's next-but-one distributions from those
    states, unrolled over `ttt` steps that feed the head its own states as drafting does
    ("training-time test") -> the published layout (export/eagle3.py), loadable here and by
    other systems, with `distill.json` saying how it was made and what it reached.

Work goes to `<out>.work/`: answers and features in shards, then checkpoints; an interrupted
run resumes where it stopped and ends with the same weights.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from specdeploy.core.errors import ExportError

from .distill import (DistillSettings, _bar, _load_work_file, _not_ours, _read_settings, _save, _unlike, data_record,
                      generate_data, loss_fn, split_and_vocabulary, train_loop)
from .eagle3 import Eagle3Head, HeadConfig, default_layers
from .load import Source, load_source

RECORD = "distill.json"


@dataclass(frozen=True)
class HeadSettings(DistillSettings):
    """DistillSettings' answer generation, and the head's training. Defaults measured on
    SmolLM2-135M-Instruct (docs/drafters.md, "EAGLE-3 heads")."""

    draft_vocab: int = 8192
    tokens: int = 100_000
    steps: int = 900  # on SmolLM2's 100,000 tokens: 35.8% -> 42.5% -> 43.7% first-token agreement at 300/600/900
    batch: int = 8
    lr: float = 2e-3
    ttt: int = 3  # unrolled steps per row: the head learns from its own states, as it drafts (EAGLE-3: 7)
    decay: float = 0.8  # step i's loss weighs decay**i
    evaluate_every: int = 300  # held-out agreement per step, recorded as the training curve

    def check(self, source: Source) -> None:
        super().check(source)
        if not 1 <= self.ttt <= 8:
            raise ExportError(f"--ttt {self.ttt}: expected 1..8")
        if source.config.num_hidden_layers < 3:
            raise ExportError(f"{source.path}: an EAGLE-3 head reads three distinct layers; the target has "
                              f"{source.config.num_hidden_layers}")


# -- features: teacher-forced target passes ------------------------------------------------------

def features(source: Source, records: list[dict], layers: tuple[int, ...], batch: int = 8) -> list[torch.Tensor]:
    """Each record's states at the inputs of `layers`, side by side: [len, 3H] float16."""
    out: list[torch.Tensor | None] = [None] * len(records)
    order = sorted(range(len(records)), key=lambda i: records[i]["ids"].shape[0])
    model = source.model.model
    with torch.no_grad():
        for at in range(0, len(order), batch):
            picks = order[at : at + batch]
            width = max(records[i]["ids"].shape[0] for i in picks)
            ids = torch.zeros((len(picks), width), dtype=torch.long)
            mask = torch.zeros((len(picks), width), dtype=torch.long)
            for b, i in enumerate(picks):
                n = records[i]["ids"].shape[0]
                ids[b, :n], mask[b, :n] = records[i]["ids"], 1
            states = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            aux = torch.cat([states[layer] for layer in layers], dim=-1)
            for b, i in enumerate(picks):
                out[i] = aux[b, : records[i]["ids"].shape[0]].half().clone()
    return out


def feature_data(source: Source, data: list[dict], layers: tuple[int, ...], work: Path, progress: bool) -> None:
    """Adds "aux" to every record, one shard of features per 256 records (kept: resumable)."""
    per = 256
    bar = _bar(sum(r["ids"].shape[0] for r in data), "target states", "tok", progress)
    for shard, at in enumerate(range(0, len(data), per)):
        part = data[at : at + per]
        path = work / f"features-{shard:05d}.pt"
        aux = _load_work_file(path, work, "a features shard") if path.is_file() else None
        if aux is not None:
            _check_features(aux, part, path, work, len(layers) * source.config.hidden_size)
        if aux is None or len(aux) != len(part):
            aux = features(source, part, layers)
            _save(aux, path)
        for r, a in zip(part, aux):
            r["aux"] = a
        bar.update(sum(r["ids"].shape[0] for r in part))
    bar.close()


def _check_features(aux, part: list[dict], path: Path, work: Path, width: int) -> None:
    """A features shard in the form features() writes: a state row per id of its record (one
    for other records, a list of another length, is computed anew)."""
    if not isinstance(aux, list):
        raise _not_ours(path, work, "a features shard", f"a {type(aux).__name__}, not a list of states")
    if len(aux) != len(part):
        return
    for i, (a, r) in enumerate(zip(aux, part)):
        problem = _unlike(a, torch.empty((r["ids"].shape[0], width), dtype=torch.float16), f"states {i}")
        if problem:
            raise _not_ours(path, work, "a features shard", problem)


# -- the head --------------------------------------------------------------------------------------

def new_head(source: Source, vocab: torch.Tensor, layers: tuple[int, ...]) -> Eagle3Head:
    """A head for the target, initialised from it: its last layer's attention (on the state
    half of q/k/v) and MLP, its norms, its final norm, its head's rows of the vocabulary; fc
    passes the highest of the three states through."""
    cfg = source.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = getattr(cfg, "rope_theta", None) or 10000.0
    head_cfg = HeadConfig(
        hidden_size=cfg.hidden_size, target_hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads, head_dim=d, intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size, draft_vocab_size=int(vocab.shape[0]), rms_norm_eps=float(cfg.rms_norm_eps),
        rope_theta=float(theta), rope_scaling=getattr(cfg, "rope_scaling", None),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 2048)),
        hidden_act=getattr(cfg, "hidden_act", "silu"), aux_layers=tuple(layers))
    embed = source.model.model.embed_tokens
    head = Eagle3Head(head_cfg, embed)
    h = cfg.hidden_size
    last = source.model.model.layers[-1]
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.fc.weight[:, 2 * h :] = torch.eye(h)
        mine = head.midlayer
        for name in ("q_proj", "k_proj", "v_proj"):
            theirs = getattr(last.self_attn, name, None)
            if isinstance(theirs, torch.nn.Linear) and theirs.weight.shape[0] == getattr(mine.self_attn, name).weight.shape[0]:
                getattr(mine.self_attn, name).weight[:, h:] = theirs.weight
            else:
                torch.nn.init.normal_(getattr(mine.self_attn, name).weight, std=0.02)
        o = getattr(last.self_attn, "o_proj", None)
        mine.self_attn.o_proj.weight.copy_(o.weight if o is not None and o.weight.shape == mine.self_attn.o_proj.weight.shape
                                           else torch.randn_like(mine.self_attn.o_proj.weight) * 0.02)
        mlp = last.mlp
        if all(isinstance(getattr(mlp, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(mine.mlp, n).weight.copy_(getattr(mlp, n).weight)
        else:
            for n in ("gate_proj", "up_proj", "down_proj"):
                torch.nn.init.normal_(getattr(mine.mlp, n).weight, std=0.02)
        for norm in (mine.hidden_norm, mine.input_layernorm, mine.post_attention_layernorm, head.norm):
            norm.weight.fill_(1.0)
        head.norm.weight.copy_(_norm_weight(source.model.model.norm, h))
        head.lm_head.weight.copy_(source.model.lm_head.weight[vocab])
        head.d2t.copy_(vocab - torch.arange(vocab.shape[0]))
        head.t2d.zero_()
        head.t2d[vocab] = True
    return head


def _norm_weight(norm, h: int) -> torch.Tensor:
    w = getattr(norm, "weight", None)
    return w.detach().float() if w is not None and w.shape == (h,) else torch.ones(h)


def unrolled(head: Eagle3Head, ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Training-time test: the head's outputs [B, W, H] for steps 1..`steps` over every row at
    once. Step 1 row t reads the target's states at t and token t+1; step j row t reads step
    j-1's output at row t-1 (the chain that began at row t-j+1) and token t+1, and attends to
    step 1's keys of rows 0..t-j+1 and to the keys its own chain wrote at steps 2..j, as
    drafting does."""
    b, w = ids.shape
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # token t+1 (the last row's is never trained)
    pos = torch.arange(w)[None].expand(b, w)
    groups = head.cfg.num_heads // head.cfg.num_kv_heads
    outs: list[torch.Tensor] = []
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    hidden = aux
    rows = torch.arange(w)
    for j in range(1, steps + 1):
        residual, q, k, v = head.project(nxt, hidden, pos)
        keys.append(k.repeat_interleave(groups, 1))
        values.append(v.repeat_interleave(groups, 1))
        scale = head.cfg.head_dim**-0.5
        first = q @ keys[0].transpose(-1, -2) * scale  # [B, h, W, W]
        visible = rows[None, :] <= (rows[:, None] - (j - 1)).clamp(min=0)
        first = first.masked_fill(~visible, float("-inf"))
        diagonal, shifted_values = [], []
        for m in range(2, j + 1):  # the key step m of this row's chain wrote: row t - (j - m)
            shift = j - m
            km = torch.nn.functional.pad(keys[m - 1], (0, 0, shift, 0))[:, :, :w]
            vm = torch.nn.functional.pad(values[m - 1], (0, 0, shift, 0))[:, :, :w]
            diagonal.append((q * km).sum(-1, keepdim=True) * scale)
            shifted_values.append(vm)
        scores = torch.cat([first, *diagonal], dim=-1).float().softmax(-1).to(q.dtype)
        out = scores[..., :w] @ values[0]
        for i, vm in enumerate(shifted_values):
            out = out + scores[..., w + i : w + i + 1] * vm
        out = head.finish(residual, out.transpose(1, 2).reshape(b, w, -1))
        outs.append(out)
        hidden = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)  # row t reads row t-1's
    return outs


def _batch(records: list[dict], remap: torch.Tensor, pad: int, top: int | None = None):
    """Right-padded ids [B, W] and states [B, W, 3H], and per trained row (b, t): its label's
    draft ids and probabilities (row t predicts token t+2, an answer token)."""
    width = max(r["ids"].shape[0] for r in records)
    ids = torch.full((len(records), width), pad, dtype=torch.long)
    aux = torch.zeros((len(records), width, records[0]["aux"].shape[1]))
    where, label_ids, label_probs = [], [], []
    for b, r in enumerate(records):
        n, start = r["ids"].shape[0], r["start"]
        ids[b, :n] = r["ids"]
        aux[b, :n] = r["aux"].float()
        first = max(start - 2, 0)
        rows = torch.arange(first, n - 2)
        where.append(torch.stack([torch.full_like(rows, b), rows], 1))
        picked = rows + 2 - start
        ti = r["top_ids"][picked].long()
        tp = r["top_logprobs"][picked].float().exp()
        if top is not None:
            ti, tp = ti[:, :top], tp[:, :top]
        label_ids.append(remap[ti])
        label_probs.append(tp)
    return ids, aux, torch.cat(where), torch.cat(label_ids), torch.cat(label_probs)


def step_losses(head: Eagle3Head, batch, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per unrolled step: the cross-entropy to the target's top-K distribution over the draft
    vocabulary (its mass outside the vocabulary cannot be learnt and is left out), and whether
    the head's first choice is the target's, per trained row. Rows whose chain would begin
    before row 0 are left out of steps that need them."""
    ids, aux, where, label_ids, label_probs = batch
    outs = unrolled(head, ids, aux, steps)
    losses, hits = [], []
    for j, out in enumerate(outs, start=1):
        keep = where[:, 1] >= j - 1
        rows = where[keep]
        logprobs = head.logits(out[rows[:, 0], rows[:, 1]]).log_softmax(-1)
        li, lp = label_ids[keep], label_probs[keep]
        losses.append(loss_fn(logprobs, li, lp))
        hits.append((logprobs.argmax(-1) == li[:, 0]) & (li[:, 0] >= 0))
    return losses, hits


def agreement(head: Eagle3Head, records: list[dict], remap: torch.Tensor, pad: int, steps: int) -> list[float]:
    """Held out, teacher-forced: per unrolled step, the share of answer tokens whose target
    first choice is the head's (step j: the j-th token of a draft, given the ones before right)."""
    head.eval()
    hits = [0] * steps
    total = [0] * steps
    with torch.no_grad():
        for i in range(0, len(records), 8):
            _, got = step_losses(head, _batch(records[i : i + 8], remap, pad, top=1), steps)
            for j, h in enumerate(got):
                hits[j] += int(h.sum())
                total[j] += h.shape[0]
    return [h / max(1, t) for h, t in zip(hits, total)]


def train(head: Eagle3Head, data: list[dict], held_out: list[dict], remap: torch.Tensor, pad: int, s: HeadSettings,
          work: Path, progress: bool, log, stop_after: int | None = None) -> tuple[list[float], list[dict]]:
    """The head's training (distill.train_loop): every loss of the unrolled steps weighed
    decay**i; held-out agreement every `evaluate_every` steps, kept in the checkpoint."""
    curve: list[dict] = []
    tokens_per_step = s.batch * sum(r["top_ids"].shape[0] for r in data) / max(1, len(data))

    def loss_of(picks: list[int]) -> tuple[torch.Tensor, float]:
        parts, _ = step_losses(head, _batch([data[i] for i in picks], remap, pad), s.ttt)
        return sum(s.decay**i * part for i, part in enumerate(parts)), parts[0].item()

    def check(state: dict) -> str | None:
        saved_curve, point = state["curve"], {"step": 0, "training_tokens": 0, "agreement": [0.0] * s.ttt}
        problem = (_unlike(saved_curve, [point] * len(saved_curve), "curve") if isinstance(saved_curve, list)
                   else "curve: not a list")
        live = head.state_dict()
        for name in ("d2t", "t2d"):  # the maps of the draft vocabulary: the answers', not the file's
            if not problem and not torch.equal(state["head"][name], live[name]):
                problem = f"head[{name!r}]: not the draft vocabulary of the answers"
        return problem

    def evaluate(step: int) -> None:
        if step % s.evaluate_every == 0 or step == s.steps:
            got = agreement(head, held_out, remap, pad, s.ttt)
            curve.append({"step": step, "training_tokens": round(step * tokens_per_step), "agreement": got})
            log(f"  step {step}: held-out agreement by draft position {', '.join(f'{a:.1%}' for a in got)}")

    losses = train_loop(head, "head", head.state_dict, head.load_state_dict, check, loss_of, len(data), s, work,
                        progress, "training the head", extra={"curve": curve}, after_step=evaluate,
                        stop_after=stop_after)
    return losses, curve


# -- the whole job -----------------------------------------------------------------------------------

def distill_head(
    target: "str | Path | Source",
    out: str | Path,
    settings: HeadSettings = HeadSettings(),
    log: Callable[[str], None] = lambda _: None,
    progress: bool = True,
    stop_after: int | None = None,
    layers: tuple[int, ...] | None = None,
) -> dict:
    """Train an EAGLE-3 head for `target` into the folder `out` (the published layout);
    returns the record written beside it."""
    from .build import check_out
    from .eagle3 import is_head_folder

    out = Path(out)
    check_out(out, lambda folder: (folder / RECORD).is_file() and is_head_folder(folder),
              "a head `specdeploy distill --kind eagle3` wrote")
    started = time.perf_counter()
    source = load_source(target)
    settings.check(source)
    n = source.config.num_hidden_layers
    layers = tuple(sorted(layers)) if layers else default_layers(n)
    if len(set(layers)) != 3 or max(layers) >= n:
        raise ExportError(f"target layers {list(layers)}: expected three distinct layers of 0..{n - 1}")
    work = out.parent / f"{out.name}.work"
    work.mkdir(parents=True, exist_ok=True)
    fingerprint = {"target": str(source.path), "kind": "eagle3", "layers": list(layers), **asdict(settings)}
    saved = work / "settings.json"
    if saved.is_file():
        before = _read_settings(saved, work)
        answers = [k for k in ("target", "tokens", "top_k", "max_new_tokens", "gen_batch", "temperature", "seed")
                   if before.get(k) != fingerprint.get(k)]
        if answers or (work / "checkpoint.pt").is_file() and before != fingerprint:
            raise ExportError(
                f"{work}: holds an interrupted run with other settings ({saved}); rerun with those settings to resume, "
                "or delete the folder to start over"
            )
        if before.get("layers") != fingerprint["layers"]:  # states of other layers: computed anew
            for stale in work.glob("features-*.pt"):
                stale.unlink()
    saved.write_text(json.dumps(fingerprint, indent=2) + "\n")
    torch.manual_seed(settings.seed)
    source.model.requires_grad_(False)

    log(f"the target answers our prompts ({settings.tokens} answer tokens, temperature {settings.temperature})")
    t0 = time.perf_counter()
    data = generate_data(source, settings, work, progress, log)
    generate_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    log(f"teacher-forced target passes: the states entering layers {list(layers)}")
    feature_data(source, data, layers, work, progress)
    feature_seconds = time.perf_counter() - t0
    train_data, held_out, vocab, remap, pad = split_and_vocabulary(data, source, settings)
    head = new_head(source, vocab, layers)
    untrained = agreement(head, held_out, remap, pad, settings.ttt)
    log(f"training a head over {vocab.shape[0]} draft tokens, {settings.ttt} unrolled steps "
        f"(held-out agreement before training: {', '.join(f'{a:.1%}' for a in untrained)})")
    t0 = time.perf_counter()
    losses, curve = train(head, train_data, held_out, remap, pad, settings, work, progress, log, stop_after)
    train_seconds = time.perf_counter() - t0
    trained = curve[-1]["agreement"] if curve else agreement(head, held_out, remap, pad, settings.ttt)
    record = {
        "kind": "eagle3",
        "target": str(source.path),
        "target_layers": n,
        "aux_layers": list(layers),
        "init": "the target's last layer (the state half of q/k/v, o, MLP), its final norm and head rows; "
                "fc passing the highest state through",
        **data_record(data, train_data, held_out, vocab, source.config.vocab_size),
        "settings": asdict(settings),
        "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "held_out_agreement": {"untrained": untrained, "trained": trained},
        "curve": curve,
        "seconds": {"generate": round(generate_seconds, 1), "features": round(feature_seconds, 1),
                    "train": round(train_seconds, 1), "total": round(time.perf_counter() - started, 1)},
    }
    write_head(head, layers, record, out)
    shutil.rmtree(work)
    log(f"head written to {out} in {time.perf_counter() - started:.0f}s (held-out agreement by draft position: "
        f"{', '.join(f'{a:.1%}' for a in trained)})")
    return record


def write_head(head: Eagle3Head, layers: tuple[int, ...], record: dict, out: Path) -> None:
    """The published layout (config.json, model.safetensors) plus distill.json, moved into place
    only when complete."""
    from safetensors.torch import save_file

    from .build import atomic_folder

    with atomic_folder(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(head.cfg.as_config(layers, record["target_layers"]), indent=1) + "\n")
        save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, str(tmp / "model.safetensors"))
        (tmp / RECORD).write_text(json.dumps(record, indent=1) + "\n")


__all__ = ["HeadSettings", "agreement", "distill_head", "new_head", "unrolled", "write_head"]
