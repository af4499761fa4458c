"""Batched KDA over a state-slot pool (``kda_core.varlen``): batched == alone bitwise, pad rows never
touch a live slot, prefill(T) == prefill(T - k) + k decodes, chunked prefill carries the state."""
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_core import decode
from kda_core.chunk import CHUNK_SIZE, kda_chunk
from kda_core.kda import kda_step
from kda_core.layer import KDACache
from kda_core.model import HybridLM
from kda_core.varlen import (
    PAD_SLOT,
    SlotPools,
    forward_batch,
    gather_slots,
    kda_decode_slots,
    kda_varlen_prefill,
    make_meta,
    read_latents,
    scatter_slots,
)

NB = 16          # tokens per KV block in these tests
NUM_PAGES = 96


@pytest.fixture(scope="module")
def model():
    """The demo model with its shipped trained weights (the model the pages and the server run)."""
    return HybridLM.from_pretrained(Path(__file__).resolve().parents[2] / "weights" / "kda-demo")


def empty_pools(model, num_slots, fill=float("nan")):
    cfg = model.cfg
    kda = {i: (torch.full((num_slots, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim), fill),
               torch.full((num_slots, cfg.conv_dim, cfg.conv_kernel - 1), fill)) for i in cfg.kda_layers}
    kv = torch.full((NUM_PAGES, len(cfg.mla_layers), NB, cfg.latent_dim), fill)
    return SlotPools(kda, kv)


def load(model, pools, cache, slot, table):
    """Put one request's HybridCache (batch 1) into slot ``slot`` and the pages of ``table``."""
    cfg = model.cfg
    for i in cfg.kda_layers:
        pools.kda[i][0][slot] = cache.layers[i].recurrent[0]
        pools.kda[i][1][slot] = cache.layers[i].conv[0]
    for j, i in enumerate(cfg.mla_layers):
        lat = cache.layers[i][0]
        for p in range(lat.shape[0]):
            pools.kv_cache[table[p // NB], j, p % NB] = lat[p]


def tokens_of(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


row_spec = st.tuples(st.integers(0, 140), st.integers(1, 70), st.booleans())   # (context, new tokens, decode?)


@settings(max_examples=20, deadline=None)
@given(rows=st.lists(row_spec, min_size=1, max_size=6), num_pad=st.integers(0, 3), seed=st.integers(0, 99))
def test_batched_equals_alone_bitwise(model, rows, num_pad, seed):
    """Every live row's logits, KDA state and new latents are bitwise those of the row run alone
    (``model.forward`` from the same cache, recurrent for a decode row, chunk for a prefill row)."""
    cfg = model.cfg
    rows = [(ctx, 1 if dec else new, dec and ctx > 0) for ctx, new, dec in rows]
    rows.sort(key=lambda r: not r[2])                                     # decode rows first
    nd = sum(r[2] for r in rows)
    S = len(rows) + 2
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(S, generator=gen).tolist()
    pages = torch.randperm(NUM_PAGES, generator=gen).tolist()
    pools = empty_pools(model, S)
    slot_idx, tables, alone, toks, lens, ctxs, has = [], [], [], [], [], [], []
    for i, (ctx, new, dec) in enumerate(rows):
        seq = tokens_of(seed * 31 + i, ctx + new)
        cache = model.empty_cache(1)
        if ctx:
            cache = model.forward(seq[:ctx].unsqueeze(0), cache, mode="chunk").cache
        table = [pages.pop() for _ in range(-(-(ctx + new) // NB))]
        load(model, pools, cache, perm[i], table)
        ref = model.forward(seq[ctx:].unsqueeze(0), cache, mode="recurrent" if dec else "chunk")
        alone.append(ref)
        slot_idx.append(perm[i])
        tables.append(table)
        toks.append(seq[ctx:])
        lens.append(new)
        ctxs.append(ctx)
        has.append(ctx > 0)
    # pad rows go with the decode rows (bucket padding), slot -1, NaN inside
    for _ in range(num_pad):
        slot_idx.insert(nd, PAD_SLOT)
        tables.insert(nd, [])
        toks.insert(nd, torch.tensor([7]))
        lens.insert(nd, 1)
        ctxs.insert(nd, 0)
        has.insert(nd, False)
    meta = make_meta(lens, nd + num_pad, slot_idx, has, ctxs, tables)
    before_free = {s: pools.kda[cfg.kda_layers[0]][0][s].clone() for s in range(S) if s not in slot_idx}
    out = forward_batch(model, torch.cat(toks), meta, pools)
    live_rows = [i for i, s in enumerate(slot_idx) if s != PAD_SLOT]
    for r, i in enumerate(live_rows):
        ref, slot, (ctx, new, _) = alone[r], slot_idx[i], rows[r]
        assert torch.equal(out.logits[i], ref.logits[0, -1]), f"row {r} logits differ"
        for layer in cfg.kda_layers:
            assert torch.equal(pools.kda[layer][0][slot], ref.cache.layers[layer].recurrent[0])
            assert torch.equal(pools.kda[layer][1][slot], ref.cache.layers[layer].conv[0])
        for j, layer in enumerate(cfg.mla_layers):
            assert torch.equal(read_latents(pools.kv_cache, j, tables[i], ctx + new), ref.cache.layers[layer])
    for s, t in before_free.items():                                      # never-used slots: still NaN
        assert torch.isnan(pools.kda[cfg.kda_layers[0]][0][s]).all() and torch.isnan(t).all()


def test_pad_rows_fed_nan_never_touch_a_live_slot():
    """Pad rows (slot -1) with NaN inputs leave every live slot bitwise unchanged except the rows'
    own; slot 0 is live and not in the batch, so clamping -1 to 0 (tokenspeed#700) turns this red."""
    torch.manual_seed(0)
    S, H, K, V = 4, 2, 8, 8
    pool = torch.randn(S, H, K, V)
    before = pool.clone()
    B = 4
    slot_idx = torch.tensor([2, PAD_SLOT, 3, PAD_SLOT])
    q, k = torch.randn(B, H, K), torch.randn(B, H, K)
    v, g, beta = torch.randn(B, H, V), -torch.rand(B, H, K), torch.rand(B, H)
    for x in (q, k, v, g, beta):
        x[1] = float("nan")
        x[3] = float("nan")
    o = kda_decode_slots(q, k, v, g, beta, pool, slot_idx)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[1], before[1]), "a pad row wrote a live slot"
    for row, slot in ((0, 2), (2, 3)):
        ref_o, ref_s = kda_step(q[row: row + 1], k[row: row + 1], v[row: row + 1], g[row: row + 1],
                                beta[row: row + 1], before[slot: slot + 1])
        assert torch.equal(o[row], ref_o[0]) and torch.equal(pool[slot], ref_s[0])
    assert torch.isfinite(pool).all()
    # varlen prefill: a pad sequence is skipped too
    pool2 = before.clone()
    T = 5
    cu = torch.tensor([0, 3, T])
    qs, ks = torch.randn(1, T, H, K), torch.randn(1, T, H, K)
    vs, gs, bs = torch.randn(1, T, H, V), -torch.rand(1, T, H, K), torch.rand(1, T, H)
    for x in (qs, ks, vs, gs, bs):
        x[:, 3:] = float("nan")
    kda_varlen_prefill(qs, ks, vs, gs, bs, cu, pool2, torch.tensor([1, PAD_SLOT]), torch.tensor([True, False]))
    assert torch.equal(pool2[0], before[0]) and torch.equal(pool2[2:], before[2:])
    ref = kda_chunk(qs[:, :3], ks[:, :3], vs[:, :3], gs[:, :3], bs[:, :3], before[1:2])
    assert torch.equal(pool2[1], ref.final_state[0])


def test_gather_scatter_skip_pads_and_reject_bad_slots():
    pool = torch.arange(12.0).view(3, 4)
    got = gather_slots(pool, torch.tensor([2, PAD_SLOT]))
    assert torch.equal(got[0], pool[2]) and torch.isnan(got[1]).all()
    scatter_slots(pool, torch.tensor([PAD_SLOT, 1]), torch.full((2, 4), -1.0))
    assert torch.equal(pool[0], torch.arange(4.0)) and (pool[1] == -1).all()
    for bad in ([3], [-2], [1, 1]):
        with pytest.raises(ValueError, match="slot_idx"):
            gather_slots(pool, torch.tensor(bad))


def _run(model, pools, seq, ctx, new, slot, table, decode):
    meta = make_meta([new], 1 if decode else 0, [slot], [ctx > 0], [ctx], [table])
    return forward_batch(model, seq[ctx: ctx + new], meta, pools)


@settings(max_examples=6, deadline=None)
@given(T=st.integers(2, 150), k=st.integers(1, 6), seed=st.integers(0, 99))
def test_prefill_T_equals_prefill_T_minus_k_then_k_decodes(model, T, k, seed):
    """sglang-jax#948's invariant: the state after prefill(T) equals prefill(T - k) then k decodes.
    Tolerance, not bitwise: the chunk (WY) form and the token-by-token form round differently (fp32;
    measured < 1e-5 here)."""
    k = min(k, T - 1)
    seq = tokens_of(seed, T)
    a, b = empty_pools(model, 2), empty_pools(model, 2)
    table = list(range(-(-T // NB)))
    out_a = _run(model, a, seq, 0, T, 1, table, False)
    _run(model, b, seq, 0, T - k, 1, table, False)
    for j in range(k):
        out_b = _run(model, b, seq, T - k + j, 1, 1, table, True)
    torch.testing.assert_close(out_b.logits, out_a.logits, rtol=1e-4, atol=1e-4)
    for layer in model.cfg.kda_layers:
        torch.testing.assert_close(b.kda[layer][0][1], a.kda[layer][0][1], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b.kda[layer][1][1], a.kda[layer][1][1], rtol=1e-4, atol=1e-5)  # raw inputs
    assert torch.equal(b.kda[0][1][1], a.kda[0][1][1])      # layer 0's raw inputs see no KDA rounding: exact


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 3, 17, 63, 64, 65, 100, 128])
def test_chunked_prefill_carries_the_state(model, chunk):
    """A prefill split into pieces of ``chunk`` tokens, the slot's state carried between them
    (has_initial_state), ends where the one-shot prefill ends: bitwise for a multiple of the 64-token
    grid, within rounding otherwise (the grid moves). Dropping the carried state (lablup/mlxcel#1749)
    fails by far more than the tolerance."""
    T = 150
    seq = tokens_of(chunk, T)
    a, b = empty_pools(model, 1), empty_pools(model, 1)
    table = list(range(-(-T // NB)))
    out_a = _run(model, a, seq, 0, T, 0, table, False)
    p = 0
    while p < T:
        n = min(chunk, T - p)
        out_b = _run(model, b, seq, p, n, 0, table, False)
        p += n
    exact = chunk % CHUNK_SIZE == 0
    for layer in model.cfg.kda_layers:
        if exact:
            assert torch.equal(b.kda[layer][0][0], a.kda[layer][0][0])
        else:
            torch.testing.assert_close(b.kda[layer][0][0], a.kda[layer][0][0], rtol=1e-4, atol=1e-5)
    if exact:
        assert torch.equal(out_b.logits, out_a.logits)
    else:
        torch.testing.assert_close(out_b.logits, out_a.logits, rtol=1e-4, atol=1e-4)
    for j in range(len(model.cfg.mla_layers)):
        torch.testing.assert_close(read_latents(b.kv_cache, j, table, T), read_latents(a.kv_cache, j, table, T),
                                   rtol=0, atol=1e-4)


def test_states_at_match_the_layer(model):
    """Checkpoint states from a batched prefill row equal ``model.forward(state_at=...)`` bitwise."""
    seq = tokens_of(5, 140)
    pools = empty_pools(model, 1)
    meta = make_meta([140], 0, [0], [False], [0], [list(range(9))], state_at=[(64, 100)])
    out = forward_batch(model, seq, meta, pools)
    ref = model.forward(seq.unsqueeze(0), mode="chunk", state_at=(64, 100))
    for t in (64, 100):
        for layer in model.cfg.kda_layers:
            a, b = out.states_at[0][t][layer], ref.states_at[t][layer]
            assert isinstance(a, KDACache) and torch.equal(a.recurrent, b.recurrent) and torch.equal(a.conv, b.conv)


def test_decode_records_replay_to_the_written_state(model):
    """``forward_batch(decode_records=True)``: each decode row's ``(k, u, g)`` per KDA layer, replayed onto the
    state the row started from (decay, then rank-1 write: ``_step``'s op order), gives bitwise the state the
    step wrote to its slot (pad rows skipped); without the flag no records come back."""
    cfg = model.cfg
    pools = empty_pools(model, 3)
    tables = [list(range(8 * s, 8 * s + 8)) for s in range(3)]
    for s in range(3):
        _, cache = model.prefill(tokens_of(s, 10 + 7 * s).unsqueeze(0))
        load(model, pools, cache, s, tables[s])
    before = {i: pools.kda[i][0].clone() for i in cfg.kda_layers}
    meta = make_meta([1, 1, 1, 1], 4, [2, 0, PAD_SLOT, 1], [True, True, False, True], [24, 10, 0, 17],
                     [tables[2], tables[0], [], tables[1]])
    toks = torch.tensor([5, 6, 7, 8])
    out = forward_batch(model, toks, meta, pools, decode_records=True)
    assert set(out.decode_records) == set(cfg.kda_layers)
    for i in cfg.kda_layers:
        k, u, g = out.decode_records[i]                                   # [4, H, K], [4, H, V], [4, H, K]
        for row, slot in ((0, 2), (1, 0), (3, 1)):
            S = before[i][slot: slot + 1] * decode.decay(cfg, g[row: row + 1]).unsqueeze(-1)
            S = S + k[row: row + 1].unsqueeze(-1) * u[row: row + 1].unsqueeze(-2)
            assert torch.equal(S[0], pools.kda[i][0][slot]), f"layer {i} row {row}: replay != written state"
    assert forward_batch(model, toks, meta, empty_pools(model, 3, 0.0)).decode_records is None
