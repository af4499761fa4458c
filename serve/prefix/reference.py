"""Reference prefix cache: a list of ``(tokens, kind, group)`` entries scanned linearly (tests only).

Obviously right and slow: no hashing, no tree. A KV entry is the token prefix of a full block; a
checkpoint entry is ``(prefix, EntryKind.CHECKPOINT, group)`` (a block: ``(prefix, EntryKind.BLOCK,
None)``). Recency is a counter stamped on each entry in the
same order :class:`serve.prefix.index.PrefixIndex` refreshes (checkpoint, then the path deepest
first); eviction takes the entry with the smallest stamp among the unpinned checkpoints and the
unpinned KV prefixes that no other KV entry extends (a KV eviction also drops its checkpoints).
Tests replay random operations against both and compare.
"""
from __future__ import annotations

from serve.prefix.index import EntryKind

BLOCK, CHECKPOINT = EntryKind.BLOCK, EntryKind.CHECKPOINT


class PrefixOracle:
    """Args: block_size N; num_groups G."""

    def __init__(self, block_size: int, num_groups: int = 1):
        self.N, self.G = block_size, num_groups
        self.entries: list[list] = []       # [prefix tuple, kind, group, stamp, pins]
        self.clock = 0

    def _find(self, prefix, kind, group=None):
        for e in self.entries:
            if e[0] == prefix and e[1] == kind and e[2] == group:
                return e
        return None

    def _stamp(self, e) -> None:
        self.clock += 1
        e[3] = self.clock

    def lookup(self, tokens) -> tuple[int, int]:
        """(num_tokens, kv_tokens) by the rules: leading KV blocks, capped at len - 1; then the
        largest block boundary within with a checkpoint in every group."""
        tokens, N = tuple(tokens), self.N
        kv = 0
        while kv + N <= len(tokens) and self._find(tokens[: kv + N], BLOCK) is not None:
            kv += N
        kv = min(kv, len(tokens) - 1)
        for b in range(kv // N * N, 0, -N):
            if all(self._find(tokens[:b], CHECKPOINT, g) is not None for g in range(self.G)):
                return b, kv
        return 0, kv

    def touch(self, tokens, b: int, with_checkpoint: bool = True) -> None:
        tokens = tuple(tokens)
        if b and with_checkpoint:
            for g in range(self.G):
                e = self._find(tokens[:b], CHECKPOINT, g)
                if e is not None:
                    self._stamp(e)
        for end in range(b, 0, -self.N):
            self._stamp(self._find(tokens[:end], BLOCK))

    def insert_blocks(self, tokens, num_blocks: int) -> None:
        """Insert the KV blocks of ``tokens[: num_blocks * N]`` then refresh that path."""
        tokens = tuple(tokens)
        for i in range(1, num_blocks + 1):
            if self._find(tokens[: i * self.N], BLOCK) is None:
                self.entries.append([tokens[: i * self.N], BLOCK, None, 0, 0])
                self._stamp(self.entries[-1])
        self.touch(tokens, num_blocks * self.N, with_checkpoint=False)

    def insert_checkpoint(self, tokens, b: int) -> None:
        """Add every missing group's checkpoint at boundary b (refreshes the groups present)."""
        prefix = tuple(tokens)[:b]
        missing = [g for g in range(self.G) if self._find(prefix, CHECKPOINT, g) is None]
        if not missing:
            self.touch(tokens, b)
            return
        for g in missing:
            self.entries.append([prefix, CHECKPOINT, g, 0, 0])
            self._stamp(self.entries[-1])

    def drop_checkpoint(self, tokens, b: int, group: int) -> None:
        self.entries.remove(self._find(tuple(tokens)[:b], CHECKPOINT, group))

    def pin(self, tokens, b: int, delta: int, groups=()) -> None:
        """Add ``delta`` pins to the KV path up to boundary b and to the checkpoints of ``groups`` at b."""
        tokens = tuple(tokens)
        for end in range(b, 0, -self.N):
            self._find(tokens[:end], BLOCK)[4] += delta
        for g in groups:
            self._find(tokens[:b], CHECKPOINT, g)[4] += delta

    def groups_at(self, tokens, b: int) -> tuple:
        return tuple(g for g in range(self.G) if self._find(tuple(tokens)[:b], CHECKPOINT, g) is not None)

    def evict_one(self, checkpoints_only: bool = False) -> set:
        """Evict the oldest evictable entry; returns the removed ``(prefix, kind, group)`` (empty if none)."""
        kv = [e[0] for e in self.entries if e[1] == BLOCK]
        cands = [e for e in self.entries if e[4] == 0 and (e[1] == CHECKPOINT or (
            not checkpoints_only and not any(len(p) > len(e[0]) and p[: len(e[0])] == e[0] for p in kv)
            and not any(c[4] for c in self.entries if c[1] == CHECKPOINT and c[0] == e[0])))]
        if not cands:
            return set()
        victim = min(cands, key=lambda e: e[3])
        gone = [victim]
        if victim[1] == BLOCK:
            gone += [e for e in self.entries if e[1] == CHECKPOINT and e[0] == victim[0]]
        self.entries = [e for e in self.entries if not any(e is g for g in gone)]
        return {(e[0], e[1], e[2]) for e in gone}

    def contents(self) -> set:
        """{(prefix, kind, group)} of every entry."""
        return {(e[0], e[1], e[2]) for e in self.entries}
