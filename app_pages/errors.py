"""``engine_call(fn, *args, **kwargs)``: the one way a page calls the lab. Bad input (a ValueError /
RuntimeError: ``serve.errors.UserFacingErrors``) is shown with ``st.error`` and stops the page, never a stack
trace in the UI; the call's freed memory goes back to the OS (the server process is long-lived and shared)."""
from __future__ import annotations

import streamlit as st

from serve.errors import UserFacingErrors
from serve.process_memory import fix_mmap_threshold, limit_malloc_arenas, release_freed_memory

limit_malloc_arenas(2)   # every script run is a new thread of the shared server: few arenas, reused
fix_mmap_threshold()     # large tensors mmapped and unmapped, never left in the heap (serve.process_memory)


def engine_call(fn, *args, **kwargs):
    """Call ``fn``; show the error text with ``st.error`` and stop the page on bad input."""
    try:
        return fn(*args, **kwargs)
    except UserFacingErrors as exc:
        st.error(f"{type(exc).__name__}: {exc}")
        st.stop()
    finally:
        release_freed_memory()   # the call's temporaries back to the OS: the server is long-lived and shared
