"""train.corpus: which files are documents, the deterministic held-out split, the committed manifest."""
import hashlib

import pytest

from train.corpus import (
    HELDOUT_FRACTION,
    KINDS,
    build_manifest,
    check_against_manifest,
    documents,
    join,
    load_manifest,
    python_version,
    split_of,
    xz_nats_per_byte,
)


def test_split_of_is_deterministic_and_about_five_percent():
    paths = [f"pkg/mod_{i}.py" for i in range(20000)]
    held = [p for p in paths if split_of(p) == "heldout"]
    assert [split_of(p) for p in paths] == [split_of(p) for p in paths]
    assert abs(len(held) / len(paths) - HELDOUT_FRACTION) < 0.01
    # The rule is the documented one: the first 8 hex digits of sha256(path) below 5 % of 16**8.
    assert all((int(hashlib.sha256(p.encode()).hexdigest()[:8], 16) < HELDOUT_FRACTION * 16 ** 8)
               == (p in held) for p in paths[:500])


def _fake_stdlib(root):
    (root / "pydoc_data").mkdir(parents=True)
    (root / "pydoc_data" / "topics.py").write_text("topics = {'assert': 'The assert statement', 'if': 'If.'}\n")
    (root / "json").mkdir()
    (root / "json" / "__init__.py").write_text("import sys\n")
    (root / "abc.py").write_text("x = 1\n")
    for skipped in ("test/test_abc.py", "json/tests/t.py", "idlelib/idle_test/x.py", "site-packages/p.py",
                    "test_x.py", "_sysconfigdata__linux.py", "config-3.11-x86_64-linux-gnu/m.py", "README.txt"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("secret = 1\n")
    return root


def test_documents_skips_tests_site_packages_and_build_files(tmp_path):
    docs = documents(_fake_stdlib(tmp_path))
    assert [(d.path, d.kind) for d in docs] == [
        ("abc.py", "code"), ("json/__init__.py", "code"),
        ("pydoc_data/topics.py::assert", "prose"), ("pydoc_data/topics.py::if", "prose")]
    assert docs[2].data == b"The assert statement"                    # the text, not its Python quoting
    assert all(d.split == split_of(d.path) for d in docs)


def test_documents_rejects_a_root_that_is_not_a_stdlib(tmp_path):
    with pytest.raises(ValueError, match="pydoc_data/topics.py"):
        documents(tmp_path)


def test_committed_manifest_holds_both_kinds_in_both_splits():
    m = load_manifest()
    assert m["license"] == "PSF-2.0"
    docs = m["documents"]
    for kind in KINDS:
        for split in ("train", "heldout"):
            assert any(d["kind"] == kind and d["split"] == split for d in docs), (kind, split)
    held = sum(d["num_bytes"] for d in docs if d["split"] == "heldout")
    assert 0.02 < held / sum(d["num_bytes"] for d in docs) < 0.10
    assert all(d["split"] == split_of(d["path"]) for d in docs)


def test_check_against_manifest_names_a_changed_document(tmp_path):
    docs = documents(_fake_stdlib(tmp_path))
    manifest = build_manifest(docs)
    check_against_manifest(docs, manifest)
    changed = [d._replace(data=d.data + b"#") if d.path == "abc.py" else d for d in docs]
    with pytest.raises(ValueError, match="abc.py"):
        check_against_manifest(changed, manifest)


@pytest.mark.skipif(python_version() != load_manifest()["python_version"],
                    reason="the manifest pins another Python's stdlib")
def test_installed_stdlib_matches_the_manifest():
    docs = documents()
    check_against_manifest(docs, load_manifest())
    split = join(docs)
    assert split.heldout_code and split.heldout_prose and len(split.train) > 20 * len(split.heldout_code)


def test_xz_nats_per_byte():
    assert xz_nats_per_byte(b"a" * 100000) < 0.01
    with pytest.raises(ValueError, match="data"):
        xz_nats_per_byte(b"")
