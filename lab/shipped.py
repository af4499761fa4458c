"""Bench results shipped in the repository (``bench/results/<bench>.json``) that pages show instead of measuring
at first render: one reader for all of them and the note a page gives when one is absent."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def result_path(bench: str) -> Path:
    """``bench/results/<bench>.json``, what ``python -m bench.<bench>`` writes."""
    return RESULTS / f"{bench}.json"


def read_shipped(path: Path) -> dict | None:
    """The JSON object at ``path``, or None when there is no such file (the bench has not been run).

    Raises ValueError (naming the path) if the file holds something other than a JSON object."""
    path = Path(path)
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d


def missing_note(bench: str) -> str:
    """What a page says when ``bench/results/<bench>.json`` is absent."""
    return f"No shipped run: `python -m bench.{bench}` writes bench/results/{bench}.json."
