"""kda_core.invariant: row i of the result does not depend on how many rows are computed."""
import pytest
import torch
import torch.nn.functional as F

from kda_core.invariant import linear, pointwise


@pytest.mark.parametrize("d_in,d_out", [(128, 128), (128, 384), (32, 4), (2304, 64)])
def test_linear_row_invariant(d_in, d_out):
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(d_out, d_in, generator=gen), torch.randn(600, d_in, generator=gen)
    full = linear(x, w)
    for m in [1, 2, 3, 5, 9, 15, 16, 17, 63, 64, 65, 128, 511, 600]:
        assert torch.equal(linear(x[:m], w), full[:m]), m


@pytest.mark.parametrize("fn", [torch.exp, torch.sigmoid, F.softplus, F.silu, torch.rsqrt, torch.cos])
def test_pointwise_row_invariant(fn):
    x = torch.rand(40, 48) + 0.1
    full = pointwise(fn, x)
    for m in [1, 3, 7, 40]:
        assert torch.equal(pointwise(fn, x[:m]), full[:m])
    assert torch.allclose(full, fn(x), rtol=1e-6, atol=1e-7)


def test_linear_shape_error():
    with pytest.raises(ValueError, match="D_in"):
        linear(torch.zeros(2, 3), torch.zeros(4, 5))
