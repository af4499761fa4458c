"""The fused CPU form of :func:`kda_core.chunk.kda_chunk` (fp32, no autograd): ``csrc/kda_chunk_cpu.c``,
built with the system's C compiler on first use and loaded with :mod:`ctypes`.

The torch form runs each step of the chunk algorithm as a separate op over every unit (chunk, batch row,
head), so most of its time goes to elementwise passes and layout copies between matmuls. The C form
computes a unit's WY / UT quantities in one pass over data that stays in cache (cumsum, both exps, the
scaled keys and queries, the two in-chunk products, the triangular solve, ``w`` and ``u``), and the scan
writes each chunk's outputs straight into ``o``; its matmuls are a 6 x 16 register-blocked AVX2/FMA kernel
that skips the zero blocks of triangular factors. Same algorithm and unit layout as :mod:`kda_core.wy`:
units that decay by more than ``MAX_CHUNK_DECAY`` nats (or hold ``g = -inf``) are flagged by the C pass
and computed by :func:`kda_core.wy.wy_safe`.

The two forms agree to fp32 rounding, not bitwise (different summation orders and exp); each is bitwise
self-consistent (a unit's result never depends on where it sits in a call), so every chunk-grid fact holds
for either. Autograd (training) and fp64 always run the torch form.

Used when: the machine is x86-64 with AVX2 and FMA, a C compiler (``$CC`` or ``cc``) builds the source,
a self-check against the torch form passes on load, and ``KDA_CPU_KERNEL`` is not ``0``. Otherwise
:func:`available` is False and :func:`reason` says why; :func:`disabled` turns it off for a block (A/B
benchmarks, tests of the torch form). The built library is cached in ``$KDA_KERNEL_CACHE`` (default
``~/.cache/kda-serve-lab``), named by the hash of the source, flags and compiler.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "kda_chunk_cpu.c"
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-fno-math-errno"]

_lock = threading.RLock()
_state: dict = {"lib": None, "reason": None, "done": False, "checking": False, "build": None, "check": None}
_off = threading.local()

_P = ctypes.c_void_p
_I = ctypes.c_int
_F = ctypes.c_float


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build() -> Path:
    """Compile :data:`SOURCE` into the cache (atomic rename; concurrent builders are harmless)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (cc / gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("KDA_KERNEL_CACHE") or Path.home() / ".cache" / "kda-serve-lab")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.gettempdir()) / "kda-serve-lab"
        cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"kda_chunk_cpu-{key}.so"
    if out.exists():
        return out
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        res = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"{Path(cc).name} failed: {res.stderr.strip()[:500]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load():
    if os.environ.get("KDA_CPU_KERNEL", "1") == "0":
        raise RuntimeError("turned off by KDA_CPU_KERNEL=0")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"needs x86-64 (this is {platform.machine()})")
    flags = cpu_flags()
    if not {"avx2", "fma"} <= flags:
        raise RuntimeError("needs a CPU with AVX2 and FMA")
    if _state["build"] is not None:               # prebuild() under way: wait for it rather than compile twice
        _state["build"].join(timeout=180)
    lib = ctypes.CDLL(str(_build()))
    lib.kda_prepare.restype = _I
    lib.kda_prepare.argtypes = [_I] * 6 + [_F] + [_P] * 6 + [_P] * 7 + [_I]
    lib.kda_forward.restype = _I
    lib.kda_forward.argtypes = [_I] * 6 + [_F, _F] + [_P] * 6 + [_P] * 3 + [_I]
    lib.kda_scan_outputs.restype = None
    lib.kda_scan_outputs.argtypes = [_I] * 7 + [_F] + [_P] * 6 + [_P] * 4 + [_I, _I, _I]
    return lib


def register_self_check(fn) -> None:
    """Set the check :func:`library` runs once after loading (``fn()`` raises when the kernel disagrees with
    the torch form); :mod:`kda_core.chunk` registers :func:`kda_core.chunk.kernel_self_check` on import."""
    _state["check"] = fn


def library():
    """The loaded library, or None (see :func:`reason`). Built and self-checked once per process; other
    threads wait until the check is done (the checking thread itself gets the library to check)."""
    if getattr(_off, "depth", 0):
        return None
    if _state["check"] is None:                    # never load unchecked: kda_core.chunk registers the check
        return None
    if not _state["done"]:
        with _lock:                                # re-entrant: the self-check calls back in here
            if _state["checking"]:
                return _state["lib"]
            if not _state["done"]:
                try:
                    _state["lib"] = _load()
                    if _state["check"] is not None:
                        _state["checking"] = True
                        _state["check"]()
                except Exception as exc:          # any failure: the torch form runs, and reason() says why
                    _state["lib"], _state["reason"] = None, str(exc) or type(exc).__name__
                finally:
                    _state["checking"], _state["done"] = False, True
    return _state["lib"]


def prebuild() -> threading.Thread | None:
    """Start compiling the library in a background thread (a subprocess; ~3 s once per machine) so the
    first :func:`kda_core.chunk.kda_chunk` call does not wait for it; None when there is nothing to do."""
    if _state["done"] or os.environ.get("KDA_CPU_KERNEL", "1") == "0":
        return None

    def run():
        try:
            _build()
        except Exception:                        # library() tries again and records the reason
            pass

    t = threading.Thread(target=run, name="kda-kernel-build", daemon=True)
    _state["build"] = t
    t.start()
    return t


def available() -> bool:
    """Whether :func:`kda_core.chunk.kda_chunk` runs the fused C form here (fp32, CPU, no autograd)."""
    return library() is not None


def reason() -> str | None:
    """Why the fused form is not used (None when it is)."""
    library()
    if getattr(_off, "depth", 0):
        return "turned off for this block (disabled())"
    if _state["check"] is None:
        return "kda_core.chunk (which registers the self-check) is not imported yet"
    return _state["reason"]


@contextlib.contextmanager
def disabled():
    """Run the torch form inside this block (this thread only)."""
    _off.depth = getattr(_off, "depth", 0) + 1
    try:
        yield
    finally:
        _off.depth -= 1


def prepare(q, k, v, g, beta, C: int, max_decay: float, out: tuple) -> torch.Tensor:
    """Fill ``out`` = (qg ``[n, C, K]``, Aqk ``[n, C, C]``, w ``[n, C, K]``, u ``[n, C, V]``, kd ``[n, C, K]``,
    decay_last ``[n, K]``; n = NT B H, chunk-major, contiguous fp32) from fp32 q, k, g ``[B, T, H, K]``,
    v ``[B, T, H, V]``, beta ``[B, T, H]`` (last dim contiguous). Returns the bool ``[n]`` mask of units
    left to the safe form (their rows of ``out`` are not written)."""
    lib = library()
    B, T, H, K = q.shape
    V = v.shape[-1]
    n = out[0].shape[0]
    slow = torch.zeros(n, dtype=torch.uint8)
    strides = (ctypes.c_long * 15)(*[s for t in (q, k, v, g, beta) for s in t.stride()[:3]])
    nslow = lib.kda_prepare(B, T, H, K, V, C, float(max_decay), *(t.data_ptr() for t in (q, k, v, g, beta)),
                            strides, *(t.data_ptr() for t in out), slow.data_ptr(), torch.get_num_threads())
    if nslow < 0:
        raise MemoryError("kda_chunk: the fused kernel could not allocate its scratch")
    return slow.bool()


def scan_outputs(NT: int, B: int, H: int, K: int, V: int, C: int, T: int, scale: float, wy: tuple,
                 h: torch.Tensor, v_new: torch.Tensor, o: torch.Tensor | None, scan: bool) -> None:
    """The scan (``scan``: v_new and h[1:] written from h[0]) and / or the outputs (``o`` not None: its
    first T tokens written, o ``[B, T, H, V]`` fp32 with contiguous last dim) of NT chunks; wy: the six
    chunk-major unit tensors of :func:`prepare`, h ``[NT + 1 (scan) or NT, B, H, K, V]`` and v_new
    ``[NT, B*H, C, V]`` contiguous fp32."""
    lib = library()
    so = (ctypes.c_long * 3)(*(o.stride()[:3] if o is not None else (0, 0, 0)))
    lib.kda_scan_outputs(NT, B, H, K, V, C, T, float(scale), *(t.data_ptr() for t in wy), h.data_ptr(),
                         v_new.data_ptr(), o.data_ptr() if o is not None else None, so, int(scan), int(o is not None),
                         torch.get_num_threads())


def forward(q, k, v, g, beta, C: int, max_decay: float, scale: float, h: torch.Tensor, o: torch.Tensor) -> int:
    """The whole forward in one C pass, chunk by chunk (each unit's WY quantities, scan step and outputs
    while its data is in cache): inputs as :func:`prepare`, h ``[NT + 1, B, H, K, V]`` contiguous fp32 with
    ``h[0]`` the initial state, o ``[B, T, H, V]`` fp32 (contiguous last dim). Returns the index of the first
    chunk it did not finish (NT when done): a chunk with a unit beyond the chunk-level bound, which the
    caller runs from there on through :func:`prepare`, the safe form and :func:`scan_outputs`."""
    lib = library()
    B, T, H, K = q.shape
    strides = (ctypes.c_long * 15)(*[s for t in (q, k, v, g, beta) for s in t.stride()[:3]])
    so = (ctypes.c_long * 3)(*o.stride()[:3])
    j = lib.kda_forward(B, T, H, K, v.shape[-1], C, float(max_decay), float(scale),
                        *(t.data_ptr() for t in (q, k, v, g, beta)), strides, h.data_ptr(), o.data_ptr(), so, torch.get_num_threads())
    if j < 0:
        raise MemoryError("kda_chunk: the fused kernel could not allocate its scratch")
    return j
