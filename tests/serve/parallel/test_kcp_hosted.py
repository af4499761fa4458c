"""KCP as the hosted app runs it: ranks forked from the caller (nothing left behind), the host's limits,
and the memory estimate that caps what page 10 offers."""
import os
from pathlib import Path

import pytest

from lab.kcp import compare_with, kcp_limits, single_rank
from serve.parallel.host import host_limits
from serve.parallel.launch import run_ranks
from serve.parallel.memory import FORK_OVERHEAD_BYTES, TORCH_BASE_BYTES, rank_bytes
from serve.parallel.run import KCPConfig

SMALL = dict(seq_len=150, num_heads=2, head_k_dim=16, head_v_dim=12, start_method="fork", timeout_s=60)


def _children() -> list[int]:
    return [int(c) for t in Path(f"/proc/{os.getpid()}/task").iterdir() for c in (t / "children").read_text().split()]


@pytest.mark.parametrize("variant", ["allgather", "ring"])
def test_fork_ranks_exact_and_gone(variant):
    before = set(_children())          # e.g. a forkserver an earlier test of this process started
    ref = single_rank(KCPConfig(world_size=1, **SMALL))
    rows = compare_with(KCPConfig(world_size=3, variant=variant, **SMALL), ref)
    assert max(max(r.max_abs_err_o, 0.0) for r in rows) <= 1e-5          # fp32, chunked vs split sums
    assert rows[-1].max_abs_err_state <= 1e-5
    assert set(_children()) <= before, "a rank (or a forkserver) outlived the run"


def _one(rank, world_size):
    return rank


def test_fork_needs_one_thread_per_rank():
    with pytest.raises(ValueError, match="start_method 'fork' needs threads_per_rank = 1"):
        run_ranks(_one, 2, start_method="fork", threads_per_rank=2)


def test_host_limits_env(monkeypatch):
    monkeypatch.setenv("KDA_LAB_MEMORY_MIB", "690")
    lim = host_limits()
    assert lim.memory_bytes == 690 * 2 ** 20 and lim.memory_source == "KDA_LAB_MEMORY_MIB"
    assert 1 <= lim.cores <= (os.cpu_count() or 1)
    monkeypatch.setenv("KDA_LAB_MEMORY_MIB", "lots")
    with pytest.raises(ValueError, match="KDA_LAB_MEMORY_MIB must be a positive number of MiB"):
        host_limits()


def test_kcp_limits_from_the_forked_rank_estimate(monkeypatch):
    # a forked rank carries FORK_OVERHEAD_BYTES instead of a fresh process's TORCH_BASE_BYTES
    fresh = rank_bytes(2048, 1, 1, 4, 128, 128, 4, 64, None)
    assert rank_bytes(2048, 1, 1, 4, 128, 128, 4, 64, None, base_bytes=FORK_OVERHEAD_BYTES) == \
        fresh - TORCH_BASE_BYTES + FORK_OVERHEAD_BYTES
    monkeypatch.setenv("KDA_LAB_MEMORY_MIB", "690")      # the hosted box: 190 MiB left for ranks (app_pages/README.md)
    assert kcp_limits().seq_options == (512, 1024, 2048)
    monkeypatch.setenv("KDA_LAB_MEMORY_MIB", "900")
    assert kcp_limits().seq_options == (512, 1024, 2048, 4096)


def test_check_reference_counts_the_kernels_own_piece_length():
    # The single-rank check runs kda_chunk at its default piece length, which depends on the shape
    # (piece_tokens_for: 2,048 tokens at K = V = 16): the estimate must count that piece, not a fixed 1,024.
    from kda_core.chunk import piece_tokens_for
    T, B, H, K, V, s, C = 8192, 1, 4, 16, 16, 4, 64
    piece = piece_tokens_for(B, H, K, V, C)
    assert piece > 1024
    without = rank_bytes(T, 2, B, H, K, V, s, C, 256)
    with_check = rank_bytes(T, 2, B, H, K, V, s, C, 256, check=True)
    reference_only = T * (B * H * (3 * K + V + 1) * (8 + s) + B * H * (K * V / C + 2 * V) * s)
    assert abs((with_check - without) - (reference_only + B * H * (5 * K + 6 * C) * s * piece)) <= 1
