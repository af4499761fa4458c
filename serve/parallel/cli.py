"""Command line of ``python -m serve.parallel`` (local ranks) and ``torchrun ... -m serve.parallel``.

Under torchrun (``RANK``/``WORLD_SIZE`` set) this process is one rank: it joins the group from the env
vars, runs :func:`serve.parallel.run.rank_job`, and rank 0 prints every rank's line. Otherwise it
starts ``--world-size`` local ranks with :func:`serve.parallel.run.run_kcp`.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist

from serve.parallel.comm import PHASES
from serve.parallel.inputs import DTYPES
from serve.parallel.kcp import VARIANTS
from serve.parallel.launch import BACKENDS, init_from_env
from serve.parallel.run import LEVELS, KCPConfig, RankResult, rank_job, run_kcp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serve.parallel", description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, required=True, help="tokens T of the prompt")
    p.add_argument("--world-size", type=int, default=2, help="local ranks (ignored under torchrun)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-k-dim", type=int, default=128)
    p.add_argument("--head-v-dim", type=int, default=128)
    p.add_argument("--variant", choices=VARIANTS, default="allgather")
    p.add_argument("--level", choices=LEVELS, default="kernel")
    p.add_argument("--initial-state", action="store_true", help="seed rank 0 with a prefix-cache state")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    p.add_argument("--piece-tokens", type=int, default=None,
                   help="process each rank's block in pieces of this many tokens (a multiple of 64)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--check", action="store_true", help="compare every rank with a single-rank run")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--backend", choices=BACKENDS, default="gloo")
    p.add_argument("--timeout-s", type=float, default=600.0)
    return p.parse_args(argv)


def format_results(cfg: KCPConfig, results: list[RankResult]) -> str:
    """A table: one line per rank with its phases (ms), total, bytes and (with --check) max |delta|."""
    head = (f"KCP {cfg.variant} level={cfg.level} T={cfg.seq_len:,} world={cfg.world_size} B={cfg.batch} "
            f"H={cfg.num_heads} K={cfg.head_k_dim} V={cfg.head_v_dim} {cfg.dtype} threads/rank={cfg.threads_per_rank} "
            f"pieces={cfg.piece_tokens or 'whole block'}")
    cols = " ".join(f"{p:>9}" for p in PHASES)
    lines = [head, f"rank {'tokens':>13} {cols} {'total_ms':>9} {'sent_B':>10} {'recv_B':>10} {'max|d|':>9}"]
    for r in results:
        err = max(r.max_abs_err_o, r.max_abs_err_state)
        phases = " ".join(f"{t:9.1f}" for t in r.times)
        lines.append(f"{r.rank:>4} {f'[{r.start},{r.end})':>13} {phases} {r.total_ms:9.1f} "
                     f"{r.sent_bytes + r.halo_sent_bytes:>10,} {r.received_bytes + r.halo_received_bytes:>10,} "
                     f"{'-' if math.isnan(err) else f'{err:.1e}':>9}")
    lines.append(f"wall (slowest rank): {max(r.total_ms for r in results):.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 with a one-line error for a bad configuration)."""
    a = parse_args(argv)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else a.world_size
    try:   # validated before any rank starts, memory included (serve.parallel.memory)
        cfg = KCPConfig(seq_len=a.seq_len, world_size=world, batch=a.batch, num_heads=a.heads,
                        head_k_dim=a.head_k_dim, head_v_dim=a.head_v_dim, variant=a.variant, level=a.level,
                        with_initial_state=a.initial_state, dtype=a.dtype, piece_tokens=a.piece_tokens,
                        repeats=a.repeats, check=a.check, threads_per_rank=a.threads_per_rank, backend=a.backend,
                        timeout_s=a.timeout_s)
    except ValueError as err:
        print(f"python -m serve.parallel: error: {err}", file=sys.stderr)
        return 2
    if not torchrun:
        print(format_results(cfg, list(run_kcp(cfg).ranks)))
        return 0
    torch.set_num_threads(cfg.threads_per_rank)
    rank, world = init_from_env(cfg.backend, cfg.timeout_s)
    try:
        res = rank_job(rank, world, cfg)
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        if rank == 0:
            print(format_results(cfg, gathered), flush=True)
    finally:
        dist.destroy_process_group()
    return 0
