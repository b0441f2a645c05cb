"""What a benchmark is asked to run: the prompts (the prompts-file format, the built-in
set) and the draft lengths (`--draft-len`, checked against the bundle).

The prompts-file format is shared: `specdeploy eval` and the scripts in benchmarks/ read
their prompts with `read_prompts` too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from specdeploy.core.errors import InputError

DEFAULT_DRAFT_LENS: tuple = (1, 2, 4, 8, "auto")
DEFAULT_PROMPTS = (
    "Explain in three short sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List the planets of the solar system in order from the sun.",
    "Give me a short recipe for pancakes.",
)


def read_prompts(path: Path) -> list[str]:
    """One prompt per non-blank line; the two characters backslash and n inside a line stand
    for a newline (prompts with code). A file that is missing or not UTF-8 text is a one-line error."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"--prompts {path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise InputError(f"--prompts {path}: {e.strerror}") from None
    return [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]


def parse_draft_lens(text: str | Sequence, max_draft: int) -> list:
    """'1,2,4,8,auto' -> [1, 2, 4, 8, 'auto'], each k checked against the bundle's max draft.

    >>> parse_draft_lens("1, 4,auto", 8)
    [1, 4, 'auto']
    """
    items = text.replace(" ", "").split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        if item in ("auto", None):
            out.append("auto")
            continue
        try:
            k = int(item)
        except (TypeError, ValueError):
            raise InputError(f"--draft-len {item!r}: expected integers or 'auto', comma separated") from None
        if not 1 <= k <= max_draft:
            raise InputError(f"--draft-len {k}: outside [1, {max_draft}] (the bundle's max draft)")
        out.append(k)
    if not out:
        raise InputError("--draft-len: give at least one draft length")
    return out
