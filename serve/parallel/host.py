"""What this host gives the app: cores (CPU affinity, capped by a cgroup CPU quota) and memory (an override,
the cgroup limit, or MemTotal), read from Linux ``/proc`` and cgroup v2 / v1 files when present. The command line
refuses more local ranks than cores with it; page 10 sizes its offer with it (:mod:`lab.kcp`).
"""
from __future__ import annotations

import contextlib
import os
from typing import NamedTuple


class HostLimits(NamedTuple):
    """What this host gives the app: cores (affinity, capped by a cgroup CPU quota) and memory in
    bytes (``KDA_LAB_MEMORY_MIB`` if set, else the cgroup limit, else MemTotal); ``memory_source``
    says which."""

    cores: int
    memory_bytes: int
    memory_source: str


def host_limits() -> HostLimits:
    """Read :class:`HostLimits` from the OS (Linux ``/proc`` and cgroup v2/v1 files when present).

    Raises ValueError if ``KDA_LAB_MEMORY_MIB`` is set but not a positive number."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with contextlib.suppress(OSError, ValueError):
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            cores = max(1, min(cores, -(-int(quota) // int(period))))
    env = os.environ.get("KDA_LAB_MEMORY_MIB")
    if env is not None:
        try:
            mib = float(env)
        except ValueError:
            mib = -1.0
        if not mib > 0:
            raise ValueError(f"KDA_LAB_MEMORY_MIB must be a positive number of MiB, got {env!r}")
        return HostLimits(cores, int(mib * 2 ** 20), "KDA_LAB_MEMORY_MIB")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            limit = int(open(path).read().strip())
            if limit < 2 ** 50:                      # v1 reports "no limit" as a huge number
                return HostLimits(cores, limit, "cgroup limit")
    total_kib = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        total_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    return HostLimits(cores, total_kib * 1024 or 2 ** 40, "MemTotal")
