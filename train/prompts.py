"""Held-out code prompts for Home: ``python -m train.prompts`` picks them by a fixed rule and writes
``train/demo_prompts.json`` (read by :func:`load_prompts`; no torch at import).

Home sends two completion requests on one held-out file, as an editor does: request 1 is the file up to the
body of one function, request 2 the file up to the body of the next (so request 2 starts with all of
request 1), and shows the model's greedy continuation of request 2. The trained model is small (about 4 M
parameters, byte-level): after some prompts its greedy bytes are spaces, a docstring or a loop. The rule
picks the first cut, in a fixed order, whose continuation reads as code, and records how many it passed over.

Rule:

1. Cuts: for each held-out code document of the corpus manifest (path order) and each function in it
   (source order), the byte offset of its first body statement after the docstring (after the statement's
   indentation: the model writes the statement). Request 2 ends at a cut b with
   ``MIN_CUT <= b <= MAX_CUT``; request 1 ends at the previous cut a of the same file (``a >= MIN_SHARED``).
2. Reads as code (:func:`reads_as_code`) on the ``CONTINUATION_BYTES`` greedy bytes of the shipped weights
   after request 2: printable ASCII and newlines only, not opening a string or a comment, no 6-byte
   sequence other than blanks more than twice (a loop), at least 60 % non-blank.
3. Novel: the file's bytes from the start of the line before b to ``b + 32`` do not occur in the training
   split (files that share a template with training files, like the generated ``encodings/cp*.py`` codecs,
   would show recall, not generalisation).

The first cut passing 2 and 3 is the Home pair. Rebuild after re-exporting the weights: the record holds the
weights' sha256 and the continuation it judged, and ``tests/train/test_prompts.py`` checks both.
"""
from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

from train.corpus import Document, check_against_manifest, documents, join, load_manifest

PROMPTS_PATH = Path(__file__).resolve().parent / "demo_prompts.json"
WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "weights" / "kda-demo"
MIN_CUT, MAX_CUT = 256, 1_200       # bytes (= tokens) of request 2: a real prefix, a prefill that stays fast
MIN_SHARED = 64                     # bytes of request 1: at least one 64-token chunk to share
CONTINUATION_BYTES = 48             # greedy bytes judged (Home's default output length)
NOVEL_AFTER = 32                    # bytes past the cut that must be absent from the training split
FILE_BYTES = 64                     # the file's own bytes after the cut kept beside it (Home's longest output)


def body_cuts(source: bytes) -> list[tuple[str, int]]:
    """(function name, byte offset) of each function's first body statement after its docstring, in source
    order (nested functions and methods included; a function whose body is only a docstring has no cut).
    Raises SyntaxError if ``source`` does not parse."""
    tree = ast.parse(source)
    line_start = [0]
    for line in source.split(b"\n"):
        line_start.append(line_start[-1] + len(line) + 1)
    cuts = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if ast.get_docstring(node, clean=False) is not None:
            body = body[1:]
        if body:        # col_offset counts UTF-8 bytes, as our offsets do
            cuts.append((node.name, line_start[body[0].lineno - 1] + body[0].col_offset))
    return sorted(cuts, key=lambda c: c[1])


def reads_as_code(text: str) -> bool:
    """True when a greedy continuation reads as code: printable ASCII and newlines only, not opening a string
    or a comment, no 6-character sequence (other than blanks) more than twice, at least 60 % non-blank characters."""
    if not text or not all(c == "\n" or (c.isascii() and c.isprintable()) for c in text):
        return False
    if text.lstrip().startswith(('"', "'", "#")):
        return False
    grams = [g for g in (text[i:i + 6] for i in range(len(text) - 5)) if not g.isspace()]   # indentation repeats
    if grams and max(grams.count(g) for g in grams) > 2:
        return False
    return sum(not c.isspace() for c in text) >= 0.6 * len(text)


def candidates(docs: list[Document]):
    """Every (path, previous cut a, cut b, function name) of rule step 1, in rule order."""
    for doc in docs:
        if doc.split != "heldout" or doc.kind != "code":
            continue
        try:
            cuts = body_cuts(doc.data)
        except SyntaxError:
            continue
        for (_, a), (name, b) in zip(cuts, cuts[1:]):
            if MIN_CUT <= b <= MAX_CUT and a >= MIN_SHARED:
                yield doc, a, b, name


def build(model, docs: list[Document]) -> dict:
    """Apply the rule with ``model`` (the shipped ``HybridLM``); returns the record :func:`load_prompts` reads.
    Raises ValueError if no cut passes."""
    import torch

    from kda_core.model import bytes_to_text

    train_bytes = join(docs).train
    tried, rejected = 0, []
    for doc, a, b, name in candidates(docs):
        tried += 1
        prompt = torch.tensor(list(doc.data[:b]), dtype=torch.long)[None]              # [1, b]
        tokens, _ = model.generate(prompt, CONTINUATION_BYTES)                        # [1, CONTINUATION_BYTES]
        text = bytes_to_text(tokens[0].tolist())
        window = doc.data[doc.data.rfind(b"\n", 0, doc.data.rfind(b"\n", 0, b)) + 1: b + NOVEL_AFTER]
        why = ("does not read as code" if not reads_as_code(text)
               else "template also in the training split" if window in train_bytes else None)
        if why:
            rejected.append({"path": doc.path, "function": name, "cut": b, "continuation": text, "why": why})
            continue
        return {
            "rule": __doc__.split("Rule:")[1].split("The first cut")[0].strip(),
            "weights_sha256": json.loads((WEIGHTS_DIR / "manifest.json").read_text())
            ["files"]["model.safetensors"]["sha256"],
            "home": {"path": doc.path, "document_sha256": hashlib.sha256(doc.data).hexdigest(), "function": name, "first_end": a, "second_end": b,
                     "first": doc.data[:a].decode("utf-8"), "second": doc.data[:b].decode("utf-8"),
                     "continuation": text,
                     "file_continuation": doc.data[b: b + FILE_BYTES].decode("utf-8", errors="replace")},
            "cuts_tried": tried, "rejected": rejected,
        }
    raise ValueError(f"no held-out cut of {tried} reads as code under the rule")


def load_prompts(path: Path = PROMPTS_PATH) -> dict:
    """The committed record of :func:`build` (``home``: the pair, its file and cut offsets, the judged
    continuation and the file's own next bytes; ``cuts_tried`` / ``rejected``: the cuts passed over, why)."""
    return json.loads(Path(path).read_text())


def main() -> None:
    import torch

    from kda_core.model import HybridLM

    torch.set_num_threads(1)
    docs = documents()
    check_against_manifest(docs, load_manifest())
    record = build(HybridLM.from_pretrained(WEIGHTS_DIR), docs)
    PROMPTS_PATH.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    home = record["home"]
    print(f"{home['path']} {home['function']}: request 1 = {home['first_end']} bytes, request 2 = "
          f"{home['second_end']} bytes; cut {record['cuts_tried']} of those tried "
          f"({len(record['rejected'])} passed over)\n{home['continuation']!r}")


if __name__ == "__main__":
    main()
