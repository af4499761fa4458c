"""Page 07 in one call: :func:`lab.prefix.anatomy` (prompts through a cached engine, then the two-phase
lookup of the last one explained) as the frames the page draws."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from lab.prefix import ANATOMY_BLOCK_COLUMNS, anatomy
from serve.errors import check_int

MAX_PROMPTS = 16            # prompts in one view: each earlier one is a prefill into the cache (pages grow with them)
MAX_TEXT_BYTES = 4_000      # all prompts together, UTF-8 bytes = tokens (byte-level model)
MAX_TEXT_CHARS = MAX_TEXT_BYTES  # the page's text box holds at most this many characters (a character is >= 1 byte)
MAX_INTERVALS = 128         # checkpoint intervals in all, sum of ceil(tokens / C): the engine prefills up to each
                            # boundary, so the wait grows with tokens / C (C = 4: 2,000 tokens took 16 s, 540 MiB)


def prompt_intervals(prompts: Sequence[str | Sequence[int]], interval: int) -> int:
    """Checkpoint intervals of ``prompts`` at ``interval`` C tokens: the sum over the prompts of ceil(tokens / C).
    Raises ValueError unless ``interval`` is an int >= 1."""
    check_int("interval", interval)
    return sum(-(-_tokens(p) // interval) for p in prompts)


def _tokens(prompt: str | Sequence[int]) -> int:
    return len(prompt.encode("utf-8")) if isinstance(prompt, str) else len(prompt)


def check_prompts(prompts: Sequence[str | Sequence[int]], interval: int) -> None:
    """Raise ValueError unless ``prompts`` (texts, or token ids) are at most :data:`MAX_PROMPTS`, hold at most
    :data:`MAX_TEXT_BYTES` tokens in all (a text's tokens are its UTF-8 bytes) and at most :data:`MAX_INTERVALS`
    checkpoint intervals at ``interval`` C (:func:`prompt_intervals`). Unbounded, two prompts of 30,000 characters
    took 99 s and 2.46 GB, and 2,000 short prompts asked torch for 3.9 GB of cache pages."""
    if len(prompts) > MAX_PROMPTS:
        raise ValueError(f"prompts: {len(prompts):,} prompts, over the limit of {MAX_PROMPTS}; keep at most "
                         f"{MAX_PROMPTS} lines")
    tokens = sum(_tokens(p) for p in prompts)
    if tokens > MAX_TEXT_BYTES:
        raise ValueError(f"prompts: {tokens:,} bytes in all (UTF-8; bytes are tokens), over the limit of "
                         f"{MAX_TEXT_BYTES:,}; shorten them")
    intervals = prompt_intervals(prompts, interval)
    if intervals > MAX_INTERVALS:
        raise ValueError(f"prompts: {intervals:,} checkpoint intervals of C = {interval} tokens in all, over the limit "
                         f"of {MAX_INTERVALS}; shorten the prompts or raise C (N or C / N)")


@dataclass(frozen=True)
class AnatomyView:
    """Page 07's frames. blocks: :data:`ANATOMY_BLOCK_COLUMNS` per (prompt, full block); tails: the partial
    block of each prompt (prompt, start, tokens; never cached); checkpoints: one row per (checkpoint, prompt
    whose block ends at its boundary with its key): boundary, group, prompt, y (row offset of the marker),
    key; steps: the two-phase lookup of the last prompt; droppable: boundaries of the previous prompt that
    hold a checkpoint here (the what-if choices, taken from the run without a drop); the rest as in :class:`Anatomy`."""

    blocks: pd.DataFrame
    tails: pd.DataFrame
    checkpoints: pd.DataFrame
    steps: pd.DataFrame
    droppable: list
    num_tokens: int
    kv_tokens: int
    dropped: tuple | None
    prompt_tokens: list


def anatomy_view(prompts: Sequence[str | Sequence[int]], block_size: int = 16, interval: int = 32,
                 num_groups: int = 2, drop: tuple[int, int] | None = None, preset: str = "demo") -> AnatomyView:
    """:func:`anatomy` as frames for page 07. Raises ValueError as :func:`anatomy` does, and over the page's
    bounds (:func:`check_prompts`)."""
    check_prompts(prompts, interval)
    res = anatomy(prompts, block_size, interval, num_groups, drop, preset)
    blocks = pd.DataFrame(res.blocks, columns=ANATOMY_BLOCK_COLUMNS)
    tails = pd.DataFrame([dict(prompt=i, start=n // block_size * block_size, tokens=n % block_size)
                          for i, n in enumerate(res.prompt_tokens) if n % block_size],
                         columns=["prompt", "start", "tokens"])
    points = []
    for c in res.checkpoints:
        for p in blocks[(blocks.end == c["boundary"]) & (blocks.key == c["key"][:8])].prompt:
            points.append(dict(boundary=c["boundary"], group=c["group"], prompt=p,
                               y=p + 0.25 + 0.12 * c["group"], key=c["key"]))
    points = pd.DataFrame(points, columns=["boundary", "group", "prompt", "y", "key"])
    prev = points[points.prompt == len(res.prompt_tokens) - 2]
    droppable = sorted(int(b) for b in prev.boundary.unique())
    return AnatomyView(blocks, tails, points, pd.DataFrame(res.steps), droppable, res.num_tokens, res.kv_tokens,
                       res.dropped, res.prompt_tokens)
