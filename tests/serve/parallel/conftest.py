"""Fixtures for the context-parallel tests: check that no rank process outlives a run."""
import multiprocessing
import os
import time

import pytest


def _alive(pid: int) -> bool:
    """True while /proc/<pid> exists, zombies included (exited but not yet reaped counts as left behind)."""
    return os.path.exists(f"/proc/{pid}")


@pytest.fixture
def ranks_gone():
    """``ranks_gone(pids)`` asserts every rank process has exited (allowing 1 s for reaping) and that
    this process has no live multiprocessing children."""

    def check(pids):
        assert pids and all(isinstance(p, int) and p > 0 for p in pids), pids
        deadline = time.monotonic() + 1.0
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not [p for p in pids if _alive(p)], f"rank processes still alive: {pids}"
        assert multiprocessing.active_children() == []
        assert os.getpid() not in pids

    return check
