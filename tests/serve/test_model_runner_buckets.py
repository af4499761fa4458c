"""The model runner's batch layout, pinned by the batch it builds (pad rows leave every output bitwise equal,
so only the layout shows a padding bug): decode rows padded up to the smallest bucket of
``DECODE_BUCKETS`` holding them and never further (a batch whose size is a bucket has no pad row), pad rows
right after the decode rows with slot -1, then the prefill rows; a live row's slot is its request's state page
(unified pages: one page per state, read and written in place)."""
from __future__ import annotations

import pytest

from serve.config import ServeConfig
from serve.engine import ServeEngine
from serve.engine.model_runner import DECODE_BUCKETS, decode_bucket
from serve.engine.request import RequestStatus
from serve.memory.pool import PagePool
from tests.serve.prefix.helpers import tiny_model, tokens


def engine(**kw) -> ServeEngine:
    model = tiny_model()
    config = ServeConfig(64, 64, page_policy="unified")
    return ServeEngine(model, PagePool(96, config.page_bytes(model.cfg), poison=True), None, config=config, **kw)


def decoding(eng: ServeEngine, n: int) -> list[int]:
    """Submit ``n`` short prompts and step until all of them decode (one prefill step)."""
    rids = [eng.submit(tokens(200 + i, 10 + i), 8) for i in range(n)]
    eng.step()
    assert all(eng.requests[r].status is RequestStatus.DECODE for r in rids)
    return rids


def test_decode_bucket_is_the_smallest_bucket_holding_n():
    assert [decode_bucket(b) for b in DECODE_BUCKETS] == list(DECODE_BUCKETS)      # a bucket is not padded
    for lo, hi in zip(DECODE_BUCKETS, DECODE_BUCKETS[1:]):
        assert [decode_bucket(n) for n in range(lo + 1, hi + 1)] == [hi] * (hi - lo)
    assert [decode_bucket(n) for n in (65, 100)] == [65, 100]                       # above the largest: n itself


@pytest.mark.parametrize("n,rows", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_decode_rows_padded_to_their_bucket_only(n, rows):
    """A lone decoder runs as one row (no pad row); n decoders run as decode_bucket(n) rows, the pads
    (slot -1) after the live rows."""
    eng = engine()
    rids = decoding(eng, n)
    eng.step()
    b = eng.last_batch
    assert (b.num_decode, b.num_pad, len(b.rows)) == (n, rows - n, rows)
    assert b.meta.slot_idx.tolist() == [r.req.state_pages[0][0] for r in b.rows[:n]] + [-1] * (rows - n)
    assert [r.req.rid for r in b.rows[:n]] == rids


def test_no_padding_when_turned_off():
    eng = engine(pad_decode=False)
    decoding(eng, 3)
    eng.step()
    assert (eng.last_batch.num_pad, len(eng.last_batch.rows)) == (0, 3)


def test_mixed_batch_layout_decode_then_pads_then_prefill():
    """Three decoders and a new prompt in one step: rows = 3 decode, 1 pad, 1 prefill; the metadata's decode
    part covers the pad row; the prefill row's slot is its state page, it starts from zeros and owns the
    prompt's tokens in query_start_loc."""
    eng = engine()
    decoding(eng, 3)
    new = eng.submit(tokens(300, 50), 2)
    eng.step()
    b = eng.last_batch
    assert [(r.req.rid if r.req else None, r.decode) for r in b.rows] == [(0, True), (1, True), (2, True),
                                                                        (None, True), (new, False)]
    pages = [eng.requests[rid].state_pages[0][0] for rid in (0, 1, 2, new)]
    assert b.meta.num_decode == 4 and b.meta.slot_idx.tolist() == pages[:3] + [-1] + pages[3:]
    assert b.meta.has_initial_state.tolist() == [True, True, True, False, False]
    assert b.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4, 54]
