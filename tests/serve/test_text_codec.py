"""serve.text_codec: the shipped byte vocabulary, and a folder's tokenizer.json (a BPE with merges)."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kda_core.tokenizer import write_tokenizer
from serve.text_codec import ByteCodec, TokenizerCodec, is_byte_tokenizer, load_codec

SHIPPED = Path(__file__).resolve().parents[2] / "weights" / "kda-demo"


def bpe_folder(folder: Path) -> Path:
    """A folder whose tokenizer.json is a byte-level BPE with merges (not the byte vocabulary)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["def main():\n    return 0\n", "héllo wörld — ünïcode ✓ 🙂"] * 20, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_shipped_and_written_byte_tokenizers_are_the_byte_codec(tmp_path):
    assert isinstance(load_codec(SHIPPED), ByteCodec)
    write_tokenizer(tmp_path)
    assert is_byte_tokenizer(tmp_path / "tokenizer.json") and isinstance(load_codec(tmp_path), ByteCodec)
    assert isinstance(load_codec(tmp_path / "none"), ByteCodec)          # no tokenizer.json: bytes


def test_a_bpe_tokenizer_json_runs_through_tokenizers(tmp_path):
    codec = load_codec(bpe_folder(tmp_path))
    assert isinstance(codec, TokenizerCodec) and codec.vocab_size > 256
    text = "def main():\n    return 0\n"
    ids = codec.encode(text)
    assert len(ids) < len(text.encode()) and codec.decode(ids) == text


@settings(max_examples=30, deadline=None)
@given(text=st.text(min_size=1, max_size=40), cuts=st.lists(st.integers(1, 4), min_size=1, max_size=20))
def test_streamed_pieces_join_to_the_whole_decode(tmp_path_factory, text, cuts):
    """Fed in pieces (a character's tokens split across pieces), the decoders emit exactly the whole decode."""
    for codec in (ByteCodec(), load_codec(bpe_folder(tmp_path_factory.mktemp("bpe")))):
        ids, out, dec, i = codec.encode(text), [], codec.decoder(), 0
        for n in cuts * (len(ids) + 1):
            if i >= len(ids):
                break
            out.append(dec.feed(ids[i: i + n]))
            i += n
        out.append(dec.feed([], final=True))
        assert "".join(out) == codec.decode(ids) == text


def test_a_broken_tokenizer_json_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_codec(tmp_path)
