"""Shared fixtures: where the real traces live (../shared/traces, never copied into the repo)."""
import multiprocessing
import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not TRACES.is_dir():
        pytest.fail(f"real traces not found at {TRACES} (expected ../shared/traces beside the repo)")
    return TRACES


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """One torch thread for the whole suite: the 2 cores are shared with the Streamlit server of the
    browser test, and oversubscribed OpenMP threads made small forwards 20-50x slower here."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


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
