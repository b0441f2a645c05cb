"""The main job: the embedded default model, exported once, answering a chat prompt and an
input-grounded one (an edit of given text, where an answer repeats its input and speculation
pays), each timed against plain decoding on the same bundle."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from specdeploy.core.manifest import FORMAT_VERSION, load_bundle
from specdeploy.core.errors import BundleError
from specdeploy.runtime.tools.report import summary
from specdeploy.runtime.decoding.session import Session


DISTILLED = "distilled"
DRAFT_DTYPE = "int8"  # the distilled draft's weights: a quarter of fp32's bytes per token
EAGLE3 = "eagle3"  # an EAGLE-3 head `specdeploy distill --kind eagle3` trains on the first run


def head_folder(out: Path) -> Path:
    """Where the demo keeps the EAGLE-3 head it trains."""
    return out.parent / f"{out.name}-eagle3"


def draft_folder(out: Path) -> Path:
    """Where the demo keeps the draft `specdeploy distill` trains for it."""
    return out.parent / f"{out.name}-draft"


def _spelling(entry) -> str:
    """A bundle's draft as `--draft` spells it (model drafts: 'model')."""
    if entry.kind == "self":
        return "self:" + ",".join(f"{k}={v}" for k, v in (("layers", entry.layers), ("dtype", entry.dtype)) if v is not None)
    return entry.kind


def _bundle_ready(out: Path, draft: str, dtype: str) -> bool:
    try:
        bundle = load_bundle(out)
    except BundleError:
        return False
    if bundle.model("target").dtype != dtype or bundle.manifest.format_version != FORMAT_VERSION:
        return False  # another configuration, or graphs of an older format (they run, slower): export again
    if draft == DISTILLED:
        return bundle.draft_kind == "model" and bundle.draft.distilled is not None
    if draft == EAGLE3:
        return bundle.draft_kind == "eagle3"
    return _spelling(bundle.draft) == draft


def _export(out: Path, draft: str, dtype: str) -> None:
    from specdeploy.export import build_bundle, embedded_default

    log = lambda m: click.echo(m, err=True)  # noqa: E731
    draft_dtype = None
    if draft == DISTILLED:
        from specdeploy.export.distill import RECORD, DistillSettings, distill

        folder = draft_folder(out)
        if not (folder / RECORD).is_file():
            click.echo(f"training a draft for SmolLM2-135M-Instruct into {folder} (once; resumes if interrupted)", err=True)
            distill(embedded_default(), folder, DistillSettings(), log=log)
        draft, draft_dtype = str(folder), DRAFT_DTYPE
    elif draft == EAGLE3:
        from specdeploy.export.distill_eagle3 import RECORD, HeadSettings, distill_head

        folder = head_folder(out)
        if not (folder / RECORD).is_file():
            click.echo(f"training an EAGLE-3 head for SmolLM2-135M-Instruct into {folder} (once; about an hour on 2 "
                       "cores; resumes if interrupted)", err=True)
            distill_head(embedded_default(), folder, HeadSettings(), log=log)
        draft = str(folder)
    click.echo(f"exporting SmolLM2-135M-Instruct ({dtype}) with draft {draft} to {out} (once; later runs reuse it)", err=True)
    build_bundle(embedded_default(), draft, out, dtype=dtype, log=log, draft_dtype=draft_dtype)


# An answer that copies most of its prompt: what a prompt-lookup draft is for.
GROUNDED_PROMPT = ("Fix the spelling mistakes in this text and return the whole corrected text: The comittee met on "
                   "Tuesday to discus the new budjet. After a long debate, they agreed to increse funding for public "
                   "libraries and to reduse spending on ofice supplies.")


def run_demo(
    out: Path, draft: str, prompt: str, max_new_tokens: int, draft_len: int | str, rebuild: bool, dtype: str = "int4",
    repeats: int = 3, grounded_prompt: str = GROUNDED_PROMPT,
) -> None:
    """For each prompt (the chat one, then the grounded one unless it is empty): stream one
    speculative answer, then time plain and speculative decoding of it `repeats` times each,
    alternating (the streamed run warmed both up), and print the medians, the speedup where
    the pairs show one, and whether every speculative output equals the plain one."""
    if rebuild or not _bundle_ready(out, draft, dtype):
        _export(out, draft, dtype)
    session = Session(out, prompt_cache=False)  # every run prefills its prompt: a fair comparison
    for title, text in (("chat", prompt), ("grounded", grounded_prompt)):
        if not text:
            continue
        click.echo(f"\n[{title}] > {text}\n")
        need = len(session.encode(text, chat=True)) + max_new_tokens
        if need > session.bundle.max_seq:
            click.echo(f"skipped: its {need} tokens with the answer do not fit the bundle's max sequence of "
                       f"{session.bundle.max_seq}")
            continue
        click.echo(_race(session, text, max_new_tokens, draft_len, repeats))


def _race(session: Session, prompt: str, max_new_tokens: int, draft_len: int | str, repeats: int) -> str:
    gen = session.stream(prompt, chat=True, max_new_tokens=max_new_tokens, draft_len=draft_len)
    ids: list[int] = []
    for piece in gen:
        ids += piece.token_ids
        click.echo(piece.text, nl=False)
        sys.stdout.flush()
    click.echo("\n")
    modes = {"spec": dict(draft_len=draft_len), "plain": dict(speculate=False)}
    runs = []
    for i in range(repeats):  # which of a pair runs first alternates too: neither always follows the other
        got = {mode: session.generate(prompt, chat=True, max_new_tokens=max_new_tokens, **modes[mode])
               for mode in (("plain", "spec") if i % 2 == 0 else ("spec", "plain"))}
        runs.append((got["spec"], got["plain"]))
    identical = all(s.token_ids == p.token_ids == runs[0][1].token_ids for s, p in runs) and ids == runs[0][1].token_ids
    return summary([s.stats for s, _ in runs], [p.stats for _, p in runs], identical)
