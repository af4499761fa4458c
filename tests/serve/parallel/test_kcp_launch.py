"""serve.parallel.launch and serve.parallel.torchrun: spawned ranks, clear errors, timeouts, no process left behind,
the c10d store on 127.0.0.1 only, and torchrun's environment checked."""
import contextlib
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from serve.parallel.cli import main as cli_main
from serve.parallel.kcp import kcp_kda
from serve.parallel.launch import RankFailure, RankTimeout, free_port, run_ranks
from serve.parallel.memory import check_rank_memory, rank_bytes
from serve.parallel.run import KCPConfig, rank_job, run_kcp
from serve.parallel.torchrun import init_from_env, torchrun_env


def _echo(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    out = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(out, t)
    return scale * torch.cat(out)


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("bad block on rank 1")
    dist.barrier()                     # the other ranks wait for rank 1 forever (until stopped)


def _hang_on_rank_0(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    dist.barrier()


def _die_on_rank_1(rank, world_size, code):
    if rank == 1:
        os._exit(code)
    dist.barrier()


def _state_on_every_rank(rank, world_size):
    x = torch.zeros(1, 4, 1, 2)
    return kcp_kda(x, x, x, x, x[..., 0], initial_state=torch.zeros(1, 1, 2, 2)).o


def _listening(rank, world_size):
    """The addresses this rank's process listens on (hex ``addr:port`` from /proc/net/tcp and tcp6, matched to the
    sockets among its file descriptors), after the group has formed."""
    dist.barrier()
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        out += [(table, r[1]) for r in rows if r[3] == "0A" and r[9] in inodes]       # state 0A: LISTEN
    return out


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_the_c10d_store_listens_on_127_0_0_1_only(ranks_gone):
    """The init method said tcp://127.0.0.1 but rank 0's c10d store listened on every interface ([::], dual stack);
    now every listening socket of every rank is on 127.0.0.1."""
    out = run_ranks(_listening, 2, start_method="fork", timeout_s=60)
    ranks_gone(out.pids)
    listening = [addr for rank in out.results for addr in rank]
    assert listening and all(table == "tcp" and addr.startswith("0100007F:") for table, addr in listening), listening


def test_spawn_run_is_exact_and_leaves_nothing(ranks_gone):
    run = run_kcp(KCPConfig(seq_len=100, world_size=2, num_heads=1, head_k_dim=16, head_v_dim=8, check=True,
                            start_method="spawn", timeout_s=120))
    ranks_gone(run.pids)
    assert len(set(run.pids)) == 2 and run.max_abs_err <= 1e-5


def test_results_come_back_in_rank_order(ranks_gone):
    out = run_ranks(_echo, 3, (2.0,), start_method="forkserver", timeout_s=60)
    ranks_gone(out.pids)
    assert all(torch.equal(r, torch.tensor([0.0, 2.0, 4.0])) for r in out.results)


def test_a_raising_rank_fails_the_run(ranks_gone):
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 of 3 failed: ValueError: bad block on rank 1") as err:
        run_ranks(_raise_on_rank_1, 3, start_method="forkserver", timeout_s=60)
    assert time.monotonic() - t0 < 30
    assert "Traceback" in str(err.value)
    ranks_gone(err.value.pids)


def test_a_hanging_rank_times_out(ranks_gone):
    t0 = time.monotonic()
    with pytest.raises(RankTimeout, match=r"did not finish within 3 s; ranks \[0, 1\]") as err:
        run_ranks(_hang_on_rank_0, 2, start_method="forkserver", timeout_s=3)
    assert time.monotonic() - t0 < 3 + 10
    ranks_gone(err.value.pids)


@pytest.mark.parametrize("code", [3, 0])
def test_a_dying_rank_fails_the_run(code, ranks_gone):
    """The dead rank is named first, even when its peer's collective error arrives too."""
    with pytest.raises(RankFailure, match=f"^rank 1 of 2 exited with code {code} without reporting") as err:
        run_ranks(_die_on_rank_1, 2, (code,), start_method="forkserver", timeout_s=60)
    ranks_gone(err.value.pids)


def test_bad_arguments_inside_ranks_are_reported():
    with pytest.raises(RuntimeError, match="config world_size = 3 but the process group has 2 ranks"):
        run_ranks(rank_job, 2, (KCPConfig(seq_len=64, world_size=3),), start_method="forkserver", timeout_s=60)
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed: ValueError: initial_state seeds rank 0 only"):
        run_ranks(_state_on_every_rank, 2, start_method="forkserver", timeout_s=60)


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=3, world_size=4), "seq_len must be an int >= world_size"),
    (dict(seq_len=64, variant="tree"), "variant must be one of"),
    (dict(seq_len=64, level="model"), "level must be one of"),
    (dict(seq_len=64, level="layer", dtype="float64"), "dtype must be 'float32' at level 'layer'"),
    (dict(seq_len=64, backend="nccl"), "nccl' needs CUDA"),
    (dict(seq_len=64, start_method="thread"), "start_method must be one of"),
    (dict(seq_len=64, num_heads=0), "num_heads must be an int >= 1"),
    (dict(seq_len=64, chunk_size=48), "chunk_size must be a power of two"),
    (dict(seq_len=64, timeout_s=0), "timeout_s must be > 0"),
    (dict(seq_len=64, timeout_s=float("inf")), "timeout_s must be at most 604800 s"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KCPConfig(**kwargs)


def test_bad_launch_arguments(monkeypatch):
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        run_ranks(_echo, 0)
    with pytest.raises(ValueError, match="threads_per_rank"):
        run_ranks(_echo, 1, threads_per_rank=0)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="not under torchrun"):
        init_from_env()
    assert 0 < free_port() < 65536


def test_run_ranks_rejects_what_it_cannot_send_or_wait_for():
    """A lambda used to fail deep in multiprocessing's pickler (AttributeError: Can't pickle local
    object), and timeout_s=inf passed the check and raised OverflowError in every rank."""
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"fn must be picklable for start_method 'spawn' \(a module-level "
                                         r"function.*<lambda>"):
        run_ranks(lambda rank, world_size: rank, 2)
    with pytest.raises(ValueError, match=r"args must be picklable for start_method 'forkserver'.*lock"):
        run_ranks(_echo, 2, (threading.Lock(),), start_method="forkserver")
    for bad in (float("inf"), float("nan"), 10.0 ** 9):
        with pytest.raises(ValueError, match="timeout_s must be"):
            run_ranks(_echo, 2, (1.0,), timeout_s=bad)
    assert time.monotonic() - t0 < 2                       # refused before any rank starts


@pytest.mark.parametrize("env, match", [
    (dict(RANK="0", WORLD_SIZE="abc", MASTER_ADDR="h", MASTER_PORT="1"), "WORLD_SIZE must be an int in"),
    (dict(RANK="3", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1"), r"RANK must be an int in \[0, 1\]"),
    (dict(RANK="-1", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1"), r"RANK must be an int in \[0, 1\]"),
    (dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="0"), "MASTER_PORT must be an int in"),
    (dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR=" ", MASTER_PORT="1"), "MASTER_ADDR must name the rank-0 host"),
    (dict(RANK="0", WORLD_SIZE="2"), r"\['MASTER_ADDR', 'MASTER_PORT'\] are not set"),
], ids=["world-abc", "rank-beyond", "rank-negative", "port-0", "addr-blank", "no-master"])
def test_torchrun_env_names_the_bad_variable(env, match):
    with pytest.raises(ValueError, match=match):
        torchrun_env(env)


def test_torchrun_env_reads_a_good_environment():
    assert torchrun_env(dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")) == \
        (1, 2, "10.0.0.1", 29500)


def _unpicklable_result(rank, world_size):
    dist.barrier()
    return threading.Lock() if rank == 1 else rank


def test_an_unpicklable_result_reports_the_pickling_error(ranks_gone):
    """The queue pickles in a feeder thread whose error never reaches the parent: the rank used to
    look like it 'exited with code 0 without reporting a result'."""
    with pytest.raises(RankFailure, match=r"rank 1 of 2 failed: TypeError: the rank's result \(lock\) cannot be "
                                          r"pickled.*cannot pickle '_thread.lock' object") as err:
        run_ranks(_unpicklable_result, 2, start_method="forkserver", timeout_s=60)
    ranks_gone(err.value.pids)


def test_config_rejects_a_seq_len_beyond_memory_up_front(capsys):
    """seq_len 10**8 used to be accepted and the ranks grew for minutes before failing."""
    with pytest.raises(ValueError, match=r"seq_len=100,000,000 needs about [\d.]+ GiB per rank .* available"):
        KCPConfig(seq_len=10**8)
    t0 = time.monotonic()
    assert cli_main(["--seq-len", str(10**8), "--world-size", "2"]) == 2
    assert "error: seq_len=100,000,000 needs about" in capsys.readouterr().err
    assert time.monotonic() - t0 < 5                       # no rank was started
    KCPConfig(seq_len=65536)                               # serve/README.md's example still fits


def test_rank_memory_estimate_scales_and_checks():
    need = rank_bytes(65536, 2, 1, 4, 128, 128, 4, 64, None)
    assert rank_bytes(131072, 2, 1, 4, 128, 128, 4, 64, None) > 1.9 * (need - 300 * 2**20)
    assert rank_bytes(65536, 4, 1, 4, 128, 128, 4, 64, None) < need
    check_rank_memory(need, 2, 65536, available=2 * need)
    with pytest.raises(ValueError, match="needs about"):
        check_rank_memory(need, 2, 65536, available=2 * need - 1)
