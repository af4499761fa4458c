"""kda_core.cpu_kernel, the fused C form of kda_chunk: on each vector path this host runs (AVX-512, AVX2; both
libraries are built here), equal to the torch form and to the recurrent reference to fp32 rounding over every
code path (partial chunks, K / V not multiples of 16, units beyond the chunk-level bound or with g = -inf taken
from their chunk on by the safe form, initial state, other chunk sizes) and bitwise independent of the thread
count; the two paths bitwise equal (each output element is the same operations in the same order, only more
lanes at a time); strided inputs and 16-bit values; bitwise self-consistent (chunk grid, split API ==
kda_chunk, piece sizes); used where it should be and not where it must not (autograd, fp64); a failed build
leaves the torch form running with the reason recorded; importing kda_core builds and loads nothing, and the
first use loads and self-checks the library once, whichever threads ask.

Tolerance FUSED_TOL: the two forms run the same algorithm in fp32 with different summation orders
(register-tiled matmuls vs MKL, a sequential cumsum vs a matmul, a Cephes exp vs Sleef's), so they differ by a
few ulps of the largest intermediate; 2e-5 absolute on unit-norm keys and queries, 1e-4 relative.
"""
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from kda_core import cpu_kernel
from kda_core.chunk import kda_chunk, kda_chunk_outputs, kda_chunk_prepare, kda_chunk_states, kernel_in_use
from kda_core.cpu_build import ISAS, host_isas
from kda_core.kda import kda_recurrent

FUSED_TOL = dict(rtol=1e-4, atol=2e-5)
# Skipped only where the kernel cannot run (not x86-64 with AVX2 and FMA); a build or self-check failure on a
# machine that can run it fails test_kernel_is_built_on_this_machine (and the rest) instead.
CAN_RUN = bool(host_isas())
pytestmark = [pytest.mark.skipif(not CAN_RUN, reason="the fused kernel needs x86-64 with AVX2 and FMA"),
              pytest.mark.skipif(os.environ.get("KDA_CPU_KERNEL") == "0", reason="turned off by KDA_CPU_KERNEL=0")]
# every vector path, each skipped only where this CPU cannot run it (an AVX-512 host runs both)
PATHS = [pytest.param(f"fused-{isa}", id=isa, marks=pytest.mark.skipif(
    isa not in host_isas(), reason=f"this CPU cannot run the {ISAS[isa].label} path")) for isa in ISAS]


def _inputs(B, T, H, K, V, seed=0, rate=0.3, slow=(), forget=()):
    """Unit-norm q, k; mild gates (``rate`` nats per token at most); ``slow``: (b, t0, t1, h) token ranges
    decaying 8 nats a token (their chunks exceed the chunk-level bound); ``forget``: (b, t, h) set to -inf."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * rate
    for b, t0, t1, h in slow:
        g[b, t0:t1, h] = -8.0
    for b, t, h in forget:
        g[b, t, h] = float("-inf")
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta


def _both(*args, **kw):
    with torch.no_grad():
        return kda_chunk(*args, **kw), kda_chunk(*args, **kw, backend="torch")


CASES = [  # B, T, H, K, V, chunk_size, slow, forget
    (1, 256, 4, 128, 128, 64, (), ()),
    (2, 150, 2, 24, 20, 64, (), ()),                       # partial last chunk, K and V not multiples of 16
    (1, 200, 3, 8, 6, 64, ((0, 130, 140, 1),), ()),        # a unit past the bound in chunk 2 of 4
    (2, 96, 2, 32, 32, 16, ((1, 0, 5, 0),), ((0, 40, 1),)),  # slow unit in the first chunk; full forgetting
    (1, 1, 1, 16, 16, 64, (), ()),                         # one token
    (1, 130, 2, 40, 17, 32, (), ((0, 129, 0),)),           # -inf on the last token
    (1, 77, 2, 12, 9, 4, (), ()),                          # C = 4: the solve's scalar path
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("B,T,H,K,V,C,slow,forget", CASES)
def test_fused_equals_torch_form_and_reference(B, T, H, K, V, C, slow, forget, path):
    q, k, v, g, beta = _inputs(B, T, H, K, V, slow=slow, forget=forget)
    s0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(9)) * 0.3
    with torch.no_grad():
        fused, ref = kda_chunk(q, k, v, g, beta, s0, chunk_size=C, backend=path), kda_chunk(
            q, k, v, g, beta, s0, chunk_size=C, backend="torch")
    for a, b in zip(fused, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, **FUSED_TOL)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, s0)
    torch.testing.assert_close(fused.o, o_r, rtol=1e-4, atol=5e-5)
    torch.testing.assert_close(fused.final_state, s_r, rtol=1e-4, atol=5e-5)


def test_empty_call_returns_the_initial_state():
    q, k, v, g, beta = _inputs(1, 0, 2, 16, 8)
    s0 = torch.randn(1, 2, 16, 8)
    fused, ref = _both(q, k, v, g, beta, s0)
    assert fused.o.shape == (1, 0, 2, 8) and torch.equal(fused.final_state, s0)


def test_strided_inputs_and_bf16_values():
    """Permuted views (a [B, H, T, D] buffer read as [B, T, H, D]) and bf16 v: the kernel reads the strides
    (no copy but of a non-contiguous last dim) and the outputs come back in v's dtype."""
    q, k, v, g, beta = (x.transpose(1, 2).contiguous().transpose(1, 2) if x.dim() == 4 else x
                        for x in _inputs(1, 150, 3, 32, 16))
    assert not q.is_contiguous()
    fused, ref = _both(q, k, v.to(torch.bfloat16), g, beta)
    assert fused.o.dtype == torch.bfloat16
    torch.testing.assert_close(fused.o.float(), ref.o.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fused.final_state, ref.final_state, **FUSED_TOL)


@pytest.mark.parametrize("split", [64, 128, 192])
def test_split_on_the_chunk_grid_is_bitwise(split):
    """A call split at a multiple of C, the state carried, is bitwise the whole call, also when the slow
    unit (chunk 2) falls in either half and the second half then starts on the safe path."""
    q, k, v, g, beta = xs = _inputs(1, 300, 2, 32, 24, slow=((0, 140, 150, 1),))
    with torch.no_grad():
        whole = kda_chunk(*xs)
        first = kda_chunk(*(x[:, :split] for x in xs))
        rest = kda_chunk(*(x[:, split:] for x in xs), first.final_state)
    assert torch.equal(torch.cat([first.o, rest.o], 1), whole.o)
    assert torch.equal(rest.final_state, whole.final_state)
    assert torch.equal(torch.cat([first.h, rest.h], 1), whole.h)


@pytest.mark.parametrize("slow", [(), ((0, 70, 80, 1),)])
def test_split_api_is_bitwise_kda_chunk(slow):
    """kda_chunk_prepare / states / outputs (what KCP runs) give kda_chunk's bits, pieces of any size too."""
    xs = _inputs(2, 200, 2, 24, 16, slow=slow)
    s0 = torch.randn(2, 2, 24, 16)
    with torch.no_grad():
        whole = kda_chunk(*xs, s0)
        prep = kda_chunk_prepare(*xs)
        st = kda_chunk_states(prep, s0)
        o = kda_chunk_outputs(prep, st)
        pieces = kda_chunk(*xs, s0, piece_tokens=64)
    assert torch.equal(o, whole.o) and torch.equal(st.final_state, whole.final_state) and torch.equal(st.h, whole.h)
    for a, b in zip(pieces, whole):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", PATHS)
def test_threads_do_not_change_the_bits(path):
    """1, 2 and 3 threads (8 sequences: even and uneven splits), through the one-pass forward and, from the
    chunk of a unit past the bound on, the prepare / scan-and-outputs passes."""
    xs = _inputs(2, 300, 4, 32, 32, slow=((1, 140, 150, 2),))
    before = torch.get_num_threads()
    try:
        with torch.no_grad():
            runs = []
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                runs.append(kda_chunk(*xs, backend=path))
    finally:
        torch.set_num_threads(before)
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b)


@pytest.mark.skipif(len(host_isas()) < 2, reason="this CPU runs one vector path")
@pytest.mark.parametrize("B,T,H,K,V,C,slow,forget", CASES)
def test_the_paths_give_the_same_bits(B, T, H, K, V, C, slow, forget):
    """AVX-512 (8 x 32 tiles, 16 lanes) and AVX2 (6 x 16, 8 lanes) run every output element as the same
    operations in the same order: kda_chunk and the split API agree bitwise."""
    xs = _inputs(B, T, H, K, V, slow=slow, forget=forget)
    s0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(9)) * 0.3
    with torch.no_grad():
        a, b = (kda_chunk(*xs, s0, chunk_size=C, backend=f"fused-{isa}") for isa in ("avx512", "avx2"))
        preps = [kda_chunk_prepare(*xs, chunk_size=C, backend=f"fused-{isa}") for isa in ("avx512", "avx2")]
        states = [kda_chunk_states(p, s0, backend=f"fused-{isa}") for p, isa in zip(preps, ("avx512", "avx2"))]
        outs = [kda_chunk_outputs(p, st, backend=f"fused-{isa}") for p, st, isa in zip(preps, states, ("avx512", "avx2"))]
    for x, y in zip((*a, *preps[0][:6], *states[0], outs[0]), (*b, *preps[1][:6], *states[1], outs[1])):
        assert torch.equal(x, y)


@pytest.mark.parametrize("isa", [p.values[0].removeprefix("fused-") for p in PATHS])
def test_each_path_is_built_for_its_width(isa):
    """The library loaded for a path reports that path's vector width (a build that lost -mavx512f would run the
    AVX2 code under the AVX-512 name), and the default path is the widest this CPU runs."""
    if isa not in host_isas():
        pytest.skip(f"this CPU cannot run the {ISAS[isa].label} path")
    fused = cpu_kernel.load(isa)
    assert fused.lib.kda_vector_bits() == ISAS[isa].vector_bits and fused.name == f"fused C ({ISAS[isa].label})"
    assert cpu_kernel.backend().isa == host_isas()[0] and kernel_in_use() == cpu_kernel.backend().name


def test_autograd_and_fp64_run_the_torch_form(monkeypatch):
    """The fused form has no backward and is fp32 only: under autograd or in fp64 kda_chunk must not call it."""
    calls = []
    real = cpu_kernel.FusedChunk.forward
    monkeypatch.setattr(cpu_kernel.FusedChunk, "forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, g, beta = _inputs(1, 100, 2, 16, 8)
    out = kda_chunk(q.requires_grad_(True), k, v, g, beta)
    assert out.o.grad_fn is not None and not calls
    with torch.no_grad():
        kda_chunk(*(x.double() for x in (q, k, v, g, beta)))
        assert not calls
        kda_chunk(q, k, v, g, beta)
    assert calls == [1]


def test_backend_argument_picks_the_form():
    """"auto" runs the fused form here, "torch" the torch form (two forms, two roundings: the switch really
    switches), "fused" is the auto bits; "fused" on a call it cannot run and an unknown name are ValueErrors."""
    xs = _inputs(1, 128, 2, 16, 16)
    with torch.no_grad():
        auto, torch_form, fused = (kda_chunk(*xs, backend=b) for b in ("auto", "torch", "fused"))
        assert torch.equal(auto.o, fused.o) and not torch.equal(auto.o, torch_form.o)
        with pytest.raises(ValueError, match="backend='fused' runs fp32"):
            kda_chunk(*(x.double() for x in xs), backend="fused")
        with pytest.raises(ValueError, match="backend must be one of"):
            kda_chunk(*xs, backend="cuda")
    with pytest.raises(ValueError, match="with autograd"):
        kda_chunk(xs[0].clone().requires_grad_(True), *xs[1:], backend="fused")


@pytest.mark.skipif("avx2" not in host_isas(), reason="no AVX2 here")
def test_kda_cpu_isa_forces_a_path(monkeypatch):
    """KDA_CPU_ISA=avx2 runs the AVX2 path (the A/B on an AVX-512 host), read once per process; an unknown value
    leaves the torch form with a reason that names the variable."""
    monkeypatch.setattr(cpu_kernel, "_loaded", {})              # as in a fresh process
    monkeypatch.setenv("KDA_CPU_ISA", "avx2")
    assert kernel_in_use() == "fused C (AVX2)" and cpu_kernel.reason() is None
    monkeypatch.setenv("KDA_CPU_ISA", "sse4")
    assert kernel_in_use() == "fused C (AVX2)"                  # chosen once: the variable is not read again
    monkeypatch.setattr(cpu_kernel, "_loaded", {})              # another fresh process
    assert kernel_in_use() == "torch form" and "KDA_CPU_ISA='sse4'" in cpu_kernel.reason()
    x = torch.rand(1, 70, 1, 8)
    with torch.no_grad(), pytest.raises(RuntimeError, match="KDA_CPU_ISA='sse4'"):
        kda_chunk(x, x, x, -x, torch.rand(1, 70, 1), backend="fused")


def test_kernel_is_built_on_this_machine():
    """CI's machine (x86-64, AVX2, gcc) must run the fused form: a build that silently broke would leave
    every page on the slower torch form."""
    assert cpu_kernel.available(), cpu_kernel.reason()


def test_a_failed_build_falls_back_with_the_reason(tmp_path):
    """No compiler: the torch form runs, kda_chunk still works, and reason() says what failed."""
    code = ("import torch; from kda_core import cpu_kernel; from kda_core.chunk import kda_chunk, kernel_in_use;"
            "x = torch.rand(1, 70, 1, 8); o = kda_chunk(x, x, x, -x, torch.rand(1, 70, 1)).o;"
            "print(cpu_kernel.available(), '|', cpu_kernel.reason(), '|', tuple(o.shape), '|', kernel_in_use())")
    env = dict(os.environ, CC="/bin/false", KDA_KERNEL_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    avail, reason, shape, in_use = (s.strip() for s in out.stdout.split("|"))
    assert avail == "False" and "false failed" in reason and shape == "(1, 70, 1, 8)" and in_use == "torch form"


IMPORT_ONLY = """
import importlib, json, os, pkgutil, threading, time
import kda_core
for m in pkgutil.iter_modules(kda_core.__path__):
    importlib.import_module("kda_core." + m.name)
time.sleep(0.5)                                   # a compile started in the background would have begun by now
pid = str(os.getpid())
children = [p for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}/stat")
            and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == pid]
before = dict(threads=[t.name for t in threading.enumerate()], children=children,
              mapped="kda_chunk_cpu" in open("/proc/self/maps").read(),
              cache=os.listdir(os.environ["KDA_KERNEL_CACHE"]), compiled=os.path.exists(os.environ["SPY"]))
from kda_core import cpu_kernel
fused = cpu_kernel.backend()                      # the explicit start-up call: now the compiler runs
print(json.dumps(dict(before=before, after=dict(compiled=os.path.exists(os.environ["SPY"]), fused=fused is not None,
                                                reason=cpu_kernel.reason()))))
"""


def test_importing_kda_core_builds_and_loads_nothing(tmp_path):
    """Importing every kda_core module (what a training process or a KCP rank does) starts no thread, no
    process, calls no compiler and maps no library; the first backend() call does build (a compiler that records
    its calls and fails stands in for cc, so the positive control also shows the spy works)."""
    spy, cache = tmp_path / "cc-called", tmp_path / "cache"
    cc = tmp_path / "cc"
    cc.write_text(f"#!/bin/sh\necho \"$@\" >> {spy}\nexit 1\n")
    cc.chmod(0o755)
    cache.mkdir()
    env = dict(os.environ, CC=str(cc), SPY=str(spy), KDA_KERNEL_CACHE=str(cache), KDA_CPU_KERNEL="1")
    out = subprocess.run([sys.executable, "-c", IMPORT_ONLY], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == dict(threads=["MainThread"], children=[], mapped=False, cache=[], compiled=False)
    assert got["after"]["compiled"] and not got["after"]["fused"] and "cc failed" in got["after"]["reason"]


def test_first_use_loads_and_checks_once_whichever_threads_ask(monkeypatch):
    """Four threads ask for the backend of a process that has not loaded it yet: one builds, loads and
    self-checks it, the others wait and get the same object (the check calls the backend directly, never the
    loader, so a plain lock serves)."""
    monkeypatch.setattr(cpu_kernel, "_loaded", {})              # as in a fresh process
    checks, real = [], cpu_kernel.self_check
    monkeypatch.setattr(cpu_kernel, "self_check", lambda fused: checks.append(1) or real(fused))
    got = []
    threads = [threading.Thread(target=lambda: got.append(cpu_kernel.backend())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(checks) == 1 and len(got) == 4 and got[0] is not None and all(b is got[0] for b in got)
