"""Memory a long-lived process (the app's server) hands back to the OS, glibc only (no-ops elsewhere).

A Streamlit server runs every script run on a new thread; glibc gives threads their own malloc arenas
(up to 8 per core) and keeps freed blocks mapped in them, so the server's resident memory grows with
every distinct widget setting even when its caches are bounded. ``limit_malloc_arenas`` caps the
arenas (``mallopt(M_ARENA_MAX)``, as the ``MALLOC_ARENA_MAX`` environment variable does at start-up)
and ``release_freed_memory`` returns free heap pages (``malloc_trim(0)``).
"""
from __future__ import annotations

import contextlib
import ctypes

from serve.errors import check_int

M_ARENA_MAX = -8   # glibc malloc.h


def _libc():
    with contextlib.suppress(OSError):
        return ctypes.CDLL("libc.so.6")
    return None


def limit_malloc_arenas(num_arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas for threads started from now on; True if applied.

    Raises ValueError if ``num_arenas`` is not a positive int."""
    check_int("num_arenas", num_arenas)
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(M_ARENA_MAX, num_arenas))


def release_freed_memory() -> None:
    """Return freed heap memory to the OS (``malloc_trim(0)``)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
