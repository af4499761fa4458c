"""serve.memory.state_precision: each storage format's round-trip error within its format's bound, bytes per
slot, stochastic rounding unbiased, error feedback bounded, bad names rejected."""
import pytest
import torch

from serve.memory.state_precision import FORMATS, INT8_MAX, load, round_trip, state_format, store

B, H, K, V = 2, 3, 8, 16                     # awkward sizes: H odd, K != V


def _state(seed: int = 0) -> torch.Tensor:
    """fp32 [B, H, K, V] whose rows span 1e-4 .. 1e1 in magnitude (KDA rows decay at different rates)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, K, V, generator=g) * torch.logspace(-4, 1, K).view(1, 1, K, 1)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_fp32_is_bitwise():
    x = _state()
    y, s = round_trip(x, "fp32")
    assert torch.equal(y, x) and s.payload.dtype == torch.uint8


@pytest.mark.parametrize("fmt, unit", [("bf16", 2.0 ** -8), ("fp16", 2.0 ** -11)])
def test_half_formats_within_unit_roundoff(fmt, unit):
    x = _state()
    y, _ = round_trip(x, fmt)
    normal = x.abs() >= 2.0 ** -14                 # fp16's smallest normal (bf16's is far below)
    rel = ((y - x).abs() / x.abs())[normal]
    assert rel.max() <= unit and rel.max() > 0


def _row_scale(x, qmax):
    return x.abs().amax(-1, keepdim=True) / qmax


def test_fp8_within_its_bound():
    x = _state()
    y, s = round_trip(x, "fp8_e4m3")
    scale = _row_scale(x, 448.0)
    assert torch.allclose(s.scales, scale[..., 0])
    normal = (x / scale).abs() >= 2.0 ** -6        # e4m3's smallest normal, in units of the row scale
    assert ((y - x).abs() / x.abs())[normal].max() <= 2.0 ** -4
    assert ((y - x).abs() <= 2.0 ** -10 * scale)[~normal].all()      # half the subnormal step 2^-9


def test_fp8_stochastic_is_one_of_the_two_neighbours_and_unbiased():
    x = _state()
    rne, _ = round_trip(x, "fp8_e4m3")
    n = 256
    draws = torch.stack([round_trip(x, "fp8_e4m3_sr", generator=_gen(i))[0] for i in range(n)])
    scale = _row_scale(x, 448.0)
    normal = (x / scale).abs() >= 2.0 ** -6
    assert ((draws - x).abs() / x.abs())[:, normal].max() <= 2.0 ** -3      # within one e4m3 step
    assert torch.equal(draws[0], round_trip(x, "fp8_e4m3_sr", generator=_gen(0))[0])   # seeded: reproducible
    bias = (draws.mean(0) - x).norm() / (rne - x).norm()
    assert bias < 0.2, bias                         # RNE's error is a bias; SR's averages out (~1/sqrt(n))


@pytest.mark.parametrize("fmt", ["int8", "int8_head", "int8_ef"])
def test_int8_error_at_most_half_a_scale(fmt):
    x = _state()
    y, s = round_trip(x, fmt)
    scale = s.scales.unsqueeze(-1) if s.scales.dim() == 3 else s.scales[..., None, None]
    assert ((y - x).abs() <= scale * (0.5 + 1e-6)).all()
    assert (load(s) / scale).round().abs().max() <= INT8_MAX


def test_head_scale_loses_the_small_rows_row_scale_keeps():
    """Why row scales: one scale per head rounds the 1e-4 rows to zero."""
    x = _state()
    small = slice(0, 2)                                               # the two smallest-magnitude key rows
    err = {f: ((round_trip(x, f)[0] - x)[:, :, small].norm() / x[:, :, small].norm()).item()
           for f in ("int8", "int8_head")}
    assert err["int8_head"] > 0.9 > 0.01 > err["int8"], err


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bytes_per_slot(fmt):
    s = store(_state(), fmt, generator=_gen())
    assert s.nbytes == B * FORMATS[fmt].state_bytes(H, K, V)
    assert s.payload.dtype == torch.uint8


def test_bytes_per_slot_figures():
    """Per head row of V = 128: fp32 512 B, bf16 256, fp8 / int8 128 + 4 (scale), int8 + error feedback
    128 + 4 + 64 (int4 residual) + 4."""
    rows = {f: FORMATS[f].state_bytes(1, 1, 128) for f in FORMATS}
    assert rows == {"fp32": 512, "bf16": 256, "fp16": 256, "fp8_e4m3": 132, "fp8_e4m3_sr": 132,
                    "int8_head": 132, "int8": 132, "int8_ef": 200}


def test_error_feedback_keeps_the_accumulated_error_bounded():
    """A state that creeps by less than half a step per store: plain int8 rounds every increment away (the
    error grows with the steps), error feedback pays each residual back at the next store (bounded)."""
    x = torch.zeros(1, 1, 1, V)
    x[..., 0] = 1.0                                                   # fixes the row scale at 1/127
    step = 1.0 / INT8_MAX
    delta = torch.zeros_like(x)
    delta[..., 1:] = 0.3 * step                                       # < half a step per store
    errs = {}
    for fmt in ("int8", "int8_ef"):
        truth, read, slot, worst = x.clone(), x.clone(), None, 0.0
        for _ in range(200):
            truth = truth + delta
            read, slot = round_trip(read + delta, fmt, slot)
            worst = max(worst, (read - truth).abs().max().item())
        errs[fmt] = worst
    assert errs["int8"] > 50 * step                                  # 200 x 0.3 steps lost
    assert errs["int8_ef"] <= 1.05 * step, errs                      # never more than one step behind


def test_fp16_overflows_above_65504():
    x = torch.zeros(1, 1, 1, 2)
    x[..., 0] = 7e4
    assert torch.isinf(round_trip(x, "fp16")[0]).any()
    assert torch.isfinite(round_trip(x, "bf16")[0]).all()


def test_bad_inputs():
    x = _state()
    with pytest.raises(ValueError, match="fp7"):
        store(x, "fp7")
    with pytest.raises(ValueError, match="fp7"):
        state_format("fp7")
    with pytest.raises(ValueError, match="float32"):
        store(x.double(), "int8")
    with pytest.raises(ValueError, match=r"\[B, H, K, V\]"):
        store(x[0], "int8")
    with pytest.raises(ValueError, match="generator"):
        store(x, "fp8_e4m3_sr")
    with pytest.raises(ValueError, match="previous"):
        store(x, "int8_ef", previous=store(x, "int8"))
    with pytest.raises(ValueError, match="even"):
        store(x[..., :3].contiguous(), "int8_ef")
    with pytest.raises(ValueError, match="v_dim"):
        FORMATS["int8_ef"].state_bytes(1, 1, 3)
