"""How often a trained draft can agree with the target, against the teacher data it gets.

    python benchmarks/draft_scaling.py [--target smollm2] [--sizes 2500,5000,10000,20000,40000]
        [--prompts benchmarks/prompts_varied.txt] [--work DIR] [--json OUT]

The draft measured is the most favourable kind we know for a given amount of data: a
head that reads the target's own last hidden state at position t together with the
token the target chose there (its embedding), and guesses the token after that one
(EAGLE-style features, no attention of its own: one linear layer over the two, the
target's final norm, and the target's head rows over the 8192 tokens the target picks
most often in the training data). It is what a draft of draft length 1 proposes, and it
costs almost nothing beside the target's pass. A draft without the target's features
(`specdeploy distill`'s students) can only do worse on the same data.

Data: the target's greedy answers to our distill prompts (export/distill_data.py, what
`specdeploy distill --temperature 0` generates), kept under --work so a rerun reuses
them. For each size N the head trains on the first N answer tokens (teacher-forced:
target hidden state and log-probs at every position). It is measured on the target's
greedy answers to the benchmark prompts (never trained on): top-1 agreement with the
target's next-but-one token, and how many of those tokens the head's vocabulary covers.

Read with docs/design.md, "The cost model": at draft length 1 a draft with agreement a and cost c
speeds decoding up by (1 + a) / (v + c) at most, v being a two-token verify pass's cost
relative to a single step (`specdeploy bench` prints it).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdeploy.export.distill import DistillSettings, answer, generate_data
from specdeploy.export.load import embedded_default, load_source
from specdeploy.runtime.tools.bench.inputs import read_prompts

try:
    from benchmarks.provenance import provenance
except ModuleNotFoundError:  # run as a file (python benchmarks/NAME.py): benchmarks/ is on sys.path
    from provenance import provenance

HERE = Path(__file__).parent
VOCAB = 8192
BATCH = 256
LR = 1e-3


def features(model, records: list[dict]):
    """Per answer position t (teacher-forced): the target's last hidden state at t, the
    token at t+1, the target's log-probs at t+1 and the token at t+2."""
    rows = []
    with torch.no_grad():
        for r in records:
            ids = r["ids"][None]
            out = model(ids, output_hidden_states=True)
            t = torch.arange(max(r["start"] - 1, 0), ids.shape[1] - 2)
            hidden, logits = out.hidden_states[-1][0], out.logits[0]
            rows.append((hidden[t], ids[0, t + 1], logits[t + 1].log_softmax(-1).half(), ids[0, t + 2]))
    return [torch.cat(z) for z in zip(*rows)]


class FeatureHead(nn.Module):
    def __init__(self, model, vocab: torch.Tensor):
        super().__init__()
        d = model.config.hidden_size
        self.embed = model.model.embed_tokens.weight.detach()
        self.mix = nn.Linear(2 * d, d)
        self.norm_weight = nn.Parameter(model.model.norm.weight.detach().clone())
        self.eps = model.config.rms_norm_eps
        self.register_buffer("head", model.lm_head.weight.detach()[vocab].clone())

    def forward(self, hidden: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        z = self.mix(torch.cat([hidden, self.embed[token]], -1))
        z = self.norm_weight * z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + self.eps)
        return z @ self.head.t()


def train_head(model, data, n: int, epochs: int, seed: int = 0) -> tuple[FeatureHead, torch.Tensor]:
    hidden, token, logprobs, nxt = (z[:n] for z in data)
    vocab = torch.bincount(nxt, minlength=model.config.vocab_size).argsort(descending=True)[:VOCAB]
    teacher = logprobs[:, vocab].float().log_softmax(-1).exp()  # the target's distribution over the head's tokens
    torch.manual_seed(seed)
    head = FeatureHead(model, vocab)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    steps = epochs * max(1, n // BATCH)
    step = 0
    for _ in range(epochs):
        order = torch.randperm(n)
        for at in range(0, n - BATCH + 1, BATCH):
            j = order[at : at + BATCH]
            for group in opt.param_groups:
                group["lr"] = LR * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
            loss = -(teacher[j] * head(hidden[j], token[j]).log_softmax(-1)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
    return head, vocab


def agreement(head: FeatureHead, vocab: torch.Tensor, data) -> float:
    hidden, token, _, nxt = data
    with torch.no_grad():
        guess = vocab[head(hidden, token).argmax(-1)]
    return float((guess == nxt).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--sizes", default="2500,5000,10000,20000,40000", help="answer tokens to train on, comma separated")
    ap.add_argument("--prompts", default=str(HERE / "prompts_varied.txt"), help="held-out prompts to measure on")
    ap.add_argument("--work", default="draft_scaling.work", help="where the target's answers are kept")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    source = load_source(embedded_default() if args.target == "smollm2" else args.target)
    source.model.requires_grad_(False)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    settings = DistillSettings(tokens=sizes[-1], temperature=0.0)
    before = set(work.glob("answers-*.pt"))
    t0 = time.perf_counter()
    records = generate_data(source, settings, work, progress=True, log=print)
    generate_seconds = time.perf_counter() - t0
    fresh = sum(r["top_ids"].shape[0] for path in set(work.glob("answers-*.pt")) - before for r in torch.load(path, map_location="cpu", weights_only=True))
    held_path = work / "held_out.pt"
    if not held_path.is_file():
        prompts = read_prompts(Path(args.prompts))
        held = []
        for at in range(0, len(prompts), 10):
            held += answer(source, prompts[at : at + 10], DistillSettings(temperature=0.0, max_new_tokens=96), seed=0)
        torch.save(held, held_path)
    held = torch.load(held_path, map_location="cpu", weights_only=True)
    t0 = time.perf_counter()
    train_data, held_data = features(source.model, records), features(source.model, held)
    feature_seconds = time.perf_counter() - t0
    print(f"{train_data[0].shape[0]} training positions, {held_data[0].shape[0]} held-out positions "
          f"({feature_seconds:.0f} s of teacher-forced passes)")

    rows = []
    print(f"{'tokens':>8} {'train agreement':>16} {'held-out agreement':>19} {'held-out coverage':>18} {'seconds':>8}")
    for n in sizes:
        n = min(n, train_data[0].shape[0])
        t0 = time.perf_counter()
        head, vocab = train_head(source.model, train_data, n, epochs=8 if n <= 5000 else 4)
        sample = [z[: min(n, 4000)] for z in train_data]
        row = {
            "tokens": n,
            "train_agreement": round(agreement(head, vocab, sample), 4),
            "held_out_agreement": round(agreement(head, vocab, held_data), 4),
            "held_out_coverage": round(float(torch.isin(held_data[3], vocab).float().mean()), 4),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        rows.append(row)
        print(f"{row['tokens']:>8} {row['train_agreement']:>16.3f} {row['held_out_agreement']:>19.3f} "
              f"{row['held_out_coverage']:>18.3f} {row['seconds']:>8.1f}")
    # Agreement against log2(tokens): least squares over the measured sizes.
    xs = [math.log2(r["tokens"]) for r in rows]
    ys = [r["held_out_agreement"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-9)
    report = {"rows": rows, "agreement_per_doubling": round(slope, 4), "teacher_tokens_per_second": None}
    print(f"held-out agreement gains {slope:.3f} per doubling of the teacher tokens")
    if fresh:  # answers generated in this run (not read back from --work)
        rate = fresh / generate_seconds
        report["teacher_tokens_per_second"] = round(rate, 1)
        print(f"the target generated its answers at {rate:.0f} tokens/s")
    if slope > 0:
        for goal in (0.5, 0.6, 0.7):
            need = rows[-1]["tokens"] * 2 ** ((goal - ys[-1]) / slope)
            report[f"tokens_for_{goal}"] = round(need)
            print(f"  agreement {goal}: about {need:,.0f} teacher tokens, if the trend holds")
    if args.json:
        Path(args.json).write_text(json.dumps({**report, "provenance": provenance()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
