"""Two greedy completions of the same prompt compared: :func:`compare` gives the :class:`Diff` (the first
differing token, max |delta logprob| over the positions both produced the same token) and whether they match under
a rule: ``exact`` (the same tokens, every chosen-token logprob within ``atol``) or ``close`` (vLLM's
``check_logprobs_close`` in ``tests/models/utils.py``: up to the first differing token the outputs agree, and there
each run's token is among the other's top logprobs; a tie flipped by rounding, not a wrong state)."""
from __future__ import annotations

from typing import NamedTuple

from conformance.client import Completion

MATCH_RULES = ("exact", "close")


class Diff(NamedTuple):
    """``match`` under the rule; ``first_diff``: the first position whose token differs (None: none);
    ``tokens``: the two tokens there; ``max_dlogprob``: max |delta logprob| of the chosen token over the
    positions before ``first_diff`` (None without logprobs); ``compared``: positions compared; ``reason``: why
    not a match ('' when it is); ``unreported``: compared positions where a run has no logprob (the engine did not
    compute it), whose tokens alone were compared."""

    match: bool
    first_diff: int | None
    tokens: tuple
    max_dlogprob: float | None
    compared: int
    reason: str
    unreported: int = 0

    def evidence(self) -> dict:
        return {"first_diff": self.first_diff, "tokens_at_first_diff": list(self.tokens),
                "max_abs_dlogprob": self.max_dlogprob, "positions_compared": self.compared,
                "positions_without_logprobs": self.unreported}

    def summary(self) -> str:
        if self.match:
            lp = "" if self.max_dlogprob is None else f", max |dlogprob| {self.max_dlogprob:.2e}"
            missing = f" ({self.unreported} without logprobs: tokens only)" if self.unreported else ""
            return f"{self.compared} tokens equal{lp}{missing}"
        return self.reason


def compare(a: Completion, b: Completion, rule: str = "exact", atol: float = 1e-3) -> Diff:
    """Compare completion ``a`` (the reference) with ``b``. A failed request is never a match. Without token
    lists (an engine that returned no logprobs) the texts are compared; with them, the texts must agree too (an
    engine may list logprobs for only some tokens). Raises ValueError for an unknown rule."""
    if rule not in MATCH_RULES:
        raise ValueError(f"rule must be one of {MATCH_RULES}, got {rule!r}")
    for name, c in (("reference", a), ("compared", b)):
        if c.error is not None:
            return Diff(False, None, (), None, 0, f"the {name} request failed: {c.error}")
    if a.tokens is None or b.tokens is None:
        same = a.text == b.text
        first = None if same else next((i for i, (x, y) in enumerate(zip(a.text, b.text)) if x != y),
                                       min(len(a.text), len(b.text)))
        return Diff(same, first, () if same else (a.text[first: first + 8], b.text[first: first + 8]), None,
                    len(a.text), "" if same else f"texts differ from character {first}")
    n = min(len(a.tokens), len(b.tokens))
    first = next((i for i in range(n) if a.tokens[i] != b.tokens[i]), None)
    if first is None and len(a.tokens) != len(b.tokens):
        first = n
    upto = n if first is None else first
    dlp, unreported = None, 0
    if a.logprobs is not None and b.logprobs is not None and upto:
        pairs = list(zip(a.logprobs[:upto], b.logprobs[:upto]))
        both = [abs(x - y) for x, y in pairs if x is not None and y is not None]
        unreported = len(pairs) - len(both)
        dlp = max(both) if both else None
    pair = () if first is None or first >= n else (a.tokens[first], b.tokens[first])
    if first is not None:
        if rule == "close" and first < n and _in_top(a, b, first):
            return Diff(True, first, pair, dlp, upto, "", unreported)
        return Diff(False, first, pair, dlp, upto,
                    f"token {first} differs: {pair[0]!r} vs {pair[1]!r}" if pair else
                    f"lengths differ: {len(a.tokens)} vs {len(b.tokens)} tokens", unreported)
    if a.text != b.text:                            # tokens listed for only some positions (llama.cpp) agree
        return Diff(False, None, (), dlp, upto, f"the {upto} listed tokens agree but the texts differ: "
                    f"{a.text[:40]!r} vs {b.text[:40]!r}", unreported)
    if rule == "exact" and dlp is not None and dlp > atol:
        return Diff(False, None, (), dlp, upto, f"same {upto} tokens but max |dlogprob| {dlp:.2e} > atol {atol:g}",
                    unreported)
    return Diff(True, None, (), dlp, upto, "", unreported)


def _in_top(a: Completion, b: Completion, i: int) -> bool:
    """vLLM's rule at the first difference: each run's token is among the other's top logprobs."""
    if a.top is None or b.top is None or a.top[i] is None or b.top[i] is None:
        return False
    return a.tokens[i] in b.top[i] and b.tokens[i] in a.top[i]
