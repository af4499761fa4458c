"""torch thread control for measured runs.

The machine has 2 cores, often shared (Streamlit sessions, other processes). For the small matrices
of the demo model, oversubscribed OpenMP threads made a forward 20-50x slower here (measured on
the speculative-decoding and prefix-cache runs), so measured runs use one torch thread.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch single-threaded inside the block; the previous thread count is restored after."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
