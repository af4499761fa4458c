"""Memory a long-lived process (the app's server) hands back to the OS, glibc only (no-ops elsewhere).

A Streamlit server runs every script run on a new thread; glibc gives threads their own malloc arenas
(up to 8 per core) and keeps freed blocks mapped in them, so the server's resident memory grows with
every distinct widget setting even when its caches are bounded. ``limit_malloc_arenas`` caps the
arenas (``mallopt(M_ARENA_MAX)``, as the ``MALLOC_ARENA_MAX`` environment variable does at start-up)
and ``release_freed_memory`` returns free heap pages (``malloc_trim(0)``).

``fix_mmap_threshold`` keeps large blocks out of the heap (``mallopt(M_MMAP_THRESHOLD)``, as
``MALLOC_MMAP_THRESHOLD_`` does at start-up). By default glibc raises the threshold to the size of every
mmapped block freed (up to 32 MiB, mallopt(3)), so after one 16 MiB tensor is freed, later tensors up to
that size are carved from the heap, interleaved with long-lived objects, and stay resident after they
are freed. Measured on ``python -m bench.app``'s tour with widget changes: the server's anonymous
memory at the end 404 MiB by default, 265 MiB with the threshold fixed at 128 KiB (glibc's initial value).
It is fixed at 1 MiB: every ``kda_chunk`` temporary is up to ~1 MiB by design (``PIECE_BYTES``), and at 128 KiB
each was mmapped and page-faulted afresh: T = 4,096, H = 4, K = V = 128, one thread, 9 runs each in fresh
processes: 49-53 ms with glibc's default, 100-108 ms at 128 KiB, 55-59 ms at 1 MiB.
"""
from __future__ import annotations

import contextlib
import ctypes

from serve.errors import check_int

M_ARENA_MAX = -8        # glibc malloc.h
M_MMAP_THRESHOLD = -3   # glibc malloc.h
MMAP_THRESHOLD_BYTES = 1024 * 1024  # above kda_chunk's piece temporaries (see the module docstring)


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


def fix_mmap_threshold(num_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every allocation of ``num_bytes`` or more with its own mmap, returned to the OS when freed, and turn
    off glibc's dynamic raise of that threshold; True if applied. Raises ValueError unless ``num_bytes`` is an
    int >= 1."""
    check_int("num_bytes", num_bytes)
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(M_MMAP_THRESHOLD, num_bytes))


def release_freed_memory() -> None:
    """Return freed heap memory to the OS (``malloc_trim(0)``)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
