"""kda_core.cpu_mla: the C form of the absorbed MLA attention against the torch form (within cpu_mla.RTOL / ATOL),
each query of a batched call bitwise that query alone, and bad latent runs rejected by name."""
import dataclasses
from pathlib import Path

import pytest
import torch

from kda_core import cpu_mla
from kda_core.layer import MLALayer
from kda_core.model import HybridLM

pytestmark = pytest.mark.skipif(cpu_mla.backend() is None, reason=f"no C MLA: {cpu_mla.reason()}")


@pytest.fixture(scope="module")
def demo():
    model = HybridLM.from_pretrained(Path(__file__).resolve().parents[2] / "weights" / "kda-demo")
    return model.mixers[model.cfg.mla_layers[0]]


def layer(demo, name):
    """The demo's MLA layer, or one with awkward sizes: 3 heads (not a multiple of 4), r = 40 (not of 32), rope 6."""
    if name == "demo":
        return demo
    cfg = dataclasses.replace(demo.cfg, num_mla_heads=3, kv_lora_rank=40, qk_rope_head_dim=6, qk_nope_head_dim=12,
                              v_head_dim=20)
    return MLALayer(cfg, torch.Generator().manual_seed(1))


def torch_form(m, q, lat, L, monkeypatch):
    with monkeypatch.context() as mp:
        mp.setattr(cpu_mla, "runs", lambda *t: None)
        return m.attend_absorbed(q, lat, L)


@pytest.mark.parametrize("name", ["demo", "H3-r40-rope6"])
@pytest.mark.parametrize("B,L,T", [pytest.param(1, 0, 1, id="B1-L0-T1"), pytest.param(2, 37, 4, id="B2-L37-T4"),
                                   pytest.param(3, 100, 1, id="B3-L100-T1")])
def test_attend_absorbed_c_form(demo, name, B, L, T, monkeypatch):
    """The C form against the torch form within the named tolerance, and every query (b, t) of the batched call
    bitwise the same query alone over its own L + t + 1 latents."""
    m = layer(demo, name)
    cfg = m.cfg
    gen = torch.Generator().manual_seed(B * 1000 + L)
    q = torch.randn(B, T, cfg.num_mla_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, generator=gen)
    lat = torch.randn(B, L + T, cfg.latent_dim, generator=gen)
    with torch.no_grad():
        got = m.attend_absorbed(q, lat, L)
        torch.testing.assert_close(got, torch_form(m, q, lat, L, monkeypatch), rtol=cpu_mla.RTOL, atol=cpu_mla.ATOL)
        for b in range(B):
            for t in range(T):
                alone = m.attend_absorbed(q[b: b + 1, t: t + 1], lat[b: b + 1, : L + t + 1].clone(), L + t)
                assert torch.equal(alone, got[b: b + 1, t: t + 1])


def test_attend_nan_query_stays_its_own(demo):
    """A NaN query and its NaN latents (an engine pad row) give NaN and leave the other queries' bits alone."""
    cfg = demo.cfg
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, cfg.num_mla_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, generator=gen)
    lat = torch.randn(30, cfg.latent_dim, generator=gen)
    off, lens = torch.tensor([0, 10, 20]), torch.tensor([10, 10, 7])
    c = cpu_mla.backend()
    with torch.no_grad():
        clean = c.attend(demo, q, lat, off, lens)
        q[1], lat[10:20] = float("nan"), float("nan")
        got = c.attend(demo, q, lat, off, lens)
    assert got[1].isnan().all() and torch.equal(got[[0, 2]], clean[[0, 2]])


@pytest.mark.parametrize("off,lens", [pytest.param([0, 25], [5, 6], id="past-the-end"),
                                      pytest.param([0, 3], [5, 0], id="empty"), pytest.param([-1], [2], id="negative")])
def test_attend_rejects_bad_latent_runs(demo, off, lens):
    cfg = demo.cfg
    q = torch.zeros(len(off), cfg.num_mla_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    with pytest.raises(ValueError, match="non-empty run of latents"):
        cpu_mla.backend().attend(demo, q, torch.zeros(30, cfg.latent_dim), torch.tensor(off), torch.tensor(lens))


def test_attend_paged_equals_contiguous_bitwise(demo):
    """Latents read in place from shuffled pages (the engine) and then from the new rows give the bits of the same
    latents in one contiguous run (the model's own forward), for runs ending mid-page and on a page boundary."""
    cfg, NB = demo.cfg, 4
    gen = torch.Generator().manual_seed(8)
    runs = [(7, 1), (8, 3), (0, 2)]                                      # (cached, new) per query
    q = torch.randn(len(runs), cfg.num_mla_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, generator=gen)
    cache = torch.full((9, 2, NB, cfg.latent_dim), float("nan"))         # [pages, MLA layers, NB, R]
    new = torch.randn(6, cfg.latent_dim, generator=gen)
    order = torch.randperm(9, generator=gen).tolist()
    contiguous, cols, pages, first = [], [], [], 0
    for L, T in runs:
        lat = torch.randn(L, cfg.latent_dim, generator=gen)
        table = [order.pop() for _ in range(-(-L // NB))]
        for j in range(L):
            cache[table[j // NB], 1, j % NB] = lat[j]
        cols.append((len(pages), L, first, L + T))
        pages += table
        contiguous.append(torch.cat([lat, new[first: first + T]]))
        first += T
    c = cpu_mla.backend()
    with torch.no_grad():
        got = c.attend_paged(demo, q, new, torch.tensor(cols).T.contiguous(), cache.select(1, 1), torch.tensor(pages))
        lens = torch.tensor([len(t) for t in contiguous])
        want = c.attend(demo, q, torch.cat(contiguous), lens.cumsum(0) - lens, lens)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="non-empty run of latents"):             # a page outside the cache
        c.attend_paged(demo, q[:1], new, torch.tensor([[0], [5], [0], [6]]), cache.select(1, 1), torch.tensor([9, 0]))


def test_decode_layer_is_the_recurrent_forward_bitwise(demo):
    """The whole MLA layer in one call (projections, latent write, attention, o_proj) gives each row the bits of
    ``MLALayer.forward(mode="recurrent")`` on that row alone, and writes its latent where asked; a write outside
    the cache is refused with nothing written."""
    cfg, NB = demo.cfg, 4
    gen = torch.Generator().manual_seed(12)
    contexts = (6, 0, 9)
    cache = torch.full((8, 1, NB, cfg.latent_dim), float("nan"))          # [pages, MLA layers, NB, R]
    h = torch.randn(len(contexts), cfg.hidden_size, generator=gen)
    cols, pages, alone, free = [], [], [], list(range(8))
    with torch.no_grad():
        for i, L in enumerate(contexts):
            prior = demo.forward(torch.randn(1, L, cfg.hidden_size, generator=gen), mode="chunk")[1] if L else None
            table = [free.pop() for _ in range(-(-(L + 1) // NB))]
            for j in range(L):
                cache[table[j // NB], 0, j % NB] = prior[0, j]
            cols.append((len(pages), L, i, L + 1, table[L // NB], L % NB))
            pages += table
            alone.append(demo.forward(h[i][None, None], prior, mode="recurrent"))
        qm, pages = torch.tensor(cols).T.contiguous(), torch.tensor(pages)
        before = cache.clone()
        bad = qm.clone()
        bad[4, 2] = 8                                                     # a page past the cache
        with pytest.raises(ValueError, match="write inside the cache"):
            cpu_mla.backend().decode(demo, h, cache.select(1, 0), bad, pages)
        assert torch.equal(cache.nan_to_num(7.0), before.nan_to_num(7.0))
        y = cpu_mla.backend().decode(demo, h, cache.select(1, 0), qm, pages)
    for i, (y_alone, lat) in enumerate(alone):
        assert torch.equal(y[i], y_alone[0, 0])
        assert torch.equal(cache[cols[i][4], 0, cols[i][5]], lat[0, -1])
