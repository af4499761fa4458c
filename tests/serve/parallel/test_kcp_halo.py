"""serve.parallel.halo: a KDALayer prefill across ranks (state exchange + conv halo) equals the
single-process layer; dropping the halo breaks it."""
import pytest
import torch

from kda_core.conv import short_conv
from serve.parallel.halo import fold_halo, halo_bytes
from serve.parallel.inputs import layer_inputs
from serve.parallel.run import KCPConfig, initial_layer_cache, run_kcp

TOL = 1e-5
BASE = dict(batch=2, num_heads=2, head_k_dim=16, head_v_dim=12, hidden_size=32, level="layer", check=True,
            return_outputs=True, start_method="forkserver", timeout_s=60)


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _reference(cfg):
    layer = cfg.layer()
    x = layer_inputs(cfg.batch, cfg.hidden_size, 0, cfg.seq_len, cfg.seed)
    with torch.no_grad():
        out = layer(x, initial_layer_cache(cfg, layer) if cfg.with_initial_state else None)
    return out.y, out.cache


@pytest.mark.parametrize("seq_len", [150, 7], ids=lambda t: f"T{t}")       # T = 7: blocks shorter than W - 1
@pytest.mark.parametrize("with_state", [False, True], ids=["empty", "prefix"])
@pytest.mark.parametrize("variant", ["allgather", "ring"])
@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda w: f"W{w}")
def test_layer_prefill_matches_single_rank(world, variant, with_state, seq_len, ranks_gone):
    cfg = KCPConfig(seq_len=seq_len, world_size=world, variant=variant, with_initial_state=with_state, **BASE)
    run = run_kcp(cfg)
    ranks_gone(run.pids)
    y_ref, cache_ref = _reference(cfg)
    y = torch.cat([r.o for r in run.ranks], dim=1)
    assert y.shape == y_ref.shape
    assert _err(y, y_ref) <= TOL
    assert _err(run.ranks[-1].final_state, cache_ref.recurrent) <= TOL
    d = cfg.layer().cfg
    for r in run.ranks:
        assert r.max_abs_err_o <= TOL and r.max_abs_err_state <= TOL
        assert (r.halo_sent_bytes, r.halo_received_bytes) == halo_bytes(cfg.batch, d.conv_dim, d.conv_kernel, world)


def test_layer_prefill_in_pieces(ranks_gone):
    cfg = KCPConfig(seq_len=300, world_size=2, with_initial_state=True, piece_tokens=64, **BASE)
    run = run_kcp(cfg)
    ranks_gone(run.pids)
    y_ref, cache_ref = _reference(cfg)
    assert _err(torch.cat([r.o for r in run.ranks], dim=1), y_ref) <= TOL
    assert _err(run.ranks[-1].final_state, cache_ref.recurrent) <= TOL


@pytest.mark.parametrize("variant", ["allgather", "ring"])
def test_dropping_the_halo_fails(variant, ranks_gone):
    cfg = KCPConfig(seq_len=150, world_size=3, variant=variant, halo=False, **BASE)
    run = run_kcp(cfg)
    ranks_gone(run.pids)
    y_ref, _ = _reference(cfg)
    assert run.ranks[0].max_abs_err_o <= TOL                   # rank 0 has no predecessor
    for r in run.ranks[1:]:
        assert _err(r.o, y_ref[:, r.start:r.end]) > 1e-3 and r.max_abs_err_o > 1e-3
        assert r.halo_sent_bytes == r.halo_received_bytes == 0


@pytest.mark.parametrize("lengths", [[5, 6, 4], [2, 1, 1, 3], [1, 1, 1, 1, 1]], ids=str)
def test_fold_halo_equals_conv_state(lengths):
    """Folding the tails gives exactly the conv state short_conv carries to each block."""
    Bc, D, W = 2, 5, 4
    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(Bc, sum(lengths), D, generator=gen)
    start = torch.randn(Bc, D, W - 1, generator=gen)
    weight = torch.randn(D, W, generator=gen)
    cuts = [0]
    for n in lengths:
        cuts.append(cuts[-1] + n)
    tails, states = [], [start]
    for r, (s, e) in enumerate(zip(cuts, cuts[1:])):
        _, new = short_conv(raw[:, s:e], weight, states[-1] if r == 0 else torch.zeros(Bc, D, W - 1))
        tails.append(new)
        states.append(short_conv(raw[:, :e], weight, start)[1])
    for r in range(1, len(lengths)):
        assert torch.equal(fold_halo(tails, lengths, r), states[r])


def test_halo_bytes():
    assert halo_bytes(1, 2 * 4 * 128 + 4 * 128, 4, 2) == (1536 * 3 * 4, 1536 * 3 * 4)
    assert halo_bytes(1, 100, 4, 4) == (1200, 3600)
    assert halo_bytes(1, 100, 4, 1) == (0, 0)
