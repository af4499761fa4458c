"""The slot-indexed paths of ``kda_core.varlen`` given slots in any order: row i reads and writes slot
``slot_idx[i]``, whatever the order of ``slot_idx`` (``[1, 0]`` over a two-slot pool, random permutations,
pad rows between). A pool whose slots are all in the batch in order is the dense fast path (no copy); a
permutation of it must not take that path. The engine always passes slots 0, 1, ... in row order, so its
output tests never see this."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kda_core.chunk import kda_chunk
from kda_core.kda import kda_step
from kda_core.model import HybridLM
from kda_core.varlen import (
    PAD_SLOT,
    forward_batch,
    gather_slots,
    kda_decode_slots,
    kda_varlen_prefill,
    make_meta,
    scatter_slots,
)
from tests.kda_core.test_varlen import empty_pools, load, tokens_of

H, K, V = 2, 8, 6


@pytest.fixture(scope="module")
def model():
    """The demo model with its shipped trained weights."""
    return HybridLM.from_pretrained(Path(__file__).resolve().parents[2] / "weights" / "kda-demo")


def orders():
    """(num_slots, slot_idx) cases: the swap, random permutations of a full pool, a subset with pad rows."""
    gen = torch.Generator().manual_seed(0)
    cases = [pytest.param(2, [1, 0], id="swap-of-2"), pytest.param(3, [2, 0, 1], id="rotate-3")]
    for i in range(3):
        cases.append(pytest.param(6, torch.randperm(6, generator=gen).tolist(), id=f"perm6-{i}"))
    sub = torch.randperm(7, generator=gen)[:4].tolist()
    cases.append(pytest.param(7, [sub[0], PAD_SLOT, sub[1], sub[2], PAD_SLOT, sub[3]], id="subset-with-pads"))
    return cases


def decode_inputs(B: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, K, generator=gen), torch.randn(B, H, K, generator=gen)
    v, g, beta = torch.randn(B, H, V, generator=gen), -torch.rand(B, H, K, generator=gen), torch.rand(B, H, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("num_slots,slots", orders())
def test_decode_writes_each_rows_state_to_its_own_slot(num_slots, slots):
    pool = torch.randn(num_slots, H, K, V, generator=torch.Generator().manual_seed(1))
    before = pool.clone()
    xs = decode_inputs(len(slots), 2)
    o = kda_decode_slots(*xs, pool, torch.tensor(slots))
    for row, slot in enumerate(slots):
        if slot == PAD_SLOT:
            continue
        ref_o, ref_s = kda_step(*(x[row: row + 1] for x in xs), before[slot: slot + 1])
        assert torch.equal(pool[slot], ref_s[0]), f"row {row}'s state is not in slot {slot}"
        assert torch.equal(o[row], ref_o[0]), f"row {row} read another slot's state"
    for s in set(range(num_slots)) - set(slots):
        assert torch.equal(pool[s], before[s]), f"slot {s} is in no row but was written"


@pytest.mark.parametrize("num_slots,slots", orders())
def test_gather_and_scatter_follow_the_slot_order(num_slots, slots):
    pool = torch.arange(num_slots * 3.0).view(num_slots, 3)
    got = gather_slots(pool, torch.tensor(slots))
    values = torch.randn(len(slots), 3)
    scatter_slots(pool, torch.tensor(slots), values)
    for row, slot in enumerate(slots):
        if slot == PAD_SLOT:
            assert torch.isnan(got[row]).all()
            continue
        assert torch.equal(got[row], torch.arange(slot * 3.0, slot * 3.0 + 3)), f"gather row {row} != slot {slot}"
        assert torch.equal(pool[slot], values[row]), f"scatter row {row} did not land in slot {slot}"


@pytest.mark.parametrize("num_slots,slots", orders())
def test_varlen_prefill_writes_each_rows_final_state_to_its_own_slot(num_slots, slots):
    gen = torch.Generator().manual_seed(3)
    lens = [5 + 3 * i for i in range(len(slots))]
    T = sum(lens)
    q, k = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen)
    v, g, beta = torch.randn(1, T, H, V, generator=gen), -torch.rand(1, T, H, K, generator=gen), torch.rand(1, T, H, generator=gen)
    cu = torch.tensor([0] + lens).cumsum(0)
    has = torch.tensor([i % 2 == 0 for i in range(len(slots))])
    pool = torch.randn(num_slots, H, K, V, generator=gen)
    before = pool.clone()
    o = kda_varlen_prefill(q, k, v, g, beta, cu, pool, torch.tensor(slots), has)
    for i, slot in enumerate(slots):
        if slot == PAD_SLOT:
            continue
        a, b = int(cu[i]), int(cu[i + 1])
        s0 = before[slot: slot + 1] if has[i] else torch.zeros(1, H, K, V)
        ref = kda_chunk(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], s0)
        assert torch.equal(pool[slot], ref.final_state[0]), f"row {i}'s final state is not in slot {slot}"
        assert torch.equal(o[:, a:b], ref.o)


@pytest.mark.parametrize("slots,decode", [([1, 0], 2), ([2, 0, 1], 2), ([1, 2, 0], 1)],
                         ids=["2-decode-swapped", "2-decode+prefill-rotated", "decode+2-prefill-rotated"])
def test_forward_batch_rows_in_permuted_slots_equal_alone(model, slots, decode):
    """The packed model forward over a pool holding exactly the batch's slots, in a permuted order: each row's
    logits and KDA state (recurrent and conv window) are bitwise the row run alone, in its own slot."""
    cfg = model.cfg
    S = len(slots)
    pools = empty_pools(model, S)
    lens, ctxs, tables, toks, alone = [], [], [], [], []
    for i, slot in enumerate(slots):
        ctx, new = 20 + 9 * i, 1 if i < decode else 30 + 5 * i
        seq = tokens_of(40 + i, ctx + new)
        _, cache = model.prefill(seq[:ctx].unsqueeze(0))
        table = list(range(8 * i, 8 * i + 8))
        load(model, pools, cache, slot, table)
        alone.append(model.forward(seq[ctx:].unsqueeze(0), cache, mode="recurrent" if i < decode else "chunk"))
        lens.append(new)
        ctxs.append(ctx)
        tables.append(table)
        toks.append(seq[ctx:])
    out = forward_batch(model, torch.cat(toks), make_meta(lens, decode, slots, [True] * S, ctxs, tables), pools)
    for i, slot in enumerate(slots):
        assert torch.equal(out.logits[i], alone[i].logits[0, -1]), f"row {i} read another slot"
        for layer in cfg.kda_layers:
            assert torch.equal(pools.kda[layer][0][slot], alone[i].cache.layers[layer].recurrent[0]), \
                f"layer {layer}: row {i}'s state is not in slot {slot}"
            assert torch.equal(pools.kda[layer][1][slot], alone[i].cache.layers[layer].conv[0])
