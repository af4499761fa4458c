"""The training corpus: the installed Python's standard library (code) and its pydoc topics (English prose).

Both are PSF-2.0 licensed and present with every CPython, so the corpus is rebuilt offline from the
interpreter that runs the builder; only its manifest is committed (``train/corpus_manifest.json``:
per document the path, kind, split, byte count and sha256, with the Python version and the license).

Documents:

- code: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` except tests (any directory named
  ``test``, ``tests`` or ``idle_test``, any file ``test_*.py``), ``site-packages``, ``pydoc_data`` and the
  build-specific ``_sysconfigdata_*`` / ``config-*`` files (they hold this machine's paths).
- prose: the help texts of ``pydoc_data/topics.py`` (the ``topics`` dict, one document per topic,
  the strings themselves, not their Python quoting).

Held-out split by whole documents: a document is held out when the first 8 hex digits of
``sha256(path)`` taken as an integer are ``< HELDOUT_FRACTION * 16**8`` (about 5 %, deterministic, the same on
every machine). Run ``python -m train.corpus`` to rebuild and rewrite the manifest; it prints the split
sizes and xz's nats per byte on the held-out documents (the compression baseline).
"""
from __future__ import annotations

import ast
import hashlib
import json
import lzma
import math
import os
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple

LICENSE = "PSF-2.0"
HELDOUT_FRACTION = 0.05
MANIFEST_PATH = Path(__file__).resolve().parent / "corpus_manifest.json"
PROSE_FILE = "pydoc_data/topics.py"
KINDS = ("code", "prose")
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data"}


class Document(NamedTuple):
    """One corpus document: ``path`` relative to the stdlib root (prose: ``pydoc_data/topics.py::<topic>``),
    ``kind`` ("code" or "prose"), ``split`` ("train" or "heldout"), ``data`` its UTF-8 bytes."""

    path: str
    kind: str
    split: str
    data: bytes


def split_of(path: str) -> str:
    """"heldout" for about ``HELDOUT_FRACTION`` of paths (by the sha256 of the path), else "train"."""
    h = int(hashlib.sha256(path.encode("utf-8")).hexdigest()[:8], 16)
    return "heldout" if h < HELDOUT_FRACTION * 16 ** 8 else "train"


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_code_file(rel: Path) -> bool:
    if rel.suffix != ".py" or any(part in _EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
        return False
    return not (rel.name.startswith("test_") or rel.name.startswith("_sysconfigdata_"))


def documents(root: Path | None = None) -> list[Document]:
    """Every corpus document of the stdlib at ``root`` (default: this interpreter's), sorted by path.

    Raises ValueError if ``root`` holds no ``pydoc_data/topics.py`` (not a CPython stdlib)."""
    root = stdlib_root() if root is None else Path(root)
    prose_path = root / PROSE_FILE
    if not prose_path.is_file():
        raise ValueError(f"root must be a CPython standard library with {PROSE_FILE}, got {root}")
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for name in sorted(filenames):
            rel = (Path(dirpath) / name).relative_to(root)
            if _is_code_file(rel):
                path = rel.as_posix()
                docs.append(Document(path, "code", split_of(path), (root / rel).read_bytes()))
    tree = ast.parse(prose_path.read_text(encoding="utf-8"))
    topics = next(ast.literal_eval(node.value) for node in tree.body
                  if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "topics")
    for topic in sorted(topics):
        path = f"{PROSE_FILE}::{topic}"
        docs.append(Document(path, "prose", split_of(path), topics[topic].encode("utf-8")))
    return sorted(docs, key=lambda d: d.path)


def python_version() -> str:
    """``major.minor.micro`` of the running interpreter (the corpus source version)."""
    return ".".join(str(x) for x in sys.version_info[:3])


def build_manifest(docs: list[Document]) -> dict:
    """The manifest of ``docs``: source, license, Python version, split rule and one entry per document."""
    return {
        "source": "CPython standard library (non-test .py files) and pydoc_data/topics.py help texts",
        "license": LICENSE,
        "python_version": python_version(),
        "heldout_rule": f"sha256(path)[:8] as int < {HELDOUT_FRACTION} * 16**8",
        "documents": [{"path": d.path, "kind": d.kind, "split": d.split, "num_bytes": len(d.data),
                       "sha256": hashlib.sha256(d.data).hexdigest()} for d in docs],
    }


def load_manifest(path: Path = MANIFEST_PATH) -> dict:
    """The committed manifest (a dict as :func:`build_manifest` returns)."""
    return json.loads(Path(path).read_text())


def check_against_manifest(docs: list[Document], manifest: dict) -> None:
    """Raise ValueError unless ``docs`` are exactly the manifest's documents (paths, splits and sha256):
    the corpus a run trains on is the one the manifest pins."""
    got = build_manifest(docs)["documents"]
    want = manifest["documents"]
    if got != want:
        diff = sorted({e["path"] for e in got} ^ {e["path"] for e in want}) or sorted(
            g["path"] for g, w in zip(got, want) if g != w)
        raise ValueError(f"the installed Python {python_version()} stdlib differs from the corpus manifest "
                         f"(Python {manifest['python_version']}): {len(diff)} document(s) differ, e.g. {diff[:3]}")


class Split(NamedTuple):
    """Concatenated bytes of one split: ``train`` (code and prose together) and the held-out documents
    of each kind (``heldout_code``, ``heldout_prose``). Documents are joined as they are (each ends
    with its own bytes; no separator token)."""

    train: bytes
    heldout_code: bytes
    heldout_prose: bytes


def join(docs: list[Document]) -> Split:
    """Concatenate the documents of each split, in path order."""
    def cat(split, kind=None):
        return b"".join(d.data for d in docs if d.split == split and (kind is None or d.kind == kind))
    return Split(cat("train"), cat("heldout", "code"), cat("heldout", "prose"))


def xz_nats_per_byte(data: bytes) -> float:
    """xz (LZMA, preset 9 extreme) compressed size of ``data`` in nats per input byte: ``8 ln 2 * out / in``."""
    if not data:
        raise ValueError("data must not be empty")
    return 8 * math.log(2) * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / len(data)


def main() -> None:
    docs = documents()
    manifest = build_manifest(docs)
    MANIFEST_PATH.write_text(json.dumps(manifest, indent=1) + "\n")
    split = join(docs)
    for kind in KINDS:
        n = {s: sum(1 for d in docs if d.kind == kind and d.split == s) for s in ("train", "heldout")}
        b = {s: sum(len(d.data) for d in docs if d.kind == kind and d.split == s) for s in ("train", "heldout")}
        print(f"{kind}: train {n['train']} docs / {b['train']:,} bytes, held-out {n['heldout']} docs / "
              f"{b['heldout']:,} bytes")
    print(f"xz on held-out code: {xz_nats_per_byte(split.heldout_code):.3f} nats/byte; "
          f"prose: {xz_nats_per_byte(split.heldout_prose):.3f} nats/byte")
    print(f"wrote {MANIFEST_PATH} (Python {manifest['python_version']}, {len(docs)} documents)")


if __name__ == "__main__":
    main()
