"""kda_core.invariant: row i of the result does not depend on how many rows are computed, and the values
are those of the plain ops (``x @ W^T``, ``fn(x)``). ``linear`` is checked in each of its forms: the one this
process chose, the torch (padded MKL) form, and the C GEMM of every vector path this CPU runs."""
import pytest
import torch
import torch.nn.functional as F

from kda_core import cpu_build, cpu_invariant
from kda_core.invariant import linear, pointwise, rmsnorm, torch_linear, torch_rmsnorm


def _c_form(isa):
    def run(x, w):
        rows = x.reshape(-1, x.shape[-1])
        return _loaded(isa).linear(rows, w).reshape(*x.shape[:-1], w.shape[0])
    return run


_GEMMS: dict = {}


def _loaded(isa):
    if isa not in _GEMMS:
        try:
            _GEMMS[isa] = cpu_invariant.load(isa, check=False)
        except RuntimeError as exc:          # not built (no compiler): the C forms are skipped, the torch form runs
            pytest.skip(f"the C GEMM cannot run here: {exc}")
    return _GEMMS[isa]


def _torch_form(x, w):
    return torch_linear(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])


LINEAR_FORMS = [pytest.param(linear, id="chosen"), pytest.param(_torch_form, id="torch")] + [
    pytest.param(_c_form(isa), id=f"c-{isa}") for isa in cpu_build.host_isas()]


@pytest.mark.parametrize("form", LINEAR_FORMS)
@pytest.mark.parametrize("d_in,d_out", [(128, 128), (128, 384), (32, 4), (2304, 64), (37, 75)])
def test_linear_row_invariant(form, d_in, d_out):
    """Every row count, every form: below and above the 16 rows of MKL's kernel switch, and every C tile height
    (1-6 rows) and N tail (75 = 4 panels + 11 columns)."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(d_out, d_in, generator=gen), torch.randn(600, d_in, generator=gen)
    full = form(x, w)
    for m in [1, 2, 3, 4, 5, 6, 7, 9, 13, 15, 16, 17, 63, 64, 65, 128, 511, 600]:
        assert torch.equal(form(x[:m], w), full[:m]), m
        assert torch.equal(form(x[m - 1: m], w), full[m - 1: m]), m      # the row alone, at offset m - 1


def test_torch_linear_row_invariant_with_one_output_feature():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(1, 32, generator=gen), torch.randn(200, 32, generator=gen)
    full = _torch_form(x, w)
    assert [m for m in range(17, 200) if not torch.equal(_torch_form(x[:m], w), full[:m])] == []


def test_torch_linear_rows_at_any_offset():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 50, generator=gen), torch.randn(133, 50, generator=gen)
    full = _torch_form(x, w)
    assert [s for s in range(100) if not torch.equal(_torch_form(x[s: s + 20].clone(), w), full[s: s + 20])] == []


@pytest.mark.parametrize("fn", [torch.exp, torch.sigmoid, F.softplus, F.silu, torch.rsqrt, torch.cos])
def test_pointwise_row_invariant(fn):
    x = torch.rand(40, 48) + 0.1
    full = pointwise(fn, x)
    for m in [1, 3, 7, 40]:
        assert torch.equal(pointwise(fn, x[:m]), full[:m])
    assert torch.allclose(full, fn(x), rtol=1e-6, atol=1e-7)


# fp32 GEMM rounding: a different kernel (or summation order) changes each output by ~sqrt(D_in) ulps of
# sum_i |x_i w_i|; 1e-5 of that sum is >10x above it for D_in <= 2304 and far below any wrong value.
GEMM_RTOL = 1e-5


@pytest.mark.parametrize("form", LINEAR_FORMS)
@pytest.mark.parametrize("shape,d_out", [
    pytest.param((1, 128), 384, id="M1-K128-N384"),
    pytest.param((5, 32), 4, id="M5-K32-N4"),
    pytest.param((16, 100), 24, id="M16-K100-N24"),
    pytest.param((2, 9, 72), 40, id="B2-T9-K72-N40"),
    pytest.param((3, 200, 64), 96, id="B3-T200-K64-N96"),
    pytest.param((7, 2304), 64, id="M7-K2304-N64"),
])
def test_linear_values(form, shape, d_out):
    """Values equal ``x @ W^T`` (fp32 and fp64 references) for row counts below and above MIN_ROWS and
    leading dims [B, T]; not only the same value for every row count."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(*shape, generator=gen), torch.randn(d_out, shape[-1], generator=gen)
    out = form(x, w)
    assert out.shape == (*shape[:-1], d_out) and out.dtype == torch.float32
    scale = (x.abs().double() @ w.abs().double().T).float()               # sum_i |x_i w_i| per output
    for ref in (x @ w.T, (x.double() @ w.double().T).float()):
        assert ((out - ref).abs() <= GEMM_RTOL * scale).all()


@pytest.mark.parametrize("fn", [torch.exp, torch.sigmoid, F.softplus, F.silu, torch.rsqrt, torch.cos])
@pytest.mark.parametrize("shape", [
    pytest.param((1, 5), id="R1-n5"),
    pytest.param((33, 32), id="R33-n32"),
    pytest.param((3, 200, 70), id="B3-T200-n70-4blocks"),
    pytest.param((2, 0, 7), id="empty"),
])
def test_pointwise_values(fn, shape):
    """Values equal the plain ``fn(x)`` on awkward sizes: a last dim that is not a multiple of VEC_ROW,
    several row blocks (B3-T200: 600 rows of 96 padded elements, 170 rows per block), no rows. Also on
    a non-contiguous view. Tolerance: ATen's SIMD and scalar (libm) paths differ by a few ulps."""
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(*shape, generator=gen) * 4 + 0.1                        # rsqrt needs x > 0
    for inp in (x, x.transpose(-1, -2).contiguous().transpose(-1, -2)):
        out = pointwise(fn, inp)
        assert out.shape == inp.shape
        torch.testing.assert_close(out, fn(inp), rtol=1e-6, atol=1e-7)


def test_linear_shape_error():
    with pytest.raises(ValueError, match="D_in"):
        linear(torch.zeros(2, 3), torch.zeros(4, 5))


def test_pointwise_grad():
    """Training backpropagates through ``pointwise``: over several row blocks its gradient equals the plain
    ``fn``'s (B3-T200-n70: 4 blocks), and the backward costs one cat, not a whole-input zero tensor per
    block (a loop of slices did that: 35 % of a training step of the demo model)."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.rand(3, 200, 70, generator=gen) * 4 + 0.1).requires_grad_(True)
    w = torch.randn(3, 200, 70, generator=gen)
    for fn in (F.silu, torch.sigmoid, torch.rsqrt):
        (g_ours,) = torch.autograd.grad((pointwise(fn, x) * w).sum(), x)
        (g_ref,) = torch.autograd.grad((fn(x) * w).sum(), x)
        torch.testing.assert_close(g_ours, g_ref, rtol=1e-5, atol=1e-6)
    with torch.profiler.profile() as prof:
        torch.autograd.grad((pointwise(F.silu, x) * w).sum(), x)
    # one slice_backward remains: trimming the padded last dim (70 of 96) once, for the whole input
    assert sum(e.count for e in prof.key_averages() if e.key == "aten::slice_backward") == 1


@pytest.mark.parametrize("fn", [torch.exp, F.silu, torch.sigmoid])
def test_pointwise_row_invariant_across_the_one_block_path(fn):
    """Rows of a last dim that is a multiple of VEC_ROW: a call of one block (no padding, one ``fn`` call) and
    a call of several blocks give each row the same bits."""
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(3))   # 19,200 elements: two blocks
    full = pointwise(fn, x)
    for m in [1, 2, 255, 256, 257, 300]:                                  # 256 rows = MAX_BLOCK: the last one-block call
        assert torch.equal(pointwise(fn, x[:m]), full[:m]), m
    assert torch.equal(pointwise(fn, x[:1, None]), full[:1, None])          # leading dims kept


RMS_FORMS = [pytest.param(rmsnorm, id="chosen"), pytest.param(torch_rmsnorm, id="torch")] + [
    pytest.param(lambda x, w, eps, isa=isa: _loaded(isa).rmsnorm(x, w, eps), id=f"c-{isa}")
    for isa in cpu_build.host_isas()]


@pytest.mark.parametrize("form", RMS_FORMS)
@pytest.mark.parametrize("d", [128, 37, 16, 1])
def test_rmsnorm_row_invariant_and_values(form, d):
    """Each row's bits do not depend on the other rows (1..300 rows; D = 37 has a tail past the 16 lanes of
    the C form), and the values are the fp64 formula's to fp32 rounding (rtol 1e-5: a few ulps of the sum,
    the rsqrt and the two products)."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(300, d, generator=gen) * 3, torch.rand(d, generator=gen) + 0.5
    full = form(x, w, 1e-6)
    for m in [1, 2, 3, 7, 16, 17, 64, 299, 300]:
        assert torch.equal(form(x[:m], w, 1e-6), full[:m]), m
        assert torch.equal(form(x[m - 1: m], w, 1e-6), full[m - 1: m]), m
    x64 = x.double()
    ref = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(form(x.view(3, 100, d), w, 1e-6), full.view(3, 100, d))    # leading dims [B, T]
    strided = torch.cat([x, x], dim=-1)[:, :d].view(3, 100, d)                     # a row stride of 2 D
    assert torch.equal(form(strided, w, 1e-6), full.view(3, 100, d))


def test_rmsnorm_grad_matches_torch_form():
    """Training backpropagates through ``rmsnorm`` (the C forward, the torch form's backward): gradients equal
    the torch form's."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 6, 24, generator=gen, requires_grad=True)
    w = (torch.rand(24, generator=gen) + 0.5).requires_grad_(True)
    dy = torch.randn(4, 6, 24, generator=gen)
    got = torch.autograd.grad((rmsnorm(x, w, 1e-6) * dy).sum(), (x, w))
    want = torch.autograd.grad((torch_rmsnorm(x, w, 1e-6) * dy).sum(), (x, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
