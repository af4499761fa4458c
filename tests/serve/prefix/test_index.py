"""PrefixIndex rules seen through PrefixCache: the hit is a boundary complete in every group, and a hit
refreshes only what it consumed (exact eviction orders)."""
from __future__ import annotations

from serve.prefix.index import EntryKind, PrefixIndex
from tests.serve.prefix.helpers import insert_prefix, make_cache

N = 4   # tokens per block in every test here
BLOCK, CKPT = EntryKind.BLOCK, EntryKind.CHECKPOINT


def _record_evictions(cache) -> list[tuple[EntryKind, int]]:
    """Wrap the cache's ``index.evict_one`` so every eviction is logged as ``(kind, boundary in tokens)``."""
    log: list[tuple[EntryKind, int]] = []
    original = cache.index.evict_one

    def evict_one(checkpoints_only=False):
        got = original(checkpoints_only)
        log.extend((e.kind, e.depth * cache.block_size) for e in got)
        return got

    cache.index.evict_one = evict_one
    return log


def _hit(cache, prompt) -> int:
    """Look up, acquire and release ``prompt`` as the engine does for one request; the hit tokens."""
    hit = cache.lookup(prompt)
    cache.acquire(hit, "r")
    cache.release("r")
    cache.pool.decref(list(hit.kv_pages), "r")
    cache.check_integrity()
    return hit.num_tokens


def test_groups_with_crossing_checkpoints_hit_only_a_common_boundary():
    """Group 0 keeps {4}, group 1 keeps {8}: each group alone would reach 4 (group 0) or 8 (group 1) and
    the minimum of those maxima is 4, but no boundary has both groups, so the hit is 0. Keeping group 1's
    checkpoint at 4 makes 4 common to both: hit 4."""
    cache = make_cache(block_size=N, groups=2)
    seq = list(range(1, 10))                       # 2 full blocks + 1 token: the cap does not bite at 8
    assert insert_prefix(cache, seq, 2, [1, 2]) == [1, 2]
    cache.drop_checkpoint(seq, 8, 0)
    cache.drop_checkpoint(seq, 4, 1)
    assert [(c.boundary, c.group) for c in cache.checkpoints()] == [(4, 0), (8, 1)]
    hit = cache.lookup(seq)
    assert (hit.kv_tokens, hit.num_tokens) == (8, 0)
    assert [(s.boundary, s.groups, s.found) for s in cache.explain(seq) if s.phase == 2] == [
        (8, (1,), False), (4, (0,), False)]
    keys = cache.keys(seq)
    assert cache.index.checkpoint_run(keys, 2) == 0

    cache = make_cache(block_size=N, groups=2)
    insert_prefix(cache, seq, 2, [1, 2])
    cache.drop_checkpoint(seq, 8, 0)               # group 1 keeps {4, 8}, group 0 keeps {4}
    hit = cache.lookup(seq)
    assert (hit.kv_tokens, hit.num_tokens) == (8, 4)
    assert len(hit.checkpoint_pages) == 2 and _hit(cache, seq) == 4


def test_index_checkpoint_run_needs_every_group_at_one_boundary():
    """Three groups whose deepest checkpoints are 3, 2 and 1 blocks, with no boundary shared by all."""
    idx = PrefixIndex(3)
    keys = ["a", "b", "c"]
    for i, k in enumerate(keys):
        idx.add_block(k, None if i == 0 else keys[i - 1])
    idx.touch(keys, 3, with_checkpoint=False)          # as a publish does: parents more recent than children
    idx.add_checkpoint("c", 0, None, 3 * N)
    idx.add_checkpoint("b", 1, None, 2 * N)
    idx.add_checkpoint("a", 2, None, 1 * N)
    assert idx.checkpoint_run(keys, 3) == 0
    idx.add_checkpoint("a", 0, None, 1 * N)
    idx.add_checkpoint("a", 1, None, 1 * N)
    assert idx.checkpoint_run(keys, 3) == 1 and idx.checkpoint_run(keys, 0) == 0
    idx.check_integrity(N)


def _four_blocks_with_checkpoints(max_checkpoints=None):
    """Blocks A B C D (boundaries 4, 8, 12, 16) of ``seq``; checkpoints at 8 first, then at 4 and 16, so
    before any hit the LRU list (oldest first) is: ckpt 8, D, C, B, A, ckpt 4, ckpt 16."""
    cache = make_cache(block_size=N, max_checkpoints=max_checkpoints)
    seq = list(range(1, 17))
    assert insert_prefix(cache, seq, 4, [2]) == [2]
    assert insert_prefix(cache, seq, 4, [1, 4]) == [1, 4]
    return cache, seq


def test_hit_refreshes_its_checkpoint_not_the_ancestors():
    """A hit at 8 refreshes the checkpoint at 8 (and blocks A, B), not the checkpoint at 4 above it on
    the path. The next checkpoint over the cap then evicts the one at 4: refreshing ancestors' checkpoints
    too would evict 16 instead (SGLang PR #31643), and no refresh at all would evict 8."""
    cache, seq = _four_blocks_with_checkpoints(max_checkpoints=3)
    log = _record_evictions(cache)
    prompt = seq[:12] + [99] * 5                   # blocks A B C cached, D differs: phase 1 = 12, hit = 8
    assert cache.lookup(prompt).kv_tokens == 12 and _hit(cache, prompt) == 8
    assert insert_prefix(cache, [200, 201, 202, 203], 1, [1]) == [1]
    assert log == [(CKPT, 4)]
    assert cache.lookup(seq + [0]).num_tokens == 16 and cache.lookup(seq[:9]).num_tokens == 8
    assert cache.lookup(seq[:5]).num_tokens == 0 and cache.lookup(seq[:5]).kv_tokens == 4
    cache.check_integrity()


def test_hit_refreshes_blocks_up_to_the_hit_not_the_whole_kv_run():
    """Same hit at 8 with phase 1 reaching 12: block C (in [8, 12), recomputed, not consumed) keeps its
    age. Evicting everything then goes D (with its checkpoint), C, ckpt 4, ckpt 8, B, A; refreshing the
    whole phase-1 run would keep C until after both checkpoints."""
    cache, seq = _four_blocks_with_checkpoints()
    log = _record_evictions(cache)
    assert _hit(cache, seq[:12] + [99] * 5) == 8
    cache.clear()
    assert log == [(CKPT, 16), (BLOCK, 16), (BLOCK, 12), (CKPT, 4), (CKPT, 8), (BLOCK, 8), (BLOCK, 4)]
    assert cache.pool.num_free == cache.pool.num_pages
    cache.check_integrity()
