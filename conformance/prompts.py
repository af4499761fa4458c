"""The suite's prompts, as token ids of the engine under test: text built here (code and prose, which a small
byte-level model reads as well as a large one), tokenized once by the engine, then cut and joined in token space so
that two prompts share exactly the tokens a check needs them to share.

Every run draws a ``nonce`` (from ``seed``) that starts each prompt, so no prompt of a run shares a prefix with a
previous run's on a long-lived server: the first request of a prompt is a cold prefill."""
from __future__ import annotations

import random
import string
from collections.abc import Callable

FILLER = (
    "def schedule(requests, budget):\n    batch, used = [], 0\n    for req in sorted(requests, key=lambda r: r.arrival):\n"
    "        if used + req.tokens > budget:\n            break\n        batch.append(req)\n        used += req.tokens\n"
    "    return batch\n\n"
    "A recurrent layer keeps one state per sequence. The state is updated by every token, so a server that caches "
    "prefixes must store the state at the end of each cached prefix, and restore exactly that state on a hit.\n\n"
    "class Pool:\n    def __init__(self, num_pages):\n        self.free = list(range(num_pages))\n"
    "    def alloc(self, n):\n        if n > len(self.free):\n            raise MemoryError(n)\n"
    "        pages, self.free = self.free[:n], self.free[n:]\n        return pages\n\n"
    "The scheduler admits a request only when its pages and one state slot fit. Decode rows go first, then the "
    "prefill chunks of the prompts that were admitted, in the order they arrived.\n\n"
    "def lookup(cache, tokens, block):\n    hit = 0\n    for i in range(0, len(tokens) - block + 1, block):\n"
    "        if tuple(tokens[: i + block]) not in cache:\n            break\n        hit = i + block\n    return hit\n\n"
    "Speculative decoding proposes a few tokens, verifies them in one forward and keeps the longest accepted run; "
    "the state must then be rolled back to the last accepted token.\n"
)
LOOP = "for i in range(10):\n    total = total + i * i\n    print(i, total)\n"     # repeats: n-gram drafts accepted


class Prompts:
    """Prompts of one run. ``seed``: draws the nonce and the needles; ``tokenize``: text -> token ids of the engine
    under test (its ``/tokenize``, or UTF-8 bytes for a byte-level model). Tokenized texts are cached."""

    def __init__(self, seed: int, tokenize: Callable[[str], list]):
        rng = random.Random(seed)
        self.seed = seed
        self.nonce = "".join(rng.choices(string.ascii_lowercase + string.digits, k=8))
        self.needles = tuple("-".join("".join(rng.choices(string.ascii_uppercase + string.digits, k=4))
                                      for _ in range(3)) for _ in range(2))
        self._tokenize, self._cache = tokenize, {}

    def ids(self, text: str) -> list:
        if text not in self._cache:
            self._cache[text] = list(self._tokenize(text))
        return list(self._cache[text])

    def head(self, label: str) -> list:
        """The opening tokens of prompt ``label``: its label and the run's nonce (unique per run and label)."""
        return self.ids(f"# {label} {self.nonce}\n")

    def filler(self, n: int, offset: int = 0) -> list:
        """``n`` tokens of the filler text, starting ``offset`` tokens in (wrapping around)."""
        base = self.ids(FILLER)
        reps = -(-(n + offset) // len(base)) + 1
        return (base * reps)[offset: offset + n]

    def plain(self, label: str, n: int, offset: int = 0) -> list:
        """A prompt of ``n`` tokens: ``label``'s head, then filler."""
        head = self.head(label)
        return head + self.filler(max(0, n - len(head)), offset)

    def repetitive(self, label: str, n: int) -> list:
        """A prompt of ``n`` tokens that repeats a short loop, so prompt-lookup drafts are accepted."""
        head, body = self.head(label), self.ids(LOOP)
        return head + (body * (n // len(body) + 2))[: max(0, n - len(head))]

    def needle(self, label: str, n: int, which: int = 0) -> list:
        """A prompt of ``n`` tokens whose first line holds needle ``which`` (0 or 1: the same length, other
        characters), then filler, then a line that asks for the needle again."""
        first = self.head(label) + self.ids(f"The passcode is {self.needles[which]}.\n")
        ask = self.ids("\nAgain, the passcode is ")
        return first + self.filler(max(0, n - len(first) - len(ask))) + ask

    def needle_span(self, label: str) -> int:
        """Tokens up to the end of the needle's line (the needle lies within them)."""
        return len(self.head(label) + self.ids(f"The passcode is {self.needles[0]}.\n"))
