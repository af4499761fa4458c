"""Stable hashes for routing: never Python's ``hash()`` (salted per process).

- :func:`stable_hash64` — 64-bit key from bytes/str via ``hashlib.blake2b`` (digest_size 8).
- :func:`routing_key` — the chained hash of the first ``k`` prompt blocks (a request's routing key).
- :func:`mix64` / :func:`mix64_np` — SplitMix64 finaliser (Steele et al., OOPSLA'14), scalar and numpy,
  bit-identical; used to derive per-replica scores (rendezvous) and Maglev permutations cheaply.
- :func:`ketama_hash` — the ketama 32-bit point hash (md5, 4 bytes little-endian), as libketama and
  ``uhashring`` compute it.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

import numpy as np

MASK64 = (1 << 64) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # range of a block id


def stable_hash64(data: bytes | str) -> int:
    """64-bit unsigned hash of ``data`` (blake2b, 8-byte digest, big-endian integer)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def routing_key(hash_ids: Sequence[int], k: int) -> int:
    """Routing key of a request: chained hash over its first ``k`` block ids.

    key_0 = 0; key_i = blake2b(key_{i-1} ‖ id_i) — so one key identifies the whole ``k``-block prefix.
    A prompt with fewer than ``k`` blocks uses all its blocks; an empty prompt hashes to ``stable_hash64(b"")``.
    Raises ValueError if ``k < 1`` or a block id is outside the signed 64-bit range (it is hashed as
    8 bytes; the trace loaders reject such ids first).
    """
    if k < 1:
        raise ValueError(f"k (routing prefix depth in blocks) must be >= 1, got {k}")
    return _chained_key(tuple(hash_ids[:k]))


@functools.lru_cache(maxsize=1 << 13)   # a replay routes each trace once per algorithm: the same prefixes again
def _chained_key(prefix: tuple) -> int:
    """:func:`routing_key` of the block ids ``prefix`` (already cut to ``k``); a pure function of the
    ids (an int and a numpy int of one value are one cache key and give one key). Raises as it does."""
    key = 0
    for block_id in prefix:
        if not INT64_MIN <= int(block_id) <= INT64_MAX:
            raise ValueError(f"hash_ids: a block id of {int(block_id).bit_length()} bits is outside the signed "
                             "64-bit range")
        key = stable_hash64(key.to_bytes(8, "big") + int(block_id).to_bytes(8, "big", signed=True))
    return key if prefix else stable_hash64(b"")


def mix64(x: int) -> int:
    """SplitMix64 finaliser of a 64-bit integer (bijective, avalanche)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix64_np(x: np.ndarray) -> np.ndarray:
    """Vectorised :func:`mix64` over a ``uint64`` array (wrapping arithmetic, bit-identical)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def ketama_hash(text: str, replica: int = 0) -> int:
    """ketama point hash: bytes ``4·replica .. 4·replica+3`` of md5(text), little-endian (32-bit)."""
    digest = hashlib.md5(text.encode("utf-8")).digest()
    return int.from_bytes(digest[4 * replica: 4 * replica + 4], "little")


def random_keys(num_keys: int, seed: int) -> np.ndarray:
    """``num_keys`` uniform 64-bit keys (``uint64``) from a seeded generator (for routing experiments)."""
    return np.random.default_rng(seed).integers(0, 1 << 64, size=num_keys, dtype=np.uint64, endpoint=False)
