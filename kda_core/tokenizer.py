"""The byte-level tokenizer of our Kimi-Linear checkpoints, as Hugging Face tokenizer files.

Our vocabulary is the 256 byte values: token id ``b`` is the byte ``b``, so a text's ids are exactly its UTF-8
bytes (``list(text.encode("utf-8"))``) and any id sequence decodes (invalid UTF-8 becomes U+FFFD, as Python's
``bytes.decode("utf-8", errors="replace")`` does). :func:`write_tokenizer` writes it into a model folder as the
files ``transformers.AutoTokenizer.from_pretrained(folder)`` loads and llama.cpp's converter reads:

- ``tokenizer.json``: a ``tokenizers`` BPE model whose vocabulary is the 256 one-byte tokens, each spelled with
  GPT-2's printable stand-in for its byte (``bytes_to_unicode`` of openai/gpt-2 ``src/encoder.py``; the same table
  as ``tokenizers``' ``ByteLevel`` and llama.cpp's ``unicode_byte_to_utf8``), and **no merges**. The
  pre-tokenizer is ``ByteLevel`` without its split regex (the whole text is one piece, mapped byte by byte) and the
  decoder is ``ByteLevel``. With no merges a piece becomes its bytes whatever the split, so any pre-tokenizer
  gives these ids; llama.cpp's own split (see ``bench/llama_cpp.py``) gives the same.
- ``tokenizer_config.json``: no BOS / EOS added, no clean-up of spaces on decode (so decode(encode(t)) == t).

No special tokens: every id of the 256 is a byte, and a token outside them would be an id the model's
embedding (``vocab_size`` 256) does not have. Needs only the ``tokenizers`` package (which transformers uses).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

BYTE_VOCAB_SIZE = 256
MODEL_MAX_LENGTH = 1_048_576  # the real Kimi-Linear config's model_max_length, in tokens


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (openai/gpt-2 ``src/encoder.py``): printable Latin-1 bytes map to
    themselves, the other 68 bytes to U+0100.. in byte order. Returns a dict of 256 entries, byte -> one char."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(BYTE_VOCAB_SIZE) if b not in table]
    table.update({b: chr(BYTE_VOCAB_SIZE + i) for i, b in enumerate(others)})
    return dict(sorted(table.items()))


def byte_tokenizer() -> Tokenizer:
    """The byte-level ``tokenizers.Tokenizer``: vocabulary {GPT-2 char of byte b: b} for b in 0..255, no merges."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def tokenizer_config() -> dict:
    """``tokenizer_config.json``: the fast tokenizer class, nothing added around a text, decode left verbatim."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
    }


def write_tokenizer(folder: str | Path) -> list[Path]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder`` (created if absent; existing files
    of those names are replaced). Returns the paths written. Raises ``NotADirectoryError`` if ``folder`` is a
    file."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"folder {str(folder)!r} is a file, not a model folder")
    folder.mkdir(parents=True, exist_ok=True)
    tok_path, cfg_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
    byte_tokenizer().save(str(tok_path))
    cfg_path.write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return [tok_path, cfg_path]
