"""kda_core.moe: the MoE's grouped dispatch equals a row-by-row reference bitwise (each row alone through
its top-k experts, summed in rank order) and a row's output does not depend on its neighbours."""
from pathlib import Path

import pytest
import torch

from kda_core import moe as moe_mod
from kda_core.model import HybridLM
from kda_core.moe import swiglu


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
    return y + moe.shared(x)


@pytest.mark.parametrize("pairs_max", [pytest.param(0, id="dispatch"), pytest.param(10 ** 6, id="pairs")])
@pytest.mark.parametrize("n", [pytest.param(n, id=f"N{n}") for n in (1, 2, 7, 33, 70)])
def test_moe_dispatch_equals_row_by_row_bitwise(moe, n, pairs_max, monkeypatch):
    """Both ways of running the routed experts (every (row, expert) pair in one C call, the default up to
    ``PAIRS_MAX`` pairs; the per-expert dispatch) equal the row-by-row reference bitwise."""
    monkeypatch.setattr(moe_mod, "PAIRS_MAX", pairs_max)
    x = torch.randn(1, n, moe.cfg.hidden_size, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        got = moe(x)
        assert torch.equal(got, reference(moe, x))
        for i in (0, n - 1):                                              # batched == alone
            assert torch.equal(moe(x[:, i: i + 1]), got[:, i: i + 1])


def test_moe_dispatch_all_rows_on_one_expert(moe):
    """Every row routed to the same experts (one expert gets all N rows): still the row-by-row result."""
    x = torch.randn(1, 1, moe.cfg.hidden_size, generator=torch.Generator().manual_seed(5)).expand(1, 9, -1)
    with torch.no_grad():
        assert torch.equal(moe(x.contiguous()), reference(moe, x.contiguous()))
