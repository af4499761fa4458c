"""forward_batch's decode rows: rows of the same context length run as one batched MLA product and the KDA
layers' fused decode step; a batch whose rows interleave context lengths (A, B, A, ...) and holds a pad row
still gives every live row bitwise the logits, states and latents of ``model.decode_step`` on that row alone."""
import dataclasses
from pathlib import Path

import pytest
import torch

from kda_core.config import PRESETS
from kda_core.model import HybridLM
from kda_core.varlen import PAD_SLOT, SlotPools, forward_batch, make_meta, read_latents

NB = 16


@pytest.fixture(scope="module")
def model():
    return HybridLM.from_pretrained(Path(__file__).resolve().parents[2] / "weights" / "kda-demo")


def _decode_batch(model, contexts):
    """Pools holding each row's prefilled context (KDA states by slot, MLA latents by page), the decode metadata
    with a pad row at the end, the packed tokens, and each row's ``model.decode_step`` alone."""
    cfg = model.cfg
    S, pages = len(contexts) + 2, list(range(40))
    kda = {i: (torch.full((S, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim), float("nan")),
               torch.full((S, cfg.conv_dim, cfg.conv_kernel - 1), float("nan"))) for i in cfg.kda_layers}
    pools = SlotPools(kda, torch.full((40, len(cfg.mla_layers), NB, cfg.latent_dim), float("nan")))
    slots, tables, toks, alone = [], [], [], []
    for r, L in enumerate(contexts):
        seq = torch.randint(0, 256, (L + 1,), generator=torch.Generator().manual_seed(r))
        cache = model.forward(seq[:L].unsqueeze(0), mode="chunk").cache
        slot, table = S - 1 - r, [pages.pop() for _ in range(-(-(L + 1) // NB))]
        for i in cfg.kda_layers:
            kda[i][0][slot], kda[i][1][slot] = cache.layers[i].recurrent[0], cache.layers[i].conv[0]
        for j, i in enumerate(cfg.mla_layers):
            for p in range(L):
                pools.kv_cache[table[p // NB], j, p % NB] = cache.layers[i][0, p]
        alone.append(model.decode_step(seq[L:], cache))
        slots.append(slot)
        tables.append(table)
        toks.append(seq[L:])
    n = len(contexts)
    meta = make_meta([1] * (n + 1), n + 1, slots + [PAD_SLOT], [True] * n + [False], list(contexts) + [0],
                     tables + [[]])
    return pools, meta, torch.cat(toks + [torch.tensor([3])]), alone, slots, tables


@pytest.mark.parametrize("contexts", [pytest.param((5, 20, 5, 33, 20), id="L5-20-5-33-20"),
                                      pytest.param((9, 9, 9), id="L9x3")])
def test_decode_rows_grouped_by_length_equal_alone(model, contexts):
    cfg = model.cfg
    pools, meta, tokens, alone, slots, tables = _decode_batch(model, contexts)
    kda, S, n = pools.kda, len(contexts) + 2, len(contexts)
    out = forward_batch(model, tokens, meta, pools)
    for r, (logits, cache) in enumerate(alone):
        assert torch.equal(out.logits[r], logits[0]), f"row {r}"
        for i in cfg.kda_layers:
            assert torch.equal(kda[i][0][slots[r]], cache.layers[i].recurrent[0])
            assert torch.equal(kda[i][1][slots[r]], cache.layers[i].conv[0])
        for j, i in enumerate(cfg.mla_layers):
            assert torch.equal(read_latents(pools.kv_cache, j, tables[r], contexts[r] + 1), cache.layers[i])
    assert all(kda[i][0][:S - n].isnan().all() for i in cfg.kda_layers)   # unused slots never written


def test_decode_rows_with_rotary_mla_equal_alone():
    """An MLA with rotary embedding (``mla_use_nope`` false: the real presets' setting) through the same decode
    batch: each live row's logits and latents still bitwise ``model.decode_step`` alone (the all-decode C layer
    applies no rotation, so such a model takes the per-part path)."""
    model = HybridLM(dataclasses.replace(PRESETS["demo-tiny"], mla_use_nope=False))
    pools, meta, tokens, alone, slots, tables = _decode_batch(model, (5, 20, 33))
    out = forward_batch(model, tokens, meta, pools)
    for r, (logits, cache) in enumerate(alone):
        assert torch.equal(out.logits[r], logits[0]), f"row {r}"
        for j, i in enumerate(model.cfg.mla_layers):
            assert torch.equal(read_latents(pools.kv_cache, j, tables[r], (5, 20, 33)[r] + 1), cache.layers[i])


def test_decode_rows_when_the_c_attention_skips_the_layer(model, monkeypatch):
    """The C absorbed attention runs the cache (the step packs no latent tensor) but not the layer's tensors (say,
    another dtype): the layer packs its latents itself and runs the torch form, still bitwise the model alone."""
    from kda_core import cpu_mla
    real = cpu_mla.runs
    monkeypatch.setattr(cpu_mla, "runs", lambda *t: real(*t) if len(t) == 1 else None)
    pools, meta, tokens, alone, slots, tables = _decode_batch(model, (5, 20))
    out = forward_batch(model, tokens, meta, pools)
    for r, (logits, cache) in enumerate(alone):
        assert torch.equal(out.logits[r], logits[0]), f"row {r}"
        for j, i in enumerate(model.cfg.mla_layers):
            assert torch.equal(read_latents(pools.kv_cache, j, tables[r], (5, 20)[r] + 1), cache.layers[i])


def test_decode_block_equals_the_layer_by_layer_calls(model, monkeypatch):
    """An all-decode batch runs each KDA sublayer in one C call (kda_decode_block: input norm, input GEMM, decode,
    o_proj, residual add) and each MLA sublayer in one (mla_decode_residual_f32); its logits, new states, latents and
    ReplaySSM records are bitwise those of the separate calls (_kda_layer, _mla_layer), with a pad row in the batch."""
    from kda_core import decode_cpu, varlen
    if decode_cpu.block_runs(*next(iter(_decode_batch(model, (3,))[0].kda.values()))) is None:
        pytest.skip("no C decode block here")
    outs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(varlen, "_kda_decode_block", lambda *a: None)
            monkeypatch.setattr(varlen, "_mla_decode_block", lambda *a: None)
        pools, meta, tokens, alone, slots, tables = _decode_batch(model, (5, 20, 9))
        outs.append((forward_batch(model, tokens, meta, pools, decode_records=True, write=False), pools.kv_cache))
    (got, got_kv), (want, want_kv) = outs
    assert torch.equal(got.logits[:3], want.logits[:3])
    assert torch.equal(got_kv.nan_to_num(7.0), want_kv.nan_to_num(7.0))
    for i in model.cfg.kda_layers:
        (g,), (w,) = got.state_writes[i], want.state_writes[i]
        assert torch.equal(g.recurrent[:3], w.recurrent[:3]) and torch.equal(g.conv[:3], w.conv[:3])
        assert all(torch.equal(a[:3], b[:3]) for a, b in zip(got.decode_records[i], want.decode_records[i]))


def test_decode_rows_never_expand_cached_latents(model, monkeypatch):
    """A decode step reads each row's latents in the absorbed form: no GEMM through the whole ``kv_b`` (the
    expanded form re-expanded every cached latent of every row, every step: O(sum L) GEMM rows per MLA layer)."""
    import kda_core.layer as layer_mod
    import kda_core.varlen as varlen_mod
    kv_b = {id(model.mixers[i].kv_b) for i in model.cfg.mla_layers}
    rows_through_kv_b = []

    def spy(real):
        def linear(x, w):
            if id(w) in kv_b:
                rows_through_kv_b.append(x.numel() // x.shape[-1])
            return real(x, w)
        return linear

    pools, meta, tokens, *_ = _decode_batch(model, (5, 20, 33))
    for mod in (layer_mod, varlen_mod):
        monkeypatch.setattr(mod, "linear", spy(mod.linear))
    forward_batch(model, tokens, meta, pools)
    assert rows_through_kv_b == []


def test_absorbed_recurrent_agrees_with_expanded_chunk(model):
    """Decode and verify (``mode="recurrent"``, absorbed) against prefill (``mode="chunk"``, keys and values
    expanded through ``kv_b``) on one MLA layer: the same maths summed in another order, ``(q W_uk) . c`` against
    ``q . (W_uk c)``; each output within 1e-5 of the largest (fp32 sums of <= 64 terms: ~1e-6)."""
    layer = model.mixers[model.cfg.mla_layers[0]]
    gen = torch.Generator().manual_seed(11)
    x, cache = torch.randn(2, 9, model.cfg.hidden_size, generator=gen), torch.randn(2, 5, model.cfg.latent_dim,
                                                                                     generator=gen)
    with torch.no_grad():
        y_rec, lat_rec = layer(x, cache, mode="recurrent")
        y_chunk, lat_chunk = layer(x, cache, mode="chunk")
    assert torch.equal(lat_rec, lat_chunk)
    assert (y_rec - y_chunk).abs().max() <= 1e-5 * y_chunk.abs().max()


@pytest.mark.parametrize("lens,num_decode", [pytest.param([1, 1, 1], 3, id="decode"),
                                             pytest.param([1, 1, 5, 1, 70], 2, id="mixed")])
def test_positions_are_each_tokens_place_in_its_sequence(lens, num_decode):
    """``_positions`` (no loop over rows) against the per-row loop it replaced."""
    from kda_core.varlen import _positions
    ctx = [4, 0, 17, 3, 64][: len(lens)]
    slots = [2, PAD_SLOT, 0, 1, 3][: len(lens)]
    meta = make_meta(lens, num_decode, slots, [c > 0 for c in ctx], ctx, [[0] * 9] * len(lens))
    qsl = meta.query_start_loc.tolist()
    want_pos = torch.cat([torch.arange(c, c + t) for c, t in zip(ctx, lens)])
    want_pad = torch.cat([torch.full((t,), s == PAD_SLOT) for s, t in zip(slots, lens)])
    pos, pad = _positions(meta, qsl)
    assert torch.equal(pos, want_pos) and torch.equal(pad, want_pad)
