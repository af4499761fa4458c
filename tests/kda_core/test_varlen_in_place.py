"""``forward_batch`` on state pools that are strided views of one page arena (the engine's layout: slot = page,
each layer at its own offset in the page, groups of layers with their own slot indices): it reads the live rows'
slots in place, writes nothing until its states are written (:func:`write_states`), then exactly the live rows'
slots (bitwise the rows run alone; a bf16 pool rounded to nearest); a forward that raises writes no state; bad
slot tensors are rejected."""
from pathlib import Path

import pytest
import torch

from kda_core.kda import NonFiniteError
from kda_core.model import HybridLM
from kda_core.varlen import PAD_SLOT, LayerSlots, SlotPools, forward_batch, make_meta, write_states

NB, NUM_PAGES = 16, 40


@pytest.fixture(scope="module")
def model():
    return HybridLM.from_pretrained(Path(__file__).resolve().parents[2] / "weights" / "kda-demo")


def arena_pools(model, dtype=torch.float32):
    """A NaN-filled arena ``[NUM_PAGES, E]`` of fp32 words holding every KDA layer's state in one page, the
    layers in two groups; returns (arena, {layer: (recurrent view [P, H, K, V] of ``dtype``, conv view)}, group
    of each layer), as :func:`serve.memory.pages.slot_views` lays them out."""
    cfg = model.cfg
    w_rec = cfg.num_heads * cfg.head_k_dim * cfg.head_v_dim * torch.empty((), dtype=dtype).element_size() // 4
    w_conv = cfg.conv_dim * (cfg.conv_kernel - 1)
    layers = cfg.kda_layers
    arena = torch.full((NUM_PAGES, len(layers) * (w_rec + w_conv)), float("nan"))
    views, group = {}, {}
    for j, li in enumerate(layers):
        a = j * (w_rec + w_conv)
        rec = arena[:, a: a + w_rec].view(dtype).view(NUM_PAGES, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim)
        views[li] = (rec, arena[:, a + w_rec: a + w_rec + w_conv].view(NUM_PAGES, cfg.conv_dim, cfg.conv_kernel - 1))
        group[li] = int(j >= len(layers) // 2)
    return arena, views, group


def batch(model, views, dtype, pad_rows: int = 1, poison_prefill: bool = False):
    """Two decode rows, ``pad_rows`` pad rows, one prefill row; group 0 slots and group 1 slots differ; page 0 is
    a bystander slot (finite, not in the batch). Returns (tokens, meta, {layer: LayerSlots}, refs)."""
    cfg = model.cfg
    g0, g1 = [5, 9, 13], [22, 3, 31]                                     # row slots in group 0 / group 1
    torch.manual_seed(0)
    for rec, conv in views.values():
        rec[0] = torch.randn(rec.shape[1:]).to(dtype)
        conv[0] = torch.randn(conv.shape[1:])
    rows, refs = [(20, 1), (33, 1), (17, 40)], []
    toks, lens, ctxs, tables, page = [], [], [], [], NUM_PAGES
    kv = torch.full((NUM_PAGES, len(cfg.mla_layers), NB, cfg.latent_dim), float("nan"))
    _, _, group = arena_pools(model, dtype)
    for i, (ctx, new) in enumerate(rows):
        seq = torch.randint(0, 256, (ctx + new,), generator=torch.Generator().manual_seed(60 + i))
        _, cache = model.prefill(seq[:ctx].unsqueeze(0))
        layers = list(cache.layers)
        for li in cfg.kda_layers:
            slot = (g0 if group[li] == 0 else g1)[i]
            views[li][0][slot] = cache.layers[li].recurrent[0].to(dtype)
            views[li][1][slot] = cache.layers[li].conv[0]
            layers[li] = layers[li]._replace(recurrent=views[li][0][slot: slot + 1].float())   # as stored
        cache = cache._replace(layers=tuple(layers))
        table = list(range(page - 4, page))
        page -= 4
        for j, li in enumerate(cfg.mla_layers):
            lat = cache.layers[li][0]
            for p in range(lat.shape[0]):
                kv[table[p // NB], j, p % NB] = lat[p]
        refs.append(model.forward(seq[ctx:].unsqueeze(0), cache, mode="recurrent" if new == 1 else "chunk"))
        toks.append(seq[ctx:])
        lens.append(new)
        ctxs.append(ctx)
        tables.append(table)
    if poison_prefill:
        for li in cfg.kda_layers:
            slot = (g0 if group[li] == 0 else g1)[2]
            views[li][0][slot] = float("nan")
    for _ in range(pad_rows):                                             # after the decode rows, NaN inside
        for x, v in ((toks, torch.tensor([7])), (lens, 1), (ctxs, 0), (tables, [])):
            x.insert(2, v)
        g0.insert(2, PAD_SLOT)
        g1.insert(2, PAD_SLOT)
    idx = torch.tensor([g0, g1], dtype=torch.long)                        # [G, N]: built once
    meta = make_meta(lens, 2 + pad_rows, idx[0], [True] * 2 + [False] * pad_rows + [True], ctxs, tables)
    kda = {li: LayerSlots(*views[li], idx[group[li]]) for li in cfg.kda_layers}
    return torch.cat(toks), meta, SlotPools(kda, kv), refs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_arena_pools_read_in_place_written_by_slot_equal_alone(model, dtype):
    cfg = model.cfg
    arena, views, group = arena_pools(model, dtype)
    toks, meta, pools, refs = batch(model, views, dtype)
    before = arena.clone()
    out = forward_batch(model, toks, meta, pools, write=False)
    assert torch.equal(arena.isnan(), before.isnan()) and torch.equal(arena.nan_to_num(), before.nan_to_num()), \
        "write=False wrote a state"
    write_states(pools, meta, out.state_writes)
    live = [0, 1, 3]
    for r, i in enumerate(live):
        assert torch.equal(out.logits[i], refs[r].logits[0, -1]), f"row {i}"
        for li in cfg.kda_layers:
            slot = int(pools.kda[li].slot_idx[i])
            assert torch.equal(views[li][0][slot], refs[r].cache.layers[li].recurrent[0].to(dtype)), (i, li)
            assert torch.equal(views[li][1][slot], refs[r].cache.layers[li].conv[0])
    written = {int(s) for ls in pools.kda.values() for s in ls.slot_idx if s != PAD_SLOT}
    changed = set((arena.nan_to_num() != before.nan_to_num()).any(dim=1).nonzero().flatten().tolist())
    assert changed <= written and 0 not in changed, f"pages written outside the rows' slots: {sorted(changed)}"


def test_a_forward_that_raises_writes_no_state(model):
    """The prefill row's state is NaN: the chunk kernel raises in the first KDA layer, after the decode rows of
    that layer ran. No slot may change (the engine re-runs the other rows from their pre-step states)."""
    arena, views, _ = arena_pools(model)
    toks, meta, pools, _ = batch(model, views, torch.float32, poison_prefill=True)
    before = arena.clone()
    with pytest.raises(NonFiniteError):
        forward_batch(model, toks, meta, pools)
    assert torch.equal(arena.isnan(), before.isnan()) and torch.equal(arena.nan_to_num(), before.nan_to_num()), \
        "a forward that raised wrote a state"


@pytest.mark.parametrize("bad,match", [
    (lambda i: i.index_fill(1, torch.tensor([1]), 5), "twice"),            # rows 0 and 1 both in slot 5
    (lambda i: i.index_fill(1, torch.tensor([0]), NUM_PAGES), "must hold slots"),
    (lambda i: i.index_fill(1, torch.tensor([0]), PAD_SLOT), "pad rows")], ids=["duplicate", "out-of-range", "pad"])
def test_bad_layer_slots_are_rejected(model, bad, match):
    arena, views, group = arena_pools(model)
    toks, meta, pools, _ = batch(model, views, torch.float32)
    idx = bad(torch.stack([pools.kda[li].slot_idx for li in (model.cfg.kda_layers[0], model.cfg.kda_layers[-1])]))
    kda = {li: ls._replace(slot_idx=idx[group[li]]) for li, ls in pools.kda.items()}
    with pytest.raises(ValueError, match=match):
        forward_batch(model, toks, meta, SlotPools(kda, pools.kv_cache))


@pytest.mark.parametrize("keep", [None, [True, True, False, True]], ids=["all-kept", "row2-dropped"])
def test_write_states_c_copy_equals_index_copy(monkeypatch, keep):
    """write_states' one C copy per slot group (fp32 pieces into a strided arena) writes exactly what index_copy_
    writes: every kept live row at its slot, a pad row and a row not kept nowhere (the pool's NaN stays)."""
    from kda_core import decode_cpu, varlen
    if isinstance(decode_cpu.load(), str):
        pytest.skip("no C decode library here")
    gen = torch.Generator().manual_seed(3)
    idx = torch.tensor([5, PAD_SLOT, 2, 7])                               # [N]: row 1 a pad row
    meta = make_meta([1] * 4, 4, idx, [True] * 4, [0] * 4, [[]] * 4)
    writes = {i: [varlen.StateWrite(0, torch.randn(4, 2, 3, 5, generator=gen), torch.randn(4, 6, 3, generator=gen))]
              for i in (0, 1)}
    got = []
    for c_copy in (True, False):
        if not c_copy:
            monkeypatch.setattr(decode_cpu, "copyable", lambda *a: False)
        arena = torch.full((9, 2 * (30 + 18) + 4), float("nan"))          # [S, page words]: two layers a page
        kda = {i: LayerSlots(arena[:, 48 * i: 48 * i + 30].view(9, 2, 3, 5), arena[:, 48 * i + 30: 48 * (i + 1)]
                             .view(9, 6, 3)) for i in (0, 1)}
        write_states(SlotPools(kda, None), meta, writes, None if keep is None else torch.tensor(keep))
        got.append(arena)
    assert torch.equal(got[0].nan_to_num(9.0), got[1].nan_to_num(9.0))
    written = {5, 7} | ({2} if keep is None or keep[2] else set())
    assert {s for s in range(9) if not got[0][s, :96].isnan().all()} == written
