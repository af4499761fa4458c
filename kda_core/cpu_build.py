"""Building the fused C kernel (``csrc/kda_chunk_cpu.c``) for one vector path, and which paths this CPU runs.

A path is a set of compiler flags the source reacts to (``#if defined(__AVX512F__)``): "avx512" (8 x 32 matmul
tiles on 512-bit zmm registers, 16-lane elementwise passes) and "avx2" (6 x 16 tiles on 256-bit ymm, 8 lanes).
The two give the same bits (see the source's header). A library is built once per machine and path into
``$KDA_KERNEL_CACHE`` (default ``~/.cache/kda-serve-lab``), named by the hash of the source, the flags and the
compiler's version; :mod:`kda_core.cpu_kernel` loads it.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

SOURCE = Path(__file__).parent / "csrc" / "kda_chunk_cpu.c"
COMMON_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fno-math-errno")
ISA_ENV = "KDA_CPU_ISA"       # forces a path ("avx2" on an AVX-512 host: A/B benchmarks)


class Isa(NamedTuple):
    """One vector path: ``name`` (as in ``KDA_CPU_ISA`` and ``backend="fused-<name>"``), ``label`` (for people),
    ``needs`` (the /proc/cpuinfo flags the CPU must report), ``flags`` (the compiler's), ``vector_bits`` (the width
    of its registers; ``kda_vector_bits()`` of a library built for it returns this)."""

    name: str
    label: str
    needs: frozenset
    flags: tuple
    vector_bits: int


ISAS = {   # widest first: the default path is the first one the CPU runs
    "avx512": Isa("avx512", "AVX-512", frozenset({"avx512f", "avx2", "fma"}), ("-mavx512f", "-mavx2", "-mfma"), 512),
    "avx2": Isa("avx2", "AVX2", frozenset({"avx2", "fma"}), ("-mavx2", "-mfma"), 256),
}


@functools.lru_cache(maxsize=1)   # one answer per process
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none); read once per process."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_vector_bits(flags: frozenset[str] | set[str] | None = None) -> int:
    """The widest fp32 vector registers this CPU reports: 512 (avx512f), 256 (avx), 128 (sse2, or any
    aarch64 / NEON), else 0 (unknown)."""
    flags = cpu_flags() if flags is None else flags
    for bits, flag in ((512, "avx512f"), (256, "avx"), (128, "sse2"), (128, "asimd")):
        if flag in flags:
            return bits
    return 128 if platform.machine().lower() in ("aarch64", "arm64") else 0


def host_isas(flags: frozenset[str] | set[str] | None = None) -> list[str]:
    """The paths this machine runs, widest first (none off x86-64)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    flags = cpu_flags() if flags is None else flags
    return [name for name, isa in ISAS.items() if isa.needs <= flags]


def default_isa() -> str:
    """The path the fused backend uses here: ``$KDA_CPU_ISA`` when set, else the widest this CPU runs. Raises
    RuntimeError saying why there is none (not x86-64, no AVX2 / FMA, an unknown or unsupported ``KDA_CPU_ISA``)."""
    runs = host_isas()
    forced = os.environ.get(ISA_ENV)
    if forced:
        if forced not in ISAS:
            raise RuntimeError(f"{ISA_ENV}={forced!r} is not one of {sorted(ISAS)}")
        if forced not in runs:
            raise RuntimeError(f"{ISA_ENV}={forced} but this CPU lacks {' '.join(sorted(ISAS[forced].needs - cpu_flags()))}")
        return forced
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"needs x86-64 (this is {platform.machine()})")
    if not runs:
        raise RuntimeError("needs a CPU with AVX2 and FMA")
    return runs[0]


def build(isa: str, source: Path = SOURCE, extra_flags: tuple = ()) -> Path:
    """Compile ``source`` (default :data:`SOURCE`) for path ``isa``, with ``extra_flags`` after the common and the
    path's flags, into the cache and return the library's path (nothing to do when it is there; atomic rename, so
    concurrent builders are harmless). The cache key covers the source, the ``*.h`` beside it, the flags and the
    compiler's version. Raises RuntimeError when no compiler builds it, KeyError for an unknown
    ``isa``."""
    flags = [*COMMON_FLAGS, *ISAS[isa].flags, *extra_flags]
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))   # what a source may include
    key = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("KDA_KERNEL_CACHE") or Path.home() / ".cache" / "kda-serve-lab")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.gettempdir()) / "kda-serve-lab"
        cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{source.stem}-{isa}-{key}.so"
    if out.exists():
        return out
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        res = subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{Path(cc).name} failed: {res.stderr.strip()[:500]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def open_library(path: Path, isa: str, bits_symbol: str) -> ctypes.CDLL:
    """Load the library at ``path`` built for path ``isa`` (:data:`ISAS`) and check that its ``bits_symbol()`` (an
    ``int`` function returning the vector width it was compiled for) equals the path's. Raises RuntimeError when it
    differs: the library was built without the path's flags."""
    lib = ctypes.CDLL(str(path))
    bits = getattr(lib, bits_symbol)
    bits.restype = ctypes.c_int
    if bits() != ISAS[isa].vector_bits:
        raise RuntimeError(f"{path.name} runs {bits()}-bit vectors, not {ISAS[isa].label}'s "
                           f"{ISAS[isa].vector_bits}: built without its flags")
    return lib
