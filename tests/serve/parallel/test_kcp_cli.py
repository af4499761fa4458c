"""``python -m serve.parallel`` as a user runs it (subprocesses): every failure is one line naming the
problem and a non-zero exit code, never a Python traceback, hang or OverflowError in the ranks.

Bounded: each run has a short ``--timeout-s`` and a subprocess timeout; no test starts more than 2
ranks (the core cap is tested on a process pinned to one core, so it never depends on this machine's
core count and never starts the ranks it refuses).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from serve.parallel.launch import free_port
from tests.conftest import REPO

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run_cli(args: list[str], env: dict | None = None, one_core: bool = False, timeout: float = 60):
    """Run the command line in a fresh interpreter; returns (exit code, stdout, stderr, seconds)."""
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    base.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **(env or {}))
    pin = (lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})) if one_core else None
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "serve.parallel", "--seq-len", "64", *args], cwd=REPO, env=base,
                       capture_output=True, text=True, timeout=timeout, preexec_fn=pin)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def assert_one_line_error(stderr: str, match: str):
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    assert lines[0].startswith("python -m serve.parallel: error: ") and match in lines[0], lines[0]


@pytest.mark.parametrize("args, code, match", [
    pytest.param(["--timeout-s", "0.001"], 1, "did not finish within 0.001 s", id="rank-timeout"),
    pytest.param(["--timeout-s", "inf"], 2, "timeout_s must be at most 604800 s", id="timeout-inf"),
    pytest.param(["--timeout-s", "nan"], 2, "timeout_s must be > 0, got nan", id="timeout-nan"),
])
def test_local_run_errors_are_one_line(args, code, match):
    rc, out, err, _ = run_cli(args)
    assert rc == code and out == ""
    assert_one_line_error(err, match)


def test_more_local_ranks_than_cores_is_refused_before_any_rank_starts():
    """On one core, 3 ranks used to start (and --world-size 64 on 2 cores timed out with a traceback)."""
    rc, out, err, _ = run_cli(["--world-size", "3", "--timeout-s", "30"], one_core=True)
    assert rc == 2 and out == ""
    assert_one_line_error(err, "--world-size 3 x --threads-per-rank 1 needs 3 cores but this machine gives "
                               "this process 1; use --world-size <= 1 or add --oversubscribe")


def test_oversubscribe_runs_anyway():
    rc, out, err, _ = run_cli(["--world-size", "2", "--oversubscribe", "--timeout-s", "60"], one_core=True)
    assert rc == 0 and err == "" and "wall (slowest rank)" in out


@pytest.mark.parametrize("env, match", [
    pytest.param(dict(RANK="0", WORLD_SIZE="abc", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"),
                 "environment variable WORLD_SIZE must be an int in [1, ", id="world-size-abc"),
    pytest.param(dict(RANK="0", WORLD_SIZE="1"), "environment variables ['MASTER_ADDR', 'MASTER_PORT'] are not set",
                 id="no-master-addr"),
    pytest.param(dict(RANK="2", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"),
                 "environment variable RANK must be an int in [0, 1], got '2'", id="rank-beyond-world"),
    pytest.param(dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="70000"),
                 "environment variable MASTER_PORT must be an int in [1, 65535], got '70000'", id="bad-port"),
    pytest.param(dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", LOCAL_WORLD_SIZE="x"),
                 "environment variable LOCAL_WORLD_SIZE must be an int in [1, 1] (the world size), got 'x'",
                 id="local-world-size-x"),
])
def test_torchrun_environment_errors_are_one_line(env, match):
    rc, out, err, secs = run_cli(["--timeout-s", "5"], env=env)
    assert rc == 2 and out == ""
    assert_one_line_error(err, match)


def test_a_torchrun_peer_that_never_comes_is_one_line():
    """Rank 0 of 2 waits for rank 1 until --timeout-s, then says so (it used to end in a DistStoreError
    traceback)."""
    env = dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rc, out, err, secs = run_cli(["--timeout-s", "1"], env=env)
    assert rc == 1 and out == ""
    assert_one_line_error(err, "rank 0 of 2 could not join the process group at 127.0.0.1:")
    assert secs < 30


def test_a_one_rank_torchrun_job_runs():
    env = dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rc, out, err, _ = run_cli(["--timeout-s", "60", "--check"], env=env)
    assert rc == 0 and "wall (slowest rank)" in out, err


def test_a_failed_rank_is_one_line_naming_it(monkeypatch, capsys):
    """In process (no rank starts): a RankFailure's first line, with where to find the rank's traceback."""
    import serve.parallel.cli as cli
    from serve.parallel.launch import RankFailure

    def failing(cfg):
        raise RankFailure("rank 1 of 2 failed: OverflowError: boom\nTraceback (most recent call last):\n  ...", [1, 2])

    monkeypatch.setattr(cli, "run_kcp", failing)
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["--seq-len", "64", "--world-size", "1"]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert_one_line_error(out.err, "rank 1 of 2 failed: OverflowError: boom (--traceback prints the rank's traceback)")
    assert cli.main(["--seq-len", "64", "--world-size", "1", "--traceback"]) == 1
    assert "Traceback" in capsys.readouterr().err
