"""Shared fixtures: where the real traces live (../shared/traces, never copied into the repo)."""
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
