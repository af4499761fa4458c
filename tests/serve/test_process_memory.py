"""serve/process_memory.py: the server's malloc arenas are capped and freed memory goes back to the OS."""
import platform
from pathlib import Path

import pytest

from serve.process_memory import limit_malloc_arenas, release_freed_memory


def _rss_kib() -> int:
    return next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmRSS:"))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_release_freed_memory_returns_heap():
    blocks = [bytearray(64 * 1024) for _ in range(2000)]     # ~125 MiB of 64 KiB blocks from the heap
    keep = blocks[-1]                                         # pins the heap top: free() alone cannot shrink it
    del blocks
    before = _rss_kib()
    release_freed_memory()
    assert before - _rss_kib() >= 64 * 1024, "malloc_trim returned less than 64 MiB of ~125 MiB freed"
    assert len(keep) == 64 * 1024


def test_limit_malloc_arenas():
    if platform.libc_ver()[0] == "glibc":
        assert limit_malloc_arenas(2) is True
    with pytest.raises(ValueError, match="num_arenas must be an int >= 1"):
        limit_malloc_arenas(0)
