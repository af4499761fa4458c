"""Text <-> token ids for a served model: the byte vocabulary of the shipped models, or a checkpoint folder's
``tokenizer.json``.

A model folder in Kimi-Linear's format (:mod:`kda_core.pretrained`) carries its tokenizer. The shipped byte
models' ``tokenizer.json`` (:mod:`kda_core.tokenizer`) maps every byte to its own id, so :class:`ByteCodec` encodes
a text to exactly its UTF-8 bytes without running a tokenizer; any other ``tokenizer.json`` (the real 48B
checkpoint's, say) runs through the ``tokenizers`` package (:class:`TokenizerCodec`). Token-id prompts never go
through a codec: they only have to be ids of the model's vocabulary.

Both decode incrementally for streaming: a character split across tokens waits until it is whole, and the text
of all the pieces equals one decode of the whole output (invalid UTF-8 as U+FFFD, Python's ``errors="replace"``).
"""
from __future__ import annotations

import codecs
import json
from pathlib import Path

TOKENIZER_NAME = "tokenizer.json"


class ByteCodec:
    """One token per UTF-8 byte (ids 0..255)."""

    vocab_size = 256
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``. Raises UnicodeEncodeError for a lone surrogate."""
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def decoder(self) -> _ByteDecoder:
        """An incremental decoder: ``feed(ids, final=False) -> str``."""
        return _ByteDecoder()


class _ByteDecoder:
    def __init__(self):
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: list[int], final: bool = False) -> str:
        return self._dec.decode(bytes(ids), final=final)


class TokenizerCodec:
    """A ``tokenizers`` tokenizer read from a ``tokenizer.json`` (no special tokens added on encode)."""

    name = "tokenizer.json"

    def __init__(self, path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def decoder(self) -> _TokenizerDecoder:
        return _TokenizerDecoder(self)


class _TokenizerDecoder:
    """Decodes the whole output so far and emits what is new, holding back a trailing U+FFFD (a character whose
    last token has not come yet) until the next feed or the final one."""

    def __init__(self, codec: TokenizerCodec):
        self.codec, self.ids, self.sent = codec, [], ""

    def feed(self, ids: list[int], final: bool = False) -> str:
        self.ids += list(ids)
        text = self.codec.decode(self.ids)
        if not final and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        if not text.startswith(self.sent):          # a tokenizer rewrote earlier text: send nothing until it settles
            return ""
        new, self.sent = text[len(self.sent):], text
        return new


def is_byte_tokenizer(path) -> bool:
    """Whether ``path`` (a ``tokenizer.json``) is the byte vocabulary: 256 tokens, no merges, no added tokens,
    each byte's GPT-2 stand-in at the byte's id (what :func:`kda_core.tokenizer.write_tokenizer` writes)."""
    from kda_core.tokenizer import bytes_to_unicode

    try:
        d = json.loads(Path(path).read_text())
        model = d["model"]
        return (model.get("type") == "BPE" and not model.get("merges") and not d.get("added_tokens")
                and model.get("vocab") == {ch: b for b, ch in bytes_to_unicode().items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def load_codec(folder) -> ByteCodec | TokenizerCodec:
    """The codec of a model folder: :class:`ByteCodec` when it has no ``tokenizer.json`` or the byte one, else a
    :class:`TokenizerCodec` of its ``tokenizer.json``. Raises ValueError for a ``tokenizer.json`` that the
    ``tokenizers`` package cannot read."""
    path = Path(folder) / TOKENIZER_NAME
    if not path.is_file() or is_byte_tokenizer(path):
        return ByteCodec()
    try:
        return TokenizerCodec(path)
    except Exception as e:  # tokenizers raises its own Exception type for a malformed file
        raise ValueError(f"{path} is not a tokenizer the tokenizers package can read ({e})") from None


BYTES = ByteCodec()
