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
