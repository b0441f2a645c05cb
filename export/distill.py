"""Distil a draft for a target (`specdeploy distill`).

    our prompts -> the target answers them (sampled under the seed) and keeps its top-K
    log-probs at every answer token -> the draft vocabulary: the N tokens the target picks
    most often -> the student: the target's embeddings (frozen), its first L layers and
    final norm, and a head over the N tokens only -> trained on the cross-entropy to those
    top-K distributions (the KL up to the target's entropy) -> a Hugging Face folder that
    `specdeploy export --draft` takes, with `distill.json` saying how it was made.

A head over N of V tokens costs N/V of the target's head; tokens outside it can never be
drafted (they are still verified and emitted by the target: lossless either way).

Work goes to `<out>.work/`: the answers in shards, then training checkpoints. An
interrupted run resumes where it stopped, and ends with the same weights as a run that
was never interrupted (everything random is drawn from the seed and checkpointed).
"""
from __future__ import annotations

import copy
import json
import math
import os
import pickle
import random
import shutil
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from specdeploy.core.errors import ExportError

from .distill_data import training_prompts
from .load import Source, eos_token_ids, load_source

RECORD = "distill.json"


@dataclass(frozen=True)
class DistillSettings:
    layers: int = 2  # student layers, initialised from the target's first ones
    draft_vocab: int = 8192  # head rows: the tokens the target picks most often
    tokens: int = 40_000  # answer tokens the target generates to learn from
    steps: int = 500  # optimizer steps
    batch: int = 8  # answers per step
    lr: float = 1e-3
    top_k: int = 16  # teacher log-probs kept per token
    max_new_tokens: int = 128  # per answer
    gen_batch: int = 16  # prompts answered together
    temperature: float = 0.7  # the target samples its answers (0: greedy)
    seed: int = 0
    held_out: float = 0.05  # share of answers kept out of training, to measure agreement on

    def check(self, source: Source) -> None:
        cfg = source.config
        limits = [
            ("--layers", self.layers, 1, cfg.num_hidden_layers - 1),
            ("--draft-vocab", self.draft_vocab, 1, cfg.vocab_size),
            ("--tokens", self.tokens, 1, 10**9),
            ("--steps", self.steps, 0, 10**7),
            ("--batch", self.batch, 1, 4096),
            ("--top-k", self.top_k, 1, cfg.vocab_size),
            ("--max-new-tokens", self.max_new_tokens, 1, 4096),
        ]
        for flag, value, lo, hi in limits:
            if not lo <= value <= hi:
                raise ExportError(f"{flag} {value}: expected {lo}..{hi} for target {source.path}")
        if not (0.0 <= self.temperature <= 10.0):
            raise ExportError(f"--temperature {self.temperature}: expected 0..10")
        if not (0.0 < self.held_out < 0.5):
            raise ExportError(f"held-out share {self.held_out}: expected between 0 and 0.5")


def _bar(total: int, desc: str, unit: str, enabled: bool, initial: int = 0):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, initial=initial, disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, smoothing=0.1)


def _save(obj, path: Path) -> None:
    """torch.save made atomic: an interruption leaves the old file or the new one."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# -- the work folder: anyone who can write beside --out can write there -------------------------

def _not_ours(path: Path, work: Path, what: str, why: str) -> ExportError:
    return ExportError(f"{path}: not {what} this version wrote ({why}); delete {work} to start over")


def _load_work_file(path: Path, work: Path, what: str):
    """A torch file of the work folder: tensors and plain values only, whatever it holds. The
    safe mode is stated, not left to torch's default, which TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD
    turns unsafe (torch/serialization.py lets the variable override only an unset weights_only)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's remarks on a forged file's pickle: lines before our one
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        why = "it holds more than tensors and plain values, or is no torch file"
    except Exception as e:  # hostile bytes in torch's reader: whatever it raises, the file is at fault
        why = f"truncated or corrupt: {type(e).__name__}"
    raise _not_ours(path, work, what, why)


def _read_settings(path: Path, work: Path) -> dict:
    """The settings.json of an interrupted run, as a dict."""
    try:
        saved = json.loads(path.read_text())
    except OSError as e:
        raise ExportError(f"{path}: cannot be read ({e.strerror}); delete {work} to start over") from None
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _not_ours(path, work, "a settings file", f"not JSON: {type(e).__name__}") from None
    if not isinstance(saved, dict):
        raise _not_ours(path, work, "a settings file", f"a JSON {type(saved).__name__}, not an object")
    return saved


def _unlike(got, want, at: str) -> str | None:
    """Where `got` departs from the form of `want` (keys, lengths, types, tensors' dtypes and
    shapes), or None: a checkpoint restores only into objects of the form it was saved from, and
    torch's load_state_dict checks little of it (a scheduler's none), leaving the rest to fail
    steps later with a traceback."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return f"{at}: not a {want.dtype} tensor of shape {list(want.shape)}"
        return None
    if type(got) is not type(want):
        return f"{at}: {type(got).__name__}, not {type(want).__name__}"
    if isinstance(want, dict):
        for key in want:
            if key not in got:
                return f"{at}: no {key!r}"
        for key in got:
            if key not in want:
                return f"{at}: an unexpected {key!r}"
        return next(filter(None, (_unlike(got[k], want[k], f"{at}[{k!r}]") for k in want)), None)
    if isinstance(want, (list, tuple)):
        if len(got) != len(want):
            return f"{at}: {len(got)} items, not {len(want)}"
        return next(filter(None, (_unlike(g, w, f"{at}[{i}]") for i, (g, w) in enumerate(zip(got, want)))), None)
    return None


def _optimizer_unlike(got, opt: torch.optim.Optimizer) -> str | None:
    """_unlike for the optimizer's state: its groups have the live ones' form and parameters,
    and each parameter's state the form AdamW steps with."""
    live = opt.state_dict()
    if not isinstance(got, dict) or set(got) != {"state", "param_groups"}:
        return "opt: not an optimizer's state"
    problem = _unlike(got["param_groups"], live["param_groups"], "opt param_groups")
    if problem:
        return problem
    if [g["params"] for g in got["param_groups"]] != [g["params"] for g in live["param_groups"]]:
        return "opt param_groups: other parameters"
    params = [p for group in opt.param_groups for p in group["params"]]
    if not isinstance(got["state"], dict):
        return "opt state: not a dict"
    for i, entry in got["state"].items():
        if type(i) is not int or not 0 <= i < len(params):
            return f"opt state: no parameter {i!r}"
        # what torch's AdamW keeps per parameter (amsgrad off): a float32 step count and two moments
        problem = _unlike(entry, {"step": torch.zeros(()), "exp_avg": params[i], "exp_avg_sq": params[i]},
                         f"opt state[{i}]")
        if problem:
            return problem
    return None


def _read_checkpoint(path: Path, work: Path, like: dict, opt: torch.optim.Optimizer, steps: int,
                    more: tuple[str, ...] = ()) -> dict:
    """checkpoint.pt, checked against the live objects it is to restore: the parts in `like` have
    their form, "opt" the optimizer's, "step" and "losses" agree; the caller checks the keys in `more`."""
    state = _load_work_file(path, work, "a checkpoint")
    keys = {*like, "opt", "step", "losses", *more}
    if not isinstance(state, dict) or set(state) != keys:
        raise _not_ours(path, work, "a checkpoint", f"not a dict of {', '.join(sorted(keys))}")
    step, losses = state["step"], state["losses"]
    if type(step) is not int or not 0 <= step <= steps:
        raise _not_ours(path, work, "a checkpoint", f"step {step!r}, not one of 0..{steps}")
    if not isinstance(losses, list) or len(losses) != step or any(type(x) is not float for x in losses):
        raise _not_ours(path, work, "a checkpoint", f"losses: not one number per step of its {step}")
    problem = _optimizer_unlike(state["opt"], opt) or next(
        filter(None, (_unlike(state[k], want, k) for k, want in like.items())), None)
    if problem:
        raise _not_ours(path, work, "a checkpoint", problem)
    return state


@contextmanager
def _restoring(path: Path, work: Path):
    """Around the load_state_dict calls: what torch checks there that the form cannot show (a
    generator state's bytes), in one line."""
    try:
        yield
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise _not_ours(path, work, "a checkpoint", f"torch cannot restore it: {first}") from None


def _check_answers(records, path: Path, work: Path, s: DistillSettings, vocab_size: int) -> list[dict]:
    """An answers shard in the form answer() writes: every later step indexes with its ids,
    start and shapes."""
    def bad(why: str) -> ExportError:
        return _not_ours(path, work, "an answers shard", why)

    if not isinstance(records, list):
        raise bad(f"a {type(records).__name__}, not a list of answers")
    for i, r in enumerate(records):
        if not isinstance(r, dict) or set(r) != {"ids", "start", "top_ids", "top_logprobs"}:
            raise bad(f"answer {i}: not a dict of ids, start, top_ids and top_logprobs")
        ids, start = r["ids"], r["start"]
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.long or ids.dim() != 1:
            raise bad(f"answer {i}: ids not a 1-D int64 tensor")
        if type(start) is not int or not 1 <= start < ids.shape[0]:
            raise bad(f"answer {i}: start {start!r}, not within its {ids.shape[0]} ids")
        shape = (ids.shape[0] - start, s.top_k)  # a top-K row per answer token
        for name, dtype in (("top_ids", torch.int32), ("top_logprobs", torch.float16)):
            problem = _unlike(r[name], torch.empty(shape, dtype=dtype), f"answer {i} {name}")
            if problem:
                raise bad(problem)
        for t in (ids, r["top_ids"]):
            if int(t.min()) < 0 or int(t.max()) >= vocab_size:
                raise bad(f"answer {i}: a token id outside the target's vocabulary of {vocab_size}")
    return records


# -- 1. the target answers our prompts ---------------------------------------------------

def _prompt_ids(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(prompt).input_ids


def answer(source: Source, prompts: list[str], s: DistillSettings, seed: int) -> list[dict]:
    """One batch of prompts -> per answer: ids (prompt + answer), start (the prompt's length),
    the target's top-K token ids and log-probs at each answer token."""
    tok, model = source.tokenizer, source.model
    eos = eos_token_ids(source)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    prompt_ids = [_prompt_ids(tok, p) for p in prompts]
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):  # left padding: every answer starts at column `width`
        input_ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    torch.manual_seed(seed)
    sampled = s.temperature > 0
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=mask, max_new_tokens=s.max_new_tokens, do_sample=sampled,
            temperature=s.temperature if sampled else None, top_k=0 if sampled else None, top_p=1.0 if sampled else None,
            output_logits=True, return_dict_in_generate=True, pad_token_id=pad, eos_token_id=eos,
        )
        logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1)  # [B, G, V], before any warping
        top_logprobs, top_ids = logprobs.topk(s.top_k, dim=-1)
    answers = out.sequences[:, width:]
    records = []
    for i, p in enumerate(prompt_ids):
        row = answers[i].tolist()
        n = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))  # through the first EOS
        records.append({
            "ids": torch.tensor(p + row[:n]),
            "start": len(p),
            "top_ids": top_ids[i, :n].int().clone(),
            "top_logprobs": top_logprobs[i, :n].half().clone(),
        })
    return records


def prompt_batches(source: Source, s: DistillSettings) -> list[list[str]]:
    """Our prompts in batches of similar length (a batch is padded to its longest prompt),
    the batches in an order drawn from the seed."""
    prompts = training_prompts(s.seed)
    lengths = [len(_prompt_ids(source.tokenizer, p)) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: (lengths[i], i))
    batches = [[prompts[i] for i in order[at : at + s.gen_batch]] for at in range(0, len(order), s.gen_batch)]
    random.Random(s.seed).shuffle(batches)
    return batches


def generate_data(source: Source, s: DistillSettings, work: Path, progress: bool, log) -> list[dict]:
    """Answers until `s.tokens` answer tokens exist, one shard per batch (kept: resumable).
    After the last batch the prompts come round again, sampled anew (greedy: repeated)."""
    batches = prompt_batches(source, s)
    data: list[dict] = []
    count = 0
    shard = 0
    bar = _bar(s.tokens, "target answers", "tok", progress)
    while count < s.tokens:
        path = work / f"answers-{shard:05d}.pt"
        if path.is_file():
            records = _check_answers(_load_work_file(path, work, "an answers shard"), path, work, s,
                                    source.config.vocab_size)
        else:
            records = answer(source, batches[shard % len(batches)], s, seed=s.seed * 1_000_003 + shard)
            _save(records, path)
        n = sum(r["top_ids"].shape[0] for r in records)
        data += records
        count += n
        shard += 1
        bar.update(n)
    bar.close()
    log(f"  {len(data)} answers, {count} answer tokens, from {min(shard, len(batches))} batches of prompts")
    return data


# -- 2. the draft vocabulary ---------------------------------------------------------------

def draft_vocabulary(train: list[dict], source: Source, size: int) -> torch.Tensor:
    """The `size` tokens the target ranks first most often (ties: the lower id), with every
    EOS id, sorted by id."""
    vocab_size = source.config.vocab_size
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in train:
        counts += torch.bincount(r["top_ids"][:, 0].long(), minlength=vocab_size).double()
    counts[eos_token_ids(source)] = math.inf
    order = sorted(range(vocab_size), key=lambda t: (-counts[t].item(), t))
    return torch.tensor(sorted(order[:size]), dtype=torch.long)


def split_and_vocabulary(data: list[dict], source: Source, s: DistillSettings):
    """The answers split into training and held-out ones (the last `s.held_out` share), the
    draft vocabulary of the training ones, the map target id -> draft id (-1: outside it) and
    the pad id: what both kinds of draft train from."""
    held = max(1, round(len(data) * s.held_out))
    train_data, held_out = data[:-held], data[-held:]
    if not train_data:
        raise ExportError(f"--tokens {s.tokens}: too few answers to train on; ask for more tokens")
    vocab = draft_vocabulary(train_data, source, s.draft_vocab)
    remap = torch.full((source.config.vocab_size,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(vocab.shape[0])
    return train_data, held_out, vocab, remap, eos_token_ids(source)[0]


def coverage(records: list[dict], vocab: torch.Tensor, vocab_size: int) -> float:
    """Share of answer tokens whose target first choice the vocabulary holds."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocab] = True
    firsts = torch.cat([r["top_ids"][:, 0].long() for r in records])
    return float(inside[firsts].float().mean())


# -- 3. the student ------------------------------------------------------------------------

class Student(nn.Module):
    """The draft while it trains: a causal LM of the target's family with `layers` layers,
    and a head over the draft vocabulary only."""

    def __init__(self, target: nn.Module, layers: int, vocab: torch.Tensor):
        super().__init__()
        cfg = copy.deepcopy(target.config)
        cfg.num_hidden_layers = layers
        cfg.tie_word_embeddings = False
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
        self.lm = type(target)(cfg).eval()  # its random init is overwritten below, every tensor
        base, theirs = self.lm.model, target.model
        base.embed_tokens.weight.data.copy_(theirs.embed_tokens.weight.data)
        base.embed_tokens.weight.requires_grad_(False)  # frozen: the target's token space
        for mine, layer in zip(base.layers, theirs.layers):
            mine.load_state_dict(layer.state_dict())
        base.norm.load_state_dict(theirs.norm.state_dict())
        self.lm.lm_head.weight.data.copy_(target.lm_head.weight.data)
        self.lm.lm_head.weight.requires_grad_(False)  # rows outside the vocabulary are never read
        self.register_buffer("vocab", vocab.clone())
        self.head = nn.Parameter(target.lm_head.weight.data[vocab].clone())

    def forward(self, ids: torch.Tensor, rows: list[tuple[int, int, int]]) -> torch.Tensor:
        """ids [B, L] -> log-probs over the vocabulary [R, N] at the (batch, from, to) rows."""
        hidden = self.lm.model(input_ids=ids).last_hidden_state
        picked = torch.cat([hidden[b, lo:hi] for b, lo, hi in rows])
        return (picked @ self.head.T).float().log_softmax(-1)

    def trainable(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("lm.model.embed_tokens", "lm.lm_head"))}

    def export_model(self) -> nn.Module:
        """The Hugging Face model to save: the trained head rows written into a full head."""
        self.lm.lm_head.weight.data[self.vocab] = self.head.data
        return self.lm


def _batch(records: list[dict], remap: torch.Tensor, pad: int):
    """Right-padded inputs, the rows that predict answer tokens, and their targets."""
    width = max(r["ids"].shape[0] - 1 for r in records)
    ids = torch.full((len(records), width), pad, dtype=torch.long)
    rows, target_ids, target_probs = [], [], []
    for b, r in enumerate(records):
        x = r["ids"][:-1]
        ids[b, : x.shape[0]] = x
        n = r["top_ids"].shape[0]
        rows.append((b, r["start"] - 1, r["start"] - 1 + n))  # row start-1+j predicts answer token j
        target_ids.append(remap[r["top_ids"].long()])
        target_probs.append(r["top_logprobs"].float().exp())
    return ids, rows, torch.cat(target_ids), torch.cat(target_probs)


def loss_fn(logprobs: torch.Tensor, target_ids: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy to the target's top-K distribution; its mass on tokens outside the
    draft vocabulary (remapped to -1) cannot be learnt and is left out."""
    inside = target_ids >= 0
    picked = logprobs.gather(-1, target_ids.clamp(min=0))
    return -(target_probs * picked * inside).sum(-1).mean()


def agreement(student: Student, records: list[dict], remap: torch.Tensor, pad: int) -> float:
    """Share of answer tokens where the student's first choice is the target's (the greedy
    acceptance rate of one draft token, teacher-forced)."""
    hits = total = 0
    with torch.no_grad():
        for i in range(0, len(records), 8):
            ids, rows, target_ids, _ = _batch(records[i : i + 8], remap, pad)
            best = student(ids, rows).argmax(-1)
            hits += int((best == target_ids[:, 0]).sum())
            total += best.shape[0]
    return hits / max(1, total)


def _schedule(step: int, steps: int) -> float:
    warm = max(1, steps // 20)
    if step < warm:
        return (step + 1) / warm
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def train_loop(model: nn.Module, name: str, weights: Callable[[], dict], load: Callable[[dict], None],
               check: Callable[[dict], str | None], loss_of: Callable[[list[int]], tuple[torch.Tensor, float]],
               records: int, s, work: Path, progress: bool, desc: str, extra: dict[str, list] | None = None,
               after_step: Callable[[int], None] | None = None, stop_after: int | None = None) -> list[float]:
    """The training loop of `distill` (a draft) and `distill --kind eagle3` (a head): `s.steps` AdamW
    steps (`s.lr`, a warm-up then a cosine to a tenth, gradients clipped to norm 1) over batches of
    `s.batch` of the `records` drawn by a sampler seeded with `s.seed`. `loss_of(picks)` -> (the loss
    to step on, the number kept and shown). A checkpoint every 25 steps and at the end: the model's
    `weights()` under `name`, the optimizer, the schedule, the sampler, the step, the losses and the
    lists in `extra` (restored in place). A checkpoint in `work` is resumed from once its form is
    checked (`_read_checkpoint`) and `check(state)` finds nothing wrong with the caller's own parts;
    `load` restores the weights. `after_step(step)` runs after each step. -> the losses."""
    extra = {} if extra is None else extra
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: _schedule(i, s.steps))
    sampler = torch.Generator().manual_seed(s.seed)
    losses: list[float] = []
    step = 0
    ckpt = work / "checkpoint.pt"
    if ckpt.is_file():
        like = {name: weights(), "sched": sched.state_dict(), "sampler": sampler.get_state()}
        state = _read_checkpoint(ckpt, work, like, opt, s.steps, more=tuple(extra))
        problem = check(state)
        if problem:
            raise _not_ours(ckpt, work, "a checkpoint", problem)
        with _restoring(ckpt, work):
            load(state[name])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            sampler.set_state(state["sampler"])
        step, losses = state["step"], state["losses"]
        for key, kept in extra.items():
            kept[:] = state[key]

    def checkpoint():
        _save({name: weights(), "opt": opt.state_dict(), "sched": sched.state_dict(), "sampler": sampler.get_state(),
               "step": step, "losses": losses, **extra}, ckpt)

    bar = _bar(s.steps, desc, "step", progress, initial=step)
    while step < s.steps:
        if stop_after is not None and step >= stop_after:
            raise KeyboardInterrupt  # tests: an interruption between checkpoints
        model.train()
        picks = torch.randint(0, records, (s.batch,), generator=sampler).tolist()
        loss, shown = loss_of(picks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(shown)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if after_step is not None:
            after_step(step)
        if step % 25 == 0 or step == s.steps:
            checkpoint()
    bar.close()
    model.eval()
    return losses


def train(student: Student, data: list[dict], remap: torch.Tensor, pad: int, s: DistillSettings, work: Path,
          progress: bool, stop_after: int | None = None) -> list[float]:
    """The draft's training (train_loop): the distillation loss over batches of answers."""
    def loss_of(picks: list[int]) -> tuple[torch.Tensor, float]:
        ids, rows, target_ids, target_probs = _batch([data[i] for i in picks], remap, pad)
        loss = loss_fn(student(ids, rows), target_ids, target_probs)
        return loss, loss.item()

    def check(state: dict) -> str | None:
        if not torch.equal(state["student"]["vocab"], student.vocab):
            return "its draft vocabulary is not the one of the answers"
        return None

    return train_loop(student, "student", student.trainable, lambda w: student.load_state_dict(w, strict=False),
                      check, loss_of, len(data), s, work, progress, "training the draft", stop_after=stop_after)


# -- 4. the whole job ------------------------------------------------------------------------

def distill(
    target: "str | Path | Source",
    out: str | Path,
    settings: DistillSettings = DistillSettings(),
    log: Callable[[str], None] = lambda _: None,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict:
    """Train a draft for `target` into the folder `out`; returns the record written beside it."""
    out = Path(out)
    from .build import check_out

    check_out(out, lambda folder: (folder / RECORD).is_file() and (folder / "config.json").is_file(),
              "a draft `specdeploy distill` wrote")
    started = time.perf_counter()
    source = load_source(target)
    settings.check(source)
    work = out.parent / f"{out.name}.work"
    work.mkdir(parents=True, exist_ok=True)
    fingerprint = {"target": str(source.path), **asdict(settings)}
    saved = work / "settings.json"
    if saved.is_file() and _read_settings(saved, work) != fingerprint:
        raise ExportError(
            f"{work}: holds an interrupted run with other settings ({saved}); "
            "rerun with those settings to resume, or delete the folder to start over"
        )
    saved.write_text(json.dumps(fingerprint, indent=2) + "\n")
    torch.manual_seed(settings.seed)
    source.model.requires_grad_(False)

    log(f"the target answers our prompts ({settings.tokens} answer tokens, temperature {settings.temperature})")
    t0 = time.perf_counter()
    data = generate_data(source, settings, work, progress, log)
    generate_seconds = time.perf_counter() - t0
    train_data, held_out, vocab, remap, pad = split_and_vocabulary(data, source, settings)
    student = Student(source.model, settings.layers, vocab)
    untrained = agreement(student, held_out, remap, pad)
    log(f"training a {settings.layers}-layer draft with a {vocab.shape[0]}-token head "
        f"(held-out agreement before training: {untrained:.1%})")
    t0 = time.perf_counter()
    losses = train(student, train_data, remap, pad, settings, work, progress, stop_after)
    train_seconds = time.perf_counter() - t0
    trained = agreement(student, held_out, remap, pad)
    log(f"held-out agreement with the target's first choice: {untrained:.1%} untrained -> {trained:.1%}")

    cfg = source.config
    record = {
        "kind": "distilled",
        "target": str(source.path),
        "target_layers": cfg.num_hidden_layers,
        "layers": settings.layers,
        "init": "the target's first layers and final norm; its embeddings, frozen; its head rows of the vocabulary",
        **data_record(data, train_data, held_out, vocab, cfg.vocab_size),
        "settings": asdict(settings),
        "final_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "held_out_agreement": {"untrained": untrained, "distilled": trained},
        "seconds": {
            "generate": round(generate_seconds, 1),
            "train": round(train_seconds, 1),
            "total": round(time.perf_counter() - started, 1),
        },
        "vocab": vocab.tolist(),
    }
    _write_folder(student, source, record, out)
    shutil.rmtree(work)
    log(f"draft written to {out} in {time.perf_counter() - started:.0f}s")
    return record


def data_record(data: list[dict], train: list[dict], held_out: list[dict], vocab: torch.Tensor, vocab_size: int) -> dict:
    """What a distill record says of its data and draft vocabulary (both kinds)."""
    return {
        "draft_vocab": int(vocab.shape[0]),
        "vocab_coverage": {"train": coverage(train, vocab, vocab_size), "held_out": coverage(held_out, vocab, vocab_size)},
        "data": {
            "answers": len(data),
            "answer_tokens": sum(r["top_ids"].shape[0] for r in data),
            "rows": sum(r["ids"].shape[0] for r in data),
            "held_out_answers": len(held_out),
            "sources": "the target's answers to chat questions on our topics, coding tasks, standard-library "
                       "functions to explain and standard-library docstrings to summarise (export/distill_data.py)",
        },
    }


def _write_folder(student: Student, source: Source, record: dict, out: Path) -> None:
    """The draft as a Hugging Face folder (model, tokenizer, distill.json), moved into place
    only when complete."""
    from .build import atomic_folder

    with atomic_folder(out) as tmp:
        student.export_model().save_pretrained(tmp)
        source.tokenizer.save_pretrained(tmp)
        (tmp / RECORD).write_text(json.dumps(record, indent=1) + "\n")


__all__ = ["RECORD", "DistillSettings", "Student", "agreement", "data_record", "distill", "loss_fn",
           "split_and_vocabulary"]
