"""Sections of the READMEs that a bench command writes from its results file (so no figure in them is typed by
hand): :func:`replace_section` on text, :func:`write_section` on a file."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH_README = REPO / "bench" / "README.md"


def replace_section(text: str, heading: str, section: str, before: str) -> str:
    """``text`` with the section starting at line ``heading`` (up to the next ``## `` line) replaced by
    ``section`` (heading included); if there is none, ``section`` goes in before the line ``before``.
    Raises ValueError if neither is a line of ``text``."""
    pat = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.M | re.S)
    if m := pat.search(text):
        return text[:m.start()] + section + ("\n" if m.end() < len(text) else "") + text[m.end():]
    if f"\n{before}\n" not in text:
        raise ValueError(f"neither {heading!r} nor {before!r} is a line of the file")
    return text.replace(f"\n{before}\n", f"\n{section}\n{before}\n", 1)


def write_section(heading: str, body: str, before: str, path: Path = BENCH_README) -> None:
    """Rewrite the section ``heading`` of the file ``path`` as ``heading``, a blank line and ``body``
    (see :func:`replace_section` for ``before``). Raises ValueError as it does."""
    section = f"{heading}\n\n{body.strip()}\n"
    path.write_text(replace_section(path.read_text(), heading, section, before))
