"""kda_core.moe: the torch form's grouped dispatch equals a row-by-row reference bitwise (each row alone through its
top-k experts, summed in rank order); the C form (kda_core.cpu_moe, one call per block) agrees with the torch form
within cpu_moe.RTOL / ATOL and chooses the same experts; with either form a row's output does not depend on its
neighbours, bitwise."""
import dataclasses
from pathlib import Path

import pytest
import torch

from kda_core import cpu_moe
from kda_core.model import HybridLM
from kda_core.moe import MoE, swiglu

needs_c = pytest.mark.skipif(cpu_moe.backend() is None, reason=f"no C MoE: {cpu_moe.reason()}")


@pytest.fixture(scope="module")
def moe():
    model = HybridLM.from_pretrained(Path(__file__).resolve().parents[2] / "weights" / "kda-demo")
    return model.ffn[model.cfg.first_k_dense_replace]


def reference(moe, x):
    """Each row alone: its top-k experts one by one, weighted and summed in rank order, plus the shared experts."""
    rows = x.reshape(-1, x.shape[-1])                                     # [N, D]
    w, idx = moe.route(rows)
    out = []
    for i in range(rows.shape[0]):
        r = rows[i: i + 1]
        y = swiglu(r, moe.experts_gate_up[idx[i, 0]], moe.experts_down[idx[i, 0]]) * w[i: i + 1, :1]
        for j in range(1, idx.shape[1]):
            y = y + swiglu(r, moe.experts_gate_up[idx[i, j]], moe.experts_down[idx[i, j]]) * w[i: i + 1, j: j + 1]
        out.append(y)
    y = torch.cat(out).view(x.shape)
    return y if moe.shared is None else y + moe.shared.forward_torch(x)


def variant(moe, seed, **changes):
    """A MoE of ``moe``'s config with ``changes`` and random weights (bias too)."""
    m = MoE(dataclasses.replace(moe.cfg, **changes), torch.Generator().manual_seed(seed)).eval()
    m.router_bias.copy_(torch.randn(m.cfg.num_experts, generator=torch.Generator().manual_seed(seed)) * 0.1)
    return m


@pytest.mark.parametrize("n", [pytest.param(n, id=f"N{n}") for n in (1, 2, 7, 33, 70)])
def test_moe_forward_torch_equals_row_by_row_bitwise(moe, n):
    """The torch form (the one-row path, the per-expert dispatch) equals the row-by-row reference bitwise."""
    x = torch.randn(1, n, moe.cfg.hidden_size, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        got = moe.forward_torch(x)
        assert torch.equal(got, reference(moe, x))
        for i in (0, n - 1):                                              # batched == alone
            assert torch.equal(moe.forward_torch(x[:, i: i + 1]), got[:, i: i + 1])


def test_moe_dispatch_all_rows_on_one_expert(moe):
    """Every row routed to the same experts (one expert gets all N rows): still the row-by-row result."""
    x = torch.randn(1, 1, moe.cfg.hidden_size, generator=torch.Generator().manual_seed(5)).expand(1, 9, -1)
    with torch.no_grad():
        assert torch.equal(moe.forward_torch(x.contiguous()), reference(moe, x.contiguous()))


@needs_c
@pytest.mark.parametrize("changes", [pytest.param({}, id="demo"),
                                     pytest.param({"num_expert_group": 4, "topk_group": 2}, id="G4-top2"),
                                     pytest.param({"num_shared_experts": 0, "moe_renormalize": False}, id="no-shared"),
                                     pytest.param({"num_experts": 6, "num_experts_per_token": 3,
                                                   "moe_intermediate_size": 24}, id="E6-k3-F24")])
@pytest.mark.parametrize("n", [pytest.param(n, id=f"N{n}") for n in (1, 5, 130)])
def test_moe_c_form_matches_torch_form(moe, changes, n):
    """The C form of ``MoE.forward`` against the torch form: the same experts in the same order, outputs within
    cpu_moe.RTOL / ATOL; each row alone bitwise its row of the batched call (also for a strided input)."""
    m = variant(moe, n, **changes) if changes else moe
    x = torch.randn(2, n, m.cfg.hidden_size, generator=torch.Generator().manual_seed(n)) * 2
    rows = x.reshape(-1, x.shape[-1])
    with torch.no_grad():
        got = m(x)
        idx = torch.empty(rows.shape[0], m.cfg.num_experts_per_token, dtype=torch.long)
        cpu_moe.backend().forward(m, rows, idx)
        assert torch.equal(idx, m.route(rows)[1])
        torch.testing.assert_close(got, m.forward_torch(x), rtol=cpu_moe.RTOL, atol=cpu_moe.ATOL)
        for i in range(0, 2 * n, max(1, n // 3)):                         # batched == alone
            assert torch.equal(m(rows[i: i + 1]), got.reshape(-1, x.shape[-1])[i: i + 1])
        strided = torch.cat([x, x], dim=-1)[..., : x.shape[-1]]           # [2, n, D] with a row stride 2D
        assert torch.equal(m(strided), got)


@needs_c
def test_moe_c_form_ties_choose_the_lower_expert(moe):
    """Experts with equal biased scores: the C form takes the lower index first, every time and in any batch."""
    m = variant(moe, 3)
    with torch.no_grad():
        m.router[5].copy_(m.router[2])                                    # experts 2 and 5: the same logits ...
        m.router_bias.zero_()                                             # ... and the same bias
        m.router[2].mul_(40)
        m.router[5].mul_(40)
    x = m.router[2:3] / m.router[2].norm()                                # a row whose best score is theirs
    idx = torch.empty(4, m.cfg.num_experts_per_token, dtype=torch.long)
    with torch.no_grad():
        cpu_moe.backend().forward(m, x.expand(4, -1).contiguous(), idx)
    assert idx[:, :2].tolist() == [[2, 5]] * 4


@needs_c
def test_moe_c_form_nan_row_stays_its_own(moe):
    """A NaN row (an engine pad row) gives NaN, chooses valid experts and leaves the other rows' bits alone."""
    x = torch.randn(5, moe.cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        clean = moe(x)
        x[2] = float("nan")
        idx = torch.empty(5, moe.cfg.num_experts_per_token, dtype=torch.long)
        got = cpu_moe.backend().forward(moe, x, idx)
    assert got[2].isnan().all() and ((idx >= 0) & (idx < moe.cfg.num_experts)).all()
    assert torch.equal(got[[0, 1, 3, 4]], clean[[0, 1, 3, 4]])


@needs_c
def test_moe_c_form_sees_weight_writes(moe):
    """A weight written in place (version counter) or the bias moved by ``update_bias``: the next call uses it."""
    m = variant(moe, 4)
    x = torch.randn(3, m.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        m(x)
        m.experts_down.mul_(2)
        m.router_bias.add_(torch.arange(m.cfg.num_experts, dtype=torch.float32))
        torch.testing.assert_close(m(x), m.forward_torch(x), rtol=cpu_moe.RTOL, atol=cpu_moe.ATOL)


@needs_c
def test_moe_c_form_sees_a_data_write_after_forget(moe):
    """A write the version counter does not see (through ``.data``) followed by ``cpu_invariant.forget``, as its
    contract asks: the next call packs and uses the new weights (not the block cached before, whose packed copies
    forget dropped)."""
    from kda_core import cpu_invariant
    m = variant(moe, 5)
    x = torch.randn(3, m.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        m(x)
        m.experts_down.data.mul_(2)
        m.shared.down.data.mul_(2)
        cpu_invariant.forget(*m.parameters())
        torch.testing.assert_close(m(x), m.forward_torch(x), rtol=cpu_moe.RTOL, atol=cpu_moe.ATOL)


@needs_c
def test_moe_training_load_from_the_c_form(moe):
    """In training mode without autograd the C form runs and records each expert's load, as the torch form."""
    m = variant(moe, 6).train()
    x = torch.randn(7, m.cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        m(x)
        load = m.last_load.clone()
        m.forward_torch(x)
    assert torch.equal(load, m.last_load) and int(load.sum()) == 7 * m.cfg.num_experts_per_token


@needs_c
def test_moe_c_activations_within_tolerance():
    """The C sigmoid and silu(v) * up against torch's within cpu_moe.ACT_RTOL, tails (n % 8) included."""
    c = cpu_moe.backend()
    v = torch.randn(1003, generator=torch.Generator().manual_seed(1)) * 6
    up = torch.randn(1003, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(c.sigmoid(v), torch.sigmoid(v), rtol=cpu_moe.ACT_RTOL, atol=0.0)
    torch.testing.assert_close(c.silu_mul(v, up), torch.nn.functional.silu(v) * up, rtol=2 * cpu_moe.ACT_RTOL,
                               atol=1e-30)


@needs_c
@pytest.mark.parametrize("n", [pytest.param(n, id=f"N{n}") for n in (1, 3, 40)])
def test_dense_mlp_c_form_matches_torch_form(n):
    """The dense SwiGLU MLP (the model's first layer) in one C call: within cpu_moe.RTOL / ATOL of the torch form,
    each row alone bitwise its row of the batched call."""
    model = HybridLM.from_pretrained(Path(__file__).resolve().parents[2] / "weights" / "kda-demo")
    mlp = model.ffn[0]
    x = torch.randn(1, n, model.cfg.hidden_size, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        got = mlp(x)
        torch.testing.assert_close(got, mlp.forward_torch(x), rtol=cpu_moe.RTOL, atol=cpu_moe.ATOL)
        for i in range(n):
            assert torch.equal(mlp(x[:, i: i + 1]), got[:, i: i + 1])


@needs_c
def test_moe_c_form_refuses_more_experts_than_kept_groups_hold(moe):
    """k larger than the experts of the topk_group groups kept (a config the torch form would fill with masked
    experts): a ValueError naming the sizes, not a wrong answer; the config refuses it, so no form runs it."""
    with torch.no_grad(), pytest.raises(ValueError, match="num_experts_per_token"):
        variant(moe, 2, num_expert_group=4, topk_group=1, num_experts_per_token=3)


@needs_c
@pytest.mark.parametrize("layer", [0, 1], ids=["dense", "moe"])
@pytest.mark.parametrize("n", [1, 5, 33])
def test_ffn_residual_one_call_equals_the_separate_calls_bitwise(layer, n):
    """ffn_residual's one C call (norm, feed-forward, add) is bitwise rmsnorm, the module and torch's add, writes x in
    place and returns it; with autograd on it returns a new tensor and leaves x alone."""
    from kda_core.invariant import rmsnorm
    from kda_core.moe import ffn_residual
    model = HybridLM.from_pretrained(Path(__file__).resolve().parents[2] / "weights" / "kda-demo")
    ffn, norm, eps = model.ffn[layer], model.norm2[layer], model.cfg.rms_norm_eps
    x = torch.randn(1, n, model.cfg.hidden_size, generator=torch.Generator().manual_seed(n)) * 3
    want = x + ffn(rmsnorm(x, norm, eps))
    got = x.clone()
    assert ffn_residual(ffn, got, norm, eps) is got
    assert torch.equal(got, want)
    x.requires_grad_(True)
    with torch.enable_grad():
        y = ffn_residual(ffn, x, norm, eps)
    assert y is not x and torch.allclose(y, want, rtol=cpu_moe.RTOL, atol=cpu_moe.ATOL)
