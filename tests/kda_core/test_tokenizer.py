"""kda_core.tokenizer: the written folder loads in transformers' AutoTokenizer and maps text <-> its UTF-8 bytes."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from kda_core.tokenizer import BYTE_VOCAB_SIZE, bytes_to_unicode, write_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte_tokenizer")
    write_tokenizer(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_bytes_to_unicode_is_gpt2_byte_level_alphabet():
    table = bytes_to_unicode()
    assert list(table) == list(range(BYTE_VOCAB_SIZE))
    assert all(len(ch) == 1 for ch in table.values()) and len(set(table.values())) == BYTE_VOCAB_SIZE
    assert set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())   # the tokenizers library's own table
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120" and table[ord("\n")] == "\u010a"


def test_write_tokenizer_files(tmp_path):
    paths = write_tokenizer(tmp_path / "model")
    assert [p.name for p in paths] == ["tokenizer.json", "tokenizer_config.json"]
    spec = json.loads(paths[0].read_text())
    assert spec["model"]["type"] == "BPE" and spec["model"]["merges"] == []
    assert sorted(spec["model"]["vocab"].values()) == list(range(BYTE_VOCAB_SIZE))
    assert spec["added_tokens"] == []


def test_write_tokenizer_refuses_a_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{}")
    with pytest.raises(NotADirectoryError, match="config.json"):
        write_tokenizer(path)


def test_vocabulary_is_the_bytes(tok):
    assert len(tok) == BYTE_VOCAB_SIZE and tok.all_special_ids == []
    table = bytes_to_unicode()
    assert tok.get_vocab() == {ch: b for b, ch in table.items()}
    assert [tok.decode([b]) for b in range(128)] == [chr(b) for b in range(128)]


@pytest.mark.parametrize("text", [
    pytest.param("Hello, world. a , b ; c !", id="ascii-punctuation"),
    pytest.param("  two leading spaces\n\ttab and CRLF\r\n", id="whitespace"),
    pytest.param("héllo naïve façade Ångström", id="accents"),
    pytest.param("🦙 😶\u200d🌫️ ✅ 👩🏽\u200d💻", id="emoji-zwj"),
    pytest.param("我想在apple工作 нещо на Български", id="cjk-cyrillic"),
    pytest.param("\x00\x0b\x7f", id="control-bytes"),
    pytest.param("", id="empty"),
])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(tok, text):
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


@pytest.mark.parametrize("ids", [
    pytest.param([0xFF, 0x41], id="ff"),
    pytest.param([0xC3], id="truncated-2-byte"),
    pytest.param([0xE2, 0x82, 0x42], id="truncated-3-byte"),
    pytest.param([0xF0, 0x9F, 0xA6], id="truncated-4-byte"),
    pytest.param([0x80, 0xBF, 0x41], id="lone-continuations"),
    pytest.param([0xED, 0xA0, 0x80], id="surrogate"),
])
def test_decode_invalid_utf8_like_python(tok, ids):
    assert tok.decode(ids) == bytes(ids).decode("utf-8", errors="replace")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, BYTE_VOCAB_SIZE - 1), max_size=40))
def test_decode_any_ids_like_python(tok, ids):
    assert tok.decode(ids) == bytes(ids).decode("utf-8", errors="replace")
