"""The routing replay refreshes a request's blocks with ``insert`` alone: a ``touch`` of the hit run first
leaves the same cache (order and evictions), for any capacity and request sequence."""
from hypothesis import given, settings
from hypothesis import strategies as st

from serve.fleet.routing.block_cache import BlockLRUCache

requests = st.lists(st.lists(st.integers(0, 12), max_size=6), max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(1, 10)), requests)
def test_touch_before_insert_changes_nothing(capacity, reqs):
    with_touch, insert_only = BlockLRUCache(capacity), BlockLRUCache(capacity)
    for ids in reqs:
        run = with_touch.lookup(ids)
        assert insert_only.lookup(ids) == run
        with_touch.touch(ids[:run])
        assert with_touch.insert(ids) == insert_only.insert(ids)
        assert list(with_touch.blocks()) == list(insert_only.blocks())
    assert with_touch.evictions == insert_only.evictions
