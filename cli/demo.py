"""The main job: the embedded default model, exported once, answering a chat prompt."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from specdeploy.core.manifest import load_bundle
from specdeploy.core.errors import BundleError
from specdeploy.runtime.report import summary
from specdeploy.runtime.session import Session


DISTILLED = "distilled"
DRAFT_DTYPE = "int8"  # the distilled draft's weights: a quarter of fp32's bytes per token


def draft_folder(out: Path) -> Path:
    """Where the demo keeps the draft `specdeploy distill` trains for it."""
    return out.parent / f"{out.name}-draft"


def _bundle_ready(out: Path, draft: str, dtype: str) -> bool:
    try:
        bundle = load_bundle(out)
    except BundleError:
        return False
    if bundle.model("target").dtype != dtype:
        return False
    kind = bundle.draft_kind
    if draft == DISTILLED:
        return kind == "model" and bundle.draft.distilled is not None
    want = "self" if draft.startswith("self:") else draft
    if kind != want:
        return False
    return kind != "self" or f"self:layers={bundle.draft.layers}" == draft


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
    click.echo(f"exporting SmolLM2-135M-Instruct ({dtype}) with draft {draft} to {out} (once; later runs reuse it)", err=True)
    build_bundle(embedded_default(), draft, out, dtype=dtype, log=log, draft_dtype=draft_dtype)


def run_demo(
    out: Path, draft: str, prompt: str, max_new_tokens: int, draft_len: int | str, rebuild: bool, dtype: str = "int4"
) -> None:
    if rebuild or not _bundle_ready(out, draft, dtype):
        _export(out, draft, dtype)
    session = Session(out, prompt_cache=False)  # the plain rerun prefills too: a fair comparison
    click.echo(f"\n> {prompt}\n")
    gen = session.stream(prompt, chat=True, max_new_tokens=max_new_tokens, draft_len=draft_len)
    ids: list[int] = []
    for piece in gen:
        ids += piece.token_ids
        click.echo(piece.text, nl=False)
        sys.stdout.flush()
    click.echo("\n")
    plain = session.generate(prompt, chat=True, max_new_tokens=max_new_tokens, speculate=False)
    click.echo(summary(gen.stats, plain.stats, ids == plain.token_ids))
