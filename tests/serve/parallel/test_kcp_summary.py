"""serve.parallel.summary: the chunked (M, S_ext) against the per-token product of affine maps."""
import pytest
import torch

from kda_core.chunk import kda_chunk
from kda_core.kda import kda_recurrent
from serve.parallel.inputs import initial_state, kda_inputs
from serve.parallel.summary import apply_summary, chunk_summary, compose, fold_state, naive_summary

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def _inputs(T, B=2, H=3, K=16, V=12, dtype="float64", seed=0, start=0):
    """Seeded inputs with mild gates (decay and beta scaled down) so M stays far from 0 over 200 tokens."""
    x = kda_inputs(B, H, K, V, start, start + T, seed, dtype)
    return x._replace(g=0.02 * x.g, beta=0.2 * x.beta)


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("T", [1, 63, 64, 65, 150, 200], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_chunk_summary_matches_naive(T, dtype):
    x = _inputs(T, dtype=dtype)
    fast, ref = chunk_summary(x.k, x.v, x.g, x.beta), naive_summary(x.k, x.v, x.g, x.beta)
    tol = TOL[getattr(torch, dtype)]
    assert fast.M.shape == (2, 3, 16, 16) and fast.S_ext.shape == (2, 3, 16, 12)
    assert fast.M.dtype == getattr(torch, dtype)
    assert _err(fast.M, ref.M) <= tol and _err(fast.S_ext, ref.S_ext) <= tol
    # the test has teeth: M is far from both 0 and I over these lengths
    assert ref.M.abs().max() > 0.3 and _err(ref.M, torch.eye(16)) > 1e-3


def test_naive_summary_is_the_recurrence():
    """M S0 + S_ext equals running kda_recurrent from S0 (the affine-map convention, key-first)."""
    x = _inputs(100)
    s0 = initial_state(2, 3, 16, 12, dtype="float64")
    _, final = kda_recurrent(x.q, x.k, x.v, x.g, x.beta, s0)
    assert _err(apply_summary(naive_summary(x.k, x.v, x.g, x.beta), s0), final) <= 1e-12


def test_transposed_convention_fails():
    """Acting on the V dim instead of K gives a different state (K != V makes it not even fit)."""
    x = _inputs(40, K=12, V=12)
    s0 = initial_state(2, 3, 12, 12, dtype="float64")
    summ = naive_summary(x.k, x.v, x.g, x.beta)
    _, final = kda_recurrent(x.q, x.k, x.v, x.g, x.beta, s0)
    wrong = s0 @ summ.M.transpose(-1, -2) + summ.S_ext
    assert _err(wrong, final) > 1e-3


@pytest.mark.parametrize("split", [1, 64, 70, 128])
def test_compose_is_concatenation(split):
    a, b = _inputs(split, seed=1), _inputs(200 - split, seed=1, start=split)
    whole = _inputs(200, seed=1)
    left = chunk_summary(a.k, a.v, a.g, a.beta)
    right = chunk_summary(b.k, b.v, b.g, b.beta)
    full = chunk_summary(whole.k, whole.v, whole.g, whole.beta)
    both = compose(left, right)
    assert _err(both.M, full.M) <= 1e-10 and _err(both.S_ext, full.S_ext) <= 1e-10


def test_fold_state_gives_every_block_its_initial_state():
    T, cuts = 300, [0, 70, 128, 250, 300]
    x = _inputs(T, seed=2)
    s0 = initial_state(2, 3, 16, 12, seed=2, dtype="float64")
    ref = kda_chunk(x.q, x.k, x.v, x.g, x.beta, s0, chunk_size=1)          # h[:, t] = state before token t
    blocks = [chunk_summary(*(t[:, s:e] for t in (x.k, x.v, x.g, x.beta))) for s, e in zip(cuts, cuts[1:])]
    for r in range(1, len(blocks) + 1):
        want = ref.final_state if r == len(blocks) else ref.h[:, cuts[r]]
        assert _err(fold_state(blocks[:r], s0), want) <= 1e-10


def test_bad_arguments():
    x = _inputs(10)
    with pytest.raises(ValueError, match="v must have shape"):
        chunk_summary(x.k, x.v[..., :1, :], x.g, x.beta)
    with pytest.raises(ValueError, match="beta must have shape"):
        naive_summary(x.k, x.v, x.g, x.beta[..., :2])
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_summary(x.k, x.v, x.g, x.beta, chunk_size=48)
    with pytest.raises(ValueError, match="at least one"):
        fold_state([])
    summ = chunk_summary(x.k, x.v, x.g, x.beta)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        fold_state([summ], torch.zeros(2, 3, 12, 16, dtype=torch.float64))
