"""train.prompts: Home's code prompts come from a held-out file by the documented rule, are absent from the
training split, and the shipped weights still write the continuation the rule judged."""
import json

import pytest
import torch

from kda_core.model import HybridLM, bytes_to_text
from train.corpus import documents, join, load_manifest, python_version
from train.prompts import (
    CONTINUATION_BYTES,
    NOVEL_AFTER,
    WEIGHTS_DIR,
    body_cuts,
    candidates,
    load_prompts,
    reads_as_code,
)

SAME_STDLIB = pytest.mark.skipif(python_version() != load_manifest()["python_version"],
                                 reason="the manifest pins another Python's stdlib")


@pytest.fixture(scope="module")
def record():
    return load_prompts()


@pytest.fixture(scope="module")
def docs():
    return documents()


@pytest.mark.parametrize("text, ok", [
    pytest.param("self.set_handlers(self.set_handler)\n        self", True, id="code"),
    pytest.param(" " * 48, False, id="blanks"),
    pytest.param('"""Return the constructor instance to the select', False, id="docstring"),
    pytest.param("# This is a specific internal specific and the s", False, id="comment"),
    pytest.param("return self.__class__(self.__class__, self.__cla", False, id="loop"),
    pytest.param("a_value = compute(a)\n        b_value = compute(b)\n", True, id="indentation-is-no-loop"),
    pytest.param("return a\x07b", False, id="control-byte"),
])
def test_reads_as_code(text, ok):
    assert reads_as_code(text) is ok


def test_body_cuts_skip_docstrings_and_count_bytes():
    src = 'é = 1\ndef f(x):\n    """Doc."""\n    return x\n\nclass A:\n    def g(self):\n        pass\n    def h(self):\n        """Only a docstring."""\n'.encode()
    cuts = body_cuts(src)
    assert [name for name, _ in cuts] == ["f", "g"]
    assert [src[b:b + 6] for _, b in cuts] == [b"return", b"pass\n "]


def test_record_is_a_heldout_code_document_of_the_manifest_and_of_these_weights(record):
    home = record["home"]
    entry = next(d for d in load_manifest()["documents"] if d["path"] == home["path"])
    assert entry["split"] == "heldout" and entry["kind"] == "code" and entry["sha256"] == home["document_sha256"]
    assert home["second"].startswith(home["first"]) and len(home["first"].encode()) == home["first_end"]
    shipped = json.loads((WEIGHTS_DIR / "manifest.json").read_text())["files"]["model.safetensors"]["sha256"]
    assert record["weights_sha256"] == shipped, "weights re-exported: rerun python -m train.prompts"


def test_shipped_weights_write_the_judged_continuation(record):
    home = record["home"]
    model = HybridLM.from_pretrained(WEIGHTS_DIR)
    with torch.inference_mode():
        tokens, _ = model.generate(torch.tensor(list(home["second"].encode()))[None], CONTINUATION_BYTES)
    assert bytes_to_text(tokens[0].tolist()) == home["continuation"]
    assert reads_as_code(home["continuation"])


@SAME_STDLIB
def test_prompts_are_the_files_bytes_and_absent_from_the_training_split(record, docs):
    home = record["home"]
    data = next(d.data for d in docs if d.path == home["path"])
    assert data[:home["first_end"]] == home["first"].encode() and data[:home["second_end"]] == home["second"].encode()
    train = join(docs).train
    b = home["second_end"]
    assert home["second"].encode() not in train
    assert data[data.rfind(b"\n", 0, data.rfind(b"\n", 0, b)) + 1: b + NOVEL_AFTER] not in train


@SAME_STDLIB
def test_the_rule_passed_over_exactly_the_recorded_cuts_first(record, docs):
    """The pair is the first candidate in rule order that passes: every earlier candidate is recorded as
    rejected, with a continuation that fails ``reads_as_code`` or a window found in the training split."""
    order = [(d.path, b) for d, _, b, _ in candidates(docs)]
    chosen = order.index((record["home"]["path"], record["home"]["second_end"]))
    assert [(r["path"], r["cut"]) for r in record["rejected"]] == order[:chosen]
    assert record["cuts_tried"] == chosen + 1
    for r in record["rejected"]:
        assert (not reads_as_code(r["continuation"])) == (r["why"] == "does not read as code")
