"""Shared fixtures: where the real traces live (../shared/traces, never copied into the repo), one torch
thread, and the hypothesis profiles.

Hypothesis profiles (https://hypothesis.readthedocs.io/en/latest/settings.html#settings-profiles):
- ``ci`` (loaded when the environment variable CI is set, as CI sets CI=true): derandomized, so every CI
  run tests the same inputs and a property that held once holds on every run; no example database;
  a failing run prints the blob that reproduces it (``@reproduce_failure``).
- ``dev`` (default): random inputs each run, failures replayed from the local ``.hypothesis`` database.
A test's own ``@settings(max_examples=...)`` wins over the profile's (the engine and decode properties
run a forward per example and keep small budgets); inputs that once found a bug are pinned with
``@example`` and run under every profile. ``pytest --hypothesis-profile=ci`` runs the CI inputs locally.
"""
import multiprocessing
import os
import time
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, max_examples=100, deadline=None, print_blob=True, database=None)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

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


# --- the fast unit run: ``pytest --unit`` ------------------------------------------------------------------
UNIT = ("test_layers.py", "test_docs.py", "test_bench_readme.py", "kda_core", "serve/memory", "serve/prefix",
        "serve/spec_decode", "serve/traces", "serve/test_config.py", "serve/test_errors.py", "serve/test_sampling.py")
"""What ``pytest --unit`` collects, under tests/: the layer and document rules, the maths and serve's data structures (pool,
layout, prefix cache, rollback strategies, trace loaders). No engine run, server, ranks, fleet or real-scale
simulation, lab, page or browser; tests marked ``slow`` are left out too. The full suite runs everything."""


def pytest_addoption(parser):
    parser.addoption("--unit", action="store_true",
                     help="only the unit layers (tests/conftest.py UNIT), without tests marked slow")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """``--unit`` runs in this process: on two cores, starting xdist's workers (each imports torch) costs more than
    splitting a run this short saves."""
    if config.getoption("--unit") and getattr(config.option, "numprocesses", None):
        config.option.numprocesses = 0
        config.option.dist = "no"


def _in_unit(path: Path) -> bool:
    rel = path.resolve().relative_to(REPO / "tests").as_posix()
    return any(rel == u or rel.startswith(u + "/") or u.startswith(rel + "/") for u in UNIT)


def pytest_ignore_collect(collection_path, config):
    """Under ``--unit``, nothing outside :data:`UNIT` is even imported (None: pytest's own rules decide)."""
    tests = REPO / "tests"
    if not config.getoption("--unit") or collection_path.resolve() == tests:
        return None
    if tests not in collection_path.resolve().parents:
        return None
    return True if not _in_unit(collection_path) else None


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--unit"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
