"""What the pages show about the trained demo model, read from files, without torch: its card (size,
training, held-out quality beside xz) from the export's ``manifest.json``, and Home's held-out code prompts
(:mod:`train.prompts`, the rule that picked them and the cuts it passed over)."""
from __future__ import annotations

import json
from typing import NamedTuple

from lab.models import TRAINED_WEIGHTS
from train.prompts import load_prompts


class ModelCard(NamedTuple):
    """The shipped ``demo`` weights (``weights/kda-demo/manifest.json``, written by ``python -m train.export``).

    name: model id; num_parameters; step: training step exported; bytes_trained: training bytes (= tokens)
    seen; hours: wall-clock training time; where: the machine; code_nats_per_byte / prose_nats_per_byte:
    mean next-byte cross-entropy on held-out code / prose windows (nats); code_xz / prose_xz: xz (LZMA
    preset 9e) on the same held-out bytes, nats per byte; code_top1: greedy next-byte accuracy on code."""

    name: str
    num_parameters: int
    step: int
    bytes_trained: int
    hours: float
    where: str
    code_nats_per_byte: float
    code_xz: float
    prose_nats_per_byte: float
    prose_xz: float
    code_top1: float


def model_card() -> ModelCard:
    """The card of the trained ``demo`` model. Raises ValueError if the shipped manifest is missing."""
    path = TRAINED_WEIGHTS["demo"] / "manifest.json"
    if not path.is_file():
        raise ValueError(f"the trained demo model's manifest {path} is missing")
    m = json.loads(path.read_text())
    q, t = m["quality"], m["training"]
    return ModelCard(m["model"], m["num_parameters"], t["step"], t["bytes_trained"], t["hours"], t["where"],
                     q["code"]["nats_per_byte"], q["code"]["xz_nats_per_byte"], q["prose"]["nats_per_byte"],
                     q["prose"]["xz_nats_per_byte"], q["code"]["top1"])


class HomePrompts(NamedTuple):
    """Home's default pair: ``first`` / ``second``: the held-out file ``path`` up to the bodies of two
    consecutive functions (``second`` starts with all of ``first``); ``function``: the one ``second``
    stops in; ``continuation``: the greedy bytes the rule judged (``continuation_bytes`` of them);
    ``file_continuation``: the file's own next 64 bytes; ``cuts_tried`` / ``cuts_rejected``: how many cuts the
    rule (:mod:`train.prompts`) looked at, and passed over because their continuation was blank, a
    docstring, a loop or a training-split template."""

    first: str
    second: str
    path: str
    function: str
    continuation: str
    file_continuation: str
    cuts_tried: int
    cuts_rejected: int

    @property
    def continuation_bytes(self) -> int:
        return len(self.continuation.encode("utf-8"))


def home_prompts() -> HomePrompts:
    """Home's held-out code prompts (the committed record of ``python -m train.prompts``)."""
    r = load_prompts()
    h = r["home"]
    return HomePrompts(h["first"], h["second"], h["path"], h["function"], h["continuation"], h["file_continuation"],
                       r["cuts_tried"], len(r["rejected"]))
