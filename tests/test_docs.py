"""docs/ stays true to the code: every test that docs/invariants.md names exists (file and function), and every
repository path the maintainer's pages name in backticks exists."""
import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))


def _tests_named(text: str) -> list[tuple[str, str]]:
    """``(test file, function)`` for every ``file.py::name`` and every bare ``::name`` (the file before it) in
    backticks; a file given by its name alone is looked up under tests/ (it must be unique)."""
    out, current = [], None
    for file, name in re.findall(r"`((?:tests/)?[\w/]*test_\w+\.py)?::(\w+)", text):
        if file:
            matches = [file] if file.startswith("tests/") else [str(p.relative_to(REPO)) for p in REPO.glob(f"tests/**/{file}")]
            assert len(matches) == 1, f"{file}: {matches}"
            current = matches[0]
        assert current is not None, f"::{name} names no file"
        out.append((current, name))
    return out


def _functions(path: str) -> set[str]:
    return {n.name for n in ast.walk(ast.parse((REPO / path).read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_invariant_names_existing_tests():
    named = _tests_named((REPO / "docs" / "invariants.md").read_text())
    assert len(named) >= 40, len(named)
    missing = [f"{f}::{n}" for f, n in named if n not in _functions(f)]
    assert not missing, missing


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_paths_in_docs_exist(doc):
    paths = re.findall(r"`((?:kda_core|serve|lab|app_pages|bench|train|tests|docs)/[\w/.]+\.(?:py|md|c|json))", doc.read_text())
    missing = [p for p in paths if not (REPO / p).exists()]
    assert paths and not missing, missing


def test_serve_readme_maps_serve_only():
    """serve/README.md's table maps serve's files: it listed lab/rollback.py, lab/verify.py, lab/ring.py,
    lab/pool*.py, lab/mla_paging.py and lab/threads.py (the lab's map is lab/__init__.py); and it maps every module
    of serve/ that no package docstring table maps (the packages with their own table are listed below it)."""
    text = (REPO / "serve" / "README.md").read_text()
    files = re.findall(r"^\| [^|]+ \| `([^`]+)` \|", text, flags=re.M)
    assert files and all(f.startswith("serve/") for f in files), [f for f in files if not f.startswith("serve/")]
    top = sorted(f"serve/{p.name}" for p in (REPO / "serve").glob("*.py") if p.name != "__init__.py")
    assert not [f for f in top if f not in files], [f for f in top if f not in files]
