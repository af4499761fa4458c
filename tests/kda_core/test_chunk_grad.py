"""Autograd through kda_core.chunk.kda_chunk (training backpropagates through it): its gradients equal the
recurrent reference's (kda_core.kda.kda_recurrent) for every input, and HybridLM's training-mode forward
carries a graph to every weight while the serving forward stays graph-free."""
import math

import pytest
import torch
import torch.nn.functional as F

from kda_core.chunk import kda_chunk
from kda_core.config import PRESETS
from kda_core.kda import kda_gate, kda_recurrent
from kda_core.model import HybridLM

B, H, K, V = 2, 3, 16, 12  # K != V so a transposed state cannot pass
GRAD_TOL = 1e-9            # fp64: both forms are exact up to rounding


def _leaves(T, seed=0):
    """fp64 leaf inputs (q, k normalised; g through the softplus gate; beta in (0, 1)) and output weights."""
    gen = torch.Generator().manual_seed(seed)
    d = torch.float64
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=d), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=d), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=d)
    g = kda_gate(torch.randn(B, T, H, K, generator=gen, dtype=d), torch.full((H,), math.log(4.0), dtype=d),
                 torch.full((H * K,), -2.0, dtype=d))
    beta = torch.rand(B, T, H, generator=gen, dtype=d)
    s0 = torch.randn(B, H, K, V, generator=gen, dtype=d)
    w_o = torch.randn(B, T, H, V, generator=gen, dtype=d)
    w_s = torch.randn(B, H, K, V, generator=gen, dtype=d)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta, s0)]
    return leaves, w_o, w_s


@pytest.mark.parametrize("T", [1, 63, 64, 150], ids=lambda t: f"B2-T{t}-H3-K16-V12")
def test_chunk_grad(T):
    grads = {}
    for name, fn in (("recurrent", kda_recurrent), ("chunk", lambda *a: kda_chunk(*a)[:2])):
        leaves, w_o, w_s = _leaves(T)
        o, s = fn(*leaves)
        ((o * w_o).sum() + (s * w_s).sum()).backward()
        grads[name] = [t.grad for t in leaves]
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), grads["chunk"], grads["recurrent"]):
        assert a is not None, f"no gradient reached {name}"
        torch.testing.assert_close(a, b, atol=GRAD_TOL, rtol=GRAD_TOL, msg=lambda m, name=name: f"d/d{name}: {m}")


def test_chunk_gradcheck():
    """torch.autograd.gradcheck (finite differences) on a small chunk call with two chunks of 4."""
    leaves, _, _ = _leaves(6, seed=1)
    leaves = [t.detach()[:1, :, :1].clone().requires_grad_(True) if t.dim() == 4 and t.shape[1] == 6 else t
              for t in leaves]
    q, k, v, g, beta, s0 = leaves
    beta = beta.detach()[:1, :, :1].clone().requires_grad_(True)
    s0 = s0.detach()[:1, :1].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *a: kda_chunk(*a, chunk_size=4)[:2], (q, k, v, g, beta, s0))


def test_model_training_forward_has_graph():
    model = HybridLM(PRESETS["demo-tiny"])
    x = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(0))
    assert model(x).logits.grad_fn is None                      # serving: eval mode, no graph
    model.requires_grad_(True)
    assert model(x).logits.grad_fn is None                      # still eval mode
    model.train()
    logits = model(x[:, :-1]).logits
    F.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient for {missing}"
    with torch.no_grad():
        assert model(x).logits.grad_fn is None                  # no_grad still wins in training mode


def test_model_grad_chunk_equals_recurrent():
    """The training loss and every weight's gradient through the chunk forward (what training runs) equal those
    through the token-by-token recurrent forward (the reference), fp32, T = 70 (two chunks, the second short)."""
    x = torch.randint(0, 256, (2, 71), generator=torch.Generator().manual_seed(1))
    out = {}
    for mode in ("chunk", "recurrent"):
        model = HybridLM(PRESETS["demo-tiny"]).requires_grad_(True).train()
        loss = F.cross_entropy(model(x[:, :-1], mode=mode).logits.reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        out[mode] = (loss.item(), {n: p.grad for n, p in model.named_parameters()})
    assert out["chunk"][0] == pytest.approx(out["recurrent"][0], rel=1e-6)
    for name, g in out["chunk"][1].items():
        torch.testing.assert_close(g, out["recurrent"][1][name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
