"""Command line of ``python -m serve.parallel`` (local ranks) and ``torchrun ... -m serve.parallel``.

Under torchrun (``RANK`` or ``WORLD_SIZE`` set) this process is one rank: it joins the group from the env
vars, runs :func:`serve.parallel.run.rank_job`, and rank 0 prints every rank's line. Otherwise it
starts ``--world-size`` local ranks with :func:`serve.parallel.run.run_kcp`.

Every failure is one line on stderr naming the problem, never a traceback (``--traceback`` adds it):
exit code 2 for a bad configuration or environment, found before any rank starts (a malformed torchrun
variable, a timeout out of range, more local ranks than cores without ``--oversubscribe``, a prompt
beyond memory), and 1 for a run that failed (a rank raised or died, a deadline passed, a torchrun peer
never came). A local launch gives each rank a core: ``--world-size`` times ``--threads-per-rank`` above
the cores this process may use is refused, since the ranks would queue for cores (timings then measure
the queue, and ``--timeout-s`` would be reached by the start-up alone). Under torchrun the launcher has
already started the processes, so no such cap applies there.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

import torch
import torch.distributed as dist

from serve.parallel.comm import PHASES
from serve.parallel.host import host_limits
from serve.parallel.inputs import DTYPES
from serve.parallel.kcp import VARIANTS
from serve.parallel.launch import BACKENDS, RankFailure, RankTimeout
from serve.parallel.run import LEVELS, KCPConfig, RankResult, rank_job, run_kcp
from serve.parallel.torchrun import init_from_env, torchrun_env


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
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="deadline of the whole run in seconds (at most a week)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more local ranks x threads than this machine's cores (timings then include queueing)")
    p.add_argument("--traceback", action="store_true", help="on failure, also print the full traceback")
    return p.parse_args(argv)


def check_local_cores(world_size: int, threads_per_rank: int, cores: int) -> None:
    """Raise ValueError if ``world_size`` local ranks of ``threads_per_rank`` threads need more than
    ``cores`` cores (the check behind ``--oversubscribe``)."""
    if world_size * threads_per_rank > cores:
        raise ValueError(
            f"--world-size {world_size} x --threads-per-rank {threads_per_rank} needs {world_size * threads_per_rank} "
            f"cores but this machine gives this process {cores}; use --world-size <= {max(1, cores // threads_per_rank)} "
            "or add --oversubscribe (the ranks then queue for cores and the timings include the queueing)")


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


def _fail(msg, code: int, err: BaseException | None = None, full: bool = False) -> int:
    """Print ``msg`` as one line on stderr (plus ``err``'s traceback with ``--traceback``); returns ``code``."""
    line = " ".join(str(msg).split("\n", 1)[0].split())
    print(f"python -m serve.parallel: error: {line}", file=sys.stderr)
    if full and err is not None:
        print("".join(traceback.format_exception(err)), file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code: 0 done, 2 a bad configuration or environment (one
    line, before any rank starts), 1 a failed run (one line naming the rank or the deadline)."""
    a = parse_args(argv)
    torchrun = "RANK" in os.environ or "WORLD_SIZE" in os.environ
    try:   # validated before any rank starts, memory included (serve.parallel.memory)
        if torchrun:
            env = torchrun_env()
            world = env.world_size
        else:
            world = a.world_size
            if not a.oversubscribe and world >= 1 and a.threads_per_rank >= 1:   # else KCPConfig names them
                check_local_cores(world, a.threads_per_rank, host_limits().cores)
        cfg = KCPConfig(seq_len=a.seq_len, world_size=world, batch=a.batch, num_heads=a.heads,
                        head_k_dim=a.head_k_dim, head_v_dim=a.head_v_dim, variant=a.variant, level=a.level,
                        with_initial_state=a.initial_state, dtype=a.dtype, piece_tokens=a.piece_tokens,
                        repeats=a.repeats, check=a.check, threads_per_rank=a.threads_per_rank, backend=a.backend,
                        timeout_s=a.timeout_s)
    except ValueError as err:
        return _fail(err, 2, err, a.traceback)
    if not torchrun:
        try:
            run = run_kcp(cfg)
        except RankTimeout as err:
            return _fail(f"{err} (raise --timeout-s)", 1, err, a.traceback)
        except RankFailure as err:
            hint = "" if a.traceback else " (--traceback prints the rank's traceback)"
            return _fail(f"{str(err).splitlines()[0]}{hint}", 1, err, a.traceback)
        print(format_results(cfg, list(run.ranks)))
        return 0
    torch.set_num_threads(cfg.threads_per_rank)
    try:
        rank, world = init_from_env(cfg.backend, cfg.timeout_s)
    except (RuntimeError, ValueError) as err:   # torch.distributed.DistError is a RuntimeError
        return _fail(f"rank {env.rank} of {env.world_size} could not join the process group at "
                     f"{env.master_addr}:{env.master_port} within --timeout-s {cfg.timeout_s:g}: "
                     f"{type(err).__name__}: {err}", 1, err, a.traceback)
    try:
        res = rank_job(rank, world, cfg)
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        if rank == 0:
            print(format_results(cfg, gathered), flush=True)
    except (RuntimeError, ValueError) as err:   # a peer died or a collective passed its timeout
        return _fail(f"rank {rank} of {world} failed: {type(err).__name__}: {err}", 1, err, a.traceback)
    finally:
        dist.destroy_process_group()
    return 0
