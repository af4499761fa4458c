"""The fused C kernel's edges (``kda_core/csrc/kda_chunk_cpu.c`` through :mod:`kda_core.cpu_kernel`), pinned
by the units it flags and the form that runs, not only by outputs:

- a unit that passes the chunk-level decay bound, or reaches ``g = -inf``, in ONE key dim only (the first, a
  middle one in the vectorised part, the last one in the scalar tail) is flagged (the C pass leaves it to the
  safe form, and the one-pass forward stops at its chunk), and the result equals the torch form and the
  recurrent reference; no other unit is flagged; on each vector path this host runs;
- a library whose self-check fails is refused: ``available()`` is False, ``reason()`` says why, the fused
  backend is never called (not by ``kda_chunk`` nor by the split API), and ``kda_chunk`` returns the torch form's
  bits (run in a subprocess: the library is loaded and checked once per process).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kda_core import cpu_kernel
from kda_core.chunk import kda_chunk
from kda_core.cpu_build import ISAS, host_isas
from kda_core.kda import kda_recurrent
from kda_core.wy import MAX_CHUNK_DECAY

FUSED_TOL = dict(rtol=1e-4, atol=2e-5)      # as tests/kda_core/test_cpu_kernel.py: fp32, other summation orders
REF_TOL = dict(rtol=1e-4, atol=5e-5)
CAN_RUN = bool(host_isas())
pytestmark = [pytest.mark.skipif(not CAN_RUN, reason="the fused kernel needs x86-64 with AVX2 and FMA"),
              pytest.mark.skipif(os.environ.get("KDA_CPU_KERNEL") == "0", reason="turned off by KDA_CPU_KERNEL=0")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

B, T, H, K, V, C = 1, 200, 2, 20, 12, 64     # K = 20: dims 0-15 in the 8-wide exp, 16-19 in the scalar tail
SLOW_CHUNK, SLOW_HEAD = 2, 1                  # the edge unit: chunk 2 (tokens 128-191), head 1


def inputs(dim: int, kind: str):
    """Unit-norm q, k, mild gates (at most 0.3 nats a token: 19 per chunk); in key dim ``dim`` of the edge unit
    only, ``kind`` "bound": 20 tokens decaying 8 nats (160 > the 60-nat bound; exp(160) overflows fp32), or "-inf":
    one token forgets."""
    gen = torch.Generator().manual_seed(dim)
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * 0.3
    t0 = SLOW_CHUNK * C
    if kind == "bound":
        g[0, t0 + 2: t0 + 22, SLOW_HEAD, dim] = -8.0
    else:
        g[0, t0 + 30, SLOW_HEAD, dim] = float("-inf")
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta


EDGES = [pytest.param(d, kind, id=f"{kind}-dim{d}") for kind in ("bound", "-inf") for d in (0, K // 2, K - 1)]
PATHS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in host_isas(), reason=f"no {ISAS[isa].label} here"))
         for isa in ISAS]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dim,kind", EDGES)
def test_one_key_dim_past_the_bound_is_flagged_and_equals_the_torch_form(dim, kind, isa):
    q, k, v, g, beta = xs = inputs(dim, kind)
    decay = g[0, SLOW_CHUNK * C: (SLOW_CHUNK + 1) * C, SLOW_HEAD].sum(0)          # [K] nats of the edge unit
    assert (decay < -MAX_CHUNK_DECAY).nonzero().flatten().tolist() == [dim]       # one key dim past the bound
    s0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(7)) * 0.3
    n = (T + C - 1) // C
    kernel = cpu_kernel.load(isa)
    with torch.no_grad():
        wy = tuple(torch.empty(n * B * H, *shape) for shape in ((C, K), (C, C), (C, K), (C, V), (C, K), (K,)))
        slow = kernel.c_prepare(*xs, C, MAX_CHUNK_DECAY, wy)                   # [NT * B * H], chunk-major
        h, o = torch.zeros(n + 1, B, H, K, V), torch.empty(B, T, H, V)
        stop = kernel.c_forward(*xs, C, MAX_CHUNK_DECAY, K ** -0.5, h, o)
        fused = kda_chunk(*xs, s0, backend=f"fused-{isa}")
        ref = kda_chunk(*xs, s0, backend="torch")
    flagged = slow.nonzero().flatten().tolist()
    assert flagged == [(SLOW_CHUNK * B + 0) * H + SLOW_HEAD], f"flagged units {flagged}"
    assert stop == SLOW_CHUNK, f"the one-pass forward went on past chunk {SLOW_CHUNK} (stopped at {stop})"
    assert torch.isfinite(fused.o).all() and torch.isfinite(fused.final_state).all()
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, **FUSED_TOL)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, s0)
    torch.testing.assert_close(fused.o, o_r, **REF_TOL)
    torch.testing.assert_close(fused.final_state, s_r, **REF_TOL)


SELF_CHECK_FAILS = """
import json, torch
from kda_core import cpu_kernel
import kda_core.chunk as chunk

x = torch.rand(1, 150, 2, 24)
args = (x, x.flip(1), torch.rand(1, 150, 2, 8), -x * 0.5, torch.rand(1, 150, 2))

def failing_check(fused):
    with torch.no_grad():
        fused.forward(*args, torch.zeros(4, 1, 2, 24, 8), 0.2, 64, 128, False)   # runs the kernel, then finds it wrong
    raise RuntimeError("injected: the fused form disagrees")

cpu_kernel.self_check = failing_check
calls = []
for name in ("forward", "prepare", "states", "outputs", "c_forward", "c_prepare", "c_scan_outputs"):
    real = getattr(cpu_kernel.FusedChunk, name)
    setattr(cpu_kernel.FusedChunk, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
with torch.no_grad():
    available = cpu_kernel.available()
    calls.clear()                          # what the failing check itself ran does not count
    out = chunk.kda_chunk(*args)
    prep = chunk.kda_chunk_prepare(*args)
    chunk.kda_chunk_outputs(prep, chunk.kda_chunk_states(prep))
    ref = chunk.kda_chunk(*args, backend="torch")
print(json.dumps(dict(available=available, reason=cpu_kernel.reason(), in_use=chunk.kernel_in_use(), calls=calls,
                      same=bool(torch.equal(out.o, ref.o) and torch.equal(out.final_state, ref.final_state)))))
"""


def test_a_library_whose_self_check_fails_is_refused_and_the_torch_form_runs(tmp_path):
    env = dict(os.environ, KDA_CPU_KERNEL="1")
    out = subprocess.run([sys.executable, "-c", SELF_CHECK_FAILS], capture_output=True, text=True, env=env,
                         timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["available"] is False and got["in_use"] == "torch form"
    assert "injected: the fused form disagrees" in got["reason"]
    assert got["calls"] == [], f"the refused library still ran: {got['calls']}"
    assert got["same"], "kda_chunk did not return the torch form's bits"
