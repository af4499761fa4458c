"""serve.parallel.kcp on real gloo ranks: outputs and states equal single-rank kda_chunk; bytes are
the formula and do not depend on T. Ranks start from a forkserver here (fast); the spawn path is in
test_kcp_launch.py."""
import pytest
import torch

from kda_core.chunk import kda_chunk
from serve.parallel.inputs import initial_state, kda_inputs
from serve.parallel.kcp import block_bounds, exchange_bytes, piece_bounds
from serve.parallel.run import KCPConfig, run_kcp

TOL = {"float32": 1e-5, "float64": 1e-10}
B, H, K, V, T = 2, 2, 16, 12, 150          # T divisible by neither 64 nor 4; K != V
BASE = dict(seq_len=T, batch=B, num_heads=H, head_k_dim=K, head_v_dim=V, check=True, return_outputs=True,
            start_method="forkserver", timeout_s=60)


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero", "prefix"])
@pytest.mark.parametrize("variant", ["allgather", "ring"])
@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda w: f"W{w}")
def test_kcp_matches_single_rank(world, variant, with_state, dtype, ranks_gone):
    cfg = KCPConfig(world_size=world, variant=variant, with_initial_state=with_state, dtype=dtype, **BASE)
    run = run_kcp(cfg)
    ranks_gone(run.pids)
    x = kda_inputs(B, H, K, V, 0, T, 0, dtype)
    s0 = initial_state(B, H, K, V, 0, dtype) if with_state else None
    ref = kda_chunk(*x, s0)
    tol = TOL[dtype]
    assert [(r.start, r.end) for r in run.ranks] == block_bounds(T, world)
    o = torch.cat([r.o for r in run.ranks], dim=1)
    assert o.shape == (B, T, H, V) and o.dtype == getattr(torch, dtype)
    assert _err(o, ref.o) <= tol
    assert _err(run.ranks[-1].final_state, ref.final_state) <= tol
    for r in run.ranks:                      # in-rank check: state after each block vs its prefix run
        assert r.max_abs_err_o <= tol and r.max_abs_err_state <= tol, r
        assert (r.sent_bytes, r.received_bytes) == exchange_bytes(B, H, K, V, world, variant, r.rank, cfg.elem_bytes)
    if world == 1:                           # one rank is exactly kda_chunk (same three functions)
        assert torch.equal(o, ref.o) and torch.equal(run.ranks[0].final_state, ref.final_state)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("variant", ["allgather", "ring"])
@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"W{w}")
def test_kcp_in_pieces_matches_single_rank(world, variant, dtype, ranks_gone):
    """Each rank's block in 64-token pieces with the state carried (T = 400: up to 7 pieces per rank)."""
    cfg = KCPConfig(world_size=world, variant=variant, dtype=dtype, piece_tokens=64, with_initial_state=True,
                    **{**BASE, "seq_len": 400})
    run = run_kcp(cfg)
    ranks_gone(run.pids)
    x = kda_inputs(B, H, K, V, 0, 400, 0, dtype)
    ref = kda_chunk(*x, initial_state(B, H, K, V, 0, dtype))
    assert _err(torch.cat([r.o for r in run.ranks], dim=1), ref.o) <= TOL[dtype]
    assert _err(run.ranks[-1].final_state, ref.final_state) <= TOL[dtype]
    assert all(r.max_abs_err_state <= TOL[dtype] for r in run.ranks)


def test_piece_bounds():
    assert piece_bounds(150, None, 64) == [(0, 150)]
    assert piece_bounds(150, 64, 64) == [(0, 64), (64, 128), (128, 150)]
    assert piece_bounds(128, 128, 64) == [(0, 128)]
    with pytest.raises(ValueError, match="piece_tokens must be None or a positive multiple of chunk_size = 64"):
        piece_bounds(150, 100, 64)
    with pytest.raises(ValueError, match="piece_tokens"):
        KCPConfig(seq_len=150, piece_tokens=0)


def test_states_matter():
    """Negative control: starting each block from zero instead of its folded state is far off, so
    the tolerance above can catch a wrong fold."""
    x = kda_inputs(B, H, K, V, 0, T, 0, "float64")
    ref = kda_chunk(*x)
    for start, end in block_bounds(T, 4)[1:]:
        alone = kda_chunk(*(t[:, start:end] for t in x))
        assert _err(alone.o, ref.o[:, start:end]) > 1e-3


@pytest.mark.parametrize("variant", ["allgather", "ring"])
def test_bytes_independent_of_seq_len(variant, ranks_gone):
    """Same bytes at T = 4,096 and 65,536 (small H, K, V keep this fast), equal to the formula."""
    seen = []
    for seq_len in (4096, 65536):
        cfg = KCPConfig(seq_len=seq_len, world_size=2, num_heads=1, head_k_dim=8, head_v_dim=4, variant=variant,
                        start_method="forkserver", timeout_s=120)
        run = run_kcp(cfg)
        ranks_gone(run.pids)
        seen.append([(r.sent_bytes, r.received_bytes) for r in run.ranks])
    assert seen[0] == seen[1] == [exchange_bytes(1, 1, 8, 4, 2, variant, r) for r in range(2)]
    payload = 1 * 8 * (8 + 4) * 4 if variant == "allgather" else 1 * 8 * 4 * 4     # H K (K + V) s | H K V s
    assert seen[0][0][0] == payload


def test_exchange_bytes_formula():
    assert exchange_bytes(1, 4, 128, 128, 2, "allgather", 0) == (4 * 128 * 256 * 4, 4 * 128 * 256 * 4)
    assert exchange_bytes(1, 4, 128, 128, 4, "allgather", 3) == (524288, 3 * 524288)
    assert exchange_bytes(1, 4, 128, 128, 4, "ring", 0) == (262144, 0)
    assert exchange_bytes(1, 4, 128, 128, 4, "ring", 3) == (0, 262144)
    assert exchange_bytes(2, 4, 128, 64, 1, "ring", 0) == (0, 0)
    with pytest.raises(ValueError, match="variant"):
        exchange_bytes(1, 1, 1, 1, 2, "tree", 0)
    with pytest.raises(ValueError, match="rank"):
        exchange_bytes(1, 1, 1, 1, 2, "ring", 2)


def test_block_bounds():
    assert block_bounds(150, 4) == [(0, 38), (38, 76), (76, 113), (113, 150)]
    assert block_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="seq_len must be an int >= world_size"):
        block_bounds(3, 4)
    with pytest.raises(ValueError, match="world_size"):
        block_bounds(8, 0)
