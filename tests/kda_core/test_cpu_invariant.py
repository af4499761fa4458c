"""kda_core.cpu_invariant: the C GEMM is its scalar fmaf form bitwise (one order of summation, whatever the tile, tail or
vector path), its packed weights follow in-place writes, autograd runs through it, and the process's choice of
form is made once (``KDA_CPU_GEMM=0`` forces the torch form)."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kda_core import cpu_build, cpu_invariant, invariant

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", params=cpu_build.host_isas() or [None])
def gemm(request):
    if request.param is None:
        pytest.skip("no vector path runs here (not x86-64 with AVX2 + FMA)")
    try:
        return cpu_invariant.load(request.param, check=False)
    except RuntimeError as exc:
        pytest.skip(f"the C GEMM cannot run here: {exc}")


@pytest.mark.parametrize("m,n,k", [
    pytest.param(1, 1, 1, id="M1-N1-K1"),
    pytest.param(1, 384, 128, id="M1-N384-K128"),
    pytest.param(7, 75, 37, id="M7-N75-K37"),
    pytest.param(13, 130, 300, id="M13-N130-K300"),
    pytest.param(64, 48, 129, id="M64-N48-K129"),
    pytest.param(5, 17, 0, id="K0"),
])
def test_linear_is_the_scalar_fma_order(gemm, m, n, k):
    """Bitwise the scalar loop ``acc = fmaf(x[m, k], W[n, k], acc)`` for k = 0..K-1: a kernel that split K or
    summed in another order for some tile would differ in the last bits."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    out = gemm.linear(x, w)
    assert torch.equal(out, gemm.reference(x, w))
    # fp64 agreement: K fp32 roundings of partial sums, each <= 2^-24 of sum_i |x_i w_i|; 1e-5 is >10x above
    scale = x.abs().double() @ w.abs().double().T
    assert ((out.double() - x.double() @ w.double().T).abs() <= 1e-5 * scale).all()


def test_linear_strided_rows_and_weight_views(gemm):
    """Rows with a row stride (a column slice of a wider tensor) and a weight that is a view of a 3-D parameter
    (an expert) give the values of contiguous copies."""
    gen = torch.Generator().manual_seed(6)
    wide, experts = torch.randn(9, 100, generator=gen), torch.randn(3, 40, 64, generator=gen)
    x = wide[:, 10:74]                                                       # [9, 64], row stride 100
    for e in range(3):
        assert torch.equal(gemm.linear(x, experts[e]), gemm.reference(x.contiguous(), experts[e].contiguous()))


def test_packed_weight_follows_in_place_writes(gemm):
    """The packed copy is cached on the weight and rebuilt after an in-place write (a training step, a
    ``load_state_dict``): a stale copy would return the old weight's product."""
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 32, generator=gen), torch.randn(20, 32, generator=gen)
    first = gemm.linear(x, w)
    assert gemm.packed(w)[0] is gemm.packed(w)[0]                            # cached
    with torch.no_grad():
        w.mul_(2.0)
    assert torch.equal(gemm.linear(x, w), 2.0 * first)
    experts = torch.randn(2, 20, 32, generator=gen)
    before = gemm.linear(x, experts[1])
    experts[1].zero_()                                                       # a write through a view of the base
    assert torch.equal(gemm.linear(x, experts[1]), torch.zeros_like(before))


def test_linear_grad_matches_torch():
    """Training runs the process's forward (the C GEMM where chosen) and torch's backward: gradients of x and W
    equal ``F.linear``'s to fp32 rounding."""
    from kda_core.invariant import linear
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 5, 24, generator=gen, requires_grad=True)
    w = torch.randn(10, 24, generator=gen, requires_grad=True)
    dy = torch.randn(2, 5, 10, generator=gen)
    gx, gw = torch.autograd.grad((linear(x, w) * dy).sum(), (x, w))
    rx, rw = torch.autograd.grad((F.linear(x, w) * dy).sum(), (x, w))
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)


CHOICE = """
import torch
from kda_core import cpu_invariant
from kda_core.invariant import linear
x, w = torch.randn(40, 64), torch.randn(30, 64)
full = linear(x, w)
assert all(torch.equal(linear(x[:m], w), full[:m]) for m in (1, 2, 5, 15, 16, 17, 40))
print(cpu_invariant.backend() is None, cpu_invariant.reason())
"""


@pytest.mark.parametrize("env,torch_form", [pytest.param({"KDA_CPU_GEMM": "0"}, True, id="KDA_CPU_GEMM=0"),
                                            pytest.param({"KDA_CPU_KERNEL": "0"}, True, id="KDA_CPU_KERNEL=0")])
def test_env_forces_the_torch_form(env, torch_form):
    """``KDA_CPU_GEMM=0`` (or every C kernel off) makes the process run the torch form, row-invariant too."""
    out = subprocess.run([sys.executable, "-c", CHOICE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "KDA_CPU_GEMM": "1", "KDA_CPU_KERNEL": "1", **env}, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == str(torch_form)
    assert "turned off" in out.stdout


def test_choice_is_made_once(gemm):
    """The form is chosen on the first call and kept: ``backend()`` returns the same object every time; on a host
    that builds the C GEMM (``gemm`` did) and with no variable turning it off, it is the C GEMM (its self-check
    passed: a wrong kernel turns this red rather than quietly running the torch form)."""
    assert cpu_invariant.backend() is cpu_invariant.backend()
    if os.environ.get("KDA_CPU_GEMM", "1") != "0" and os.environ.get("KDA_CPU_KERNEL", "1") != "0":
        assert cpu_invariant.backend() is not None, cpu_invariant.reason()


def test_forget_repacks_after_a_write_the_version_counter_misses():
    """A write through ``.data`` does not move the weight's version counter, so the packed copy would be stale;
    :func:`cpu_invariant.forget` drops it and the next call follows the new weight."""
    gemm = cpu_invariant.backend()
    if gemm is None:
        pytest.skip(f"no C GEMM on this host: {cpu_invariant.reason()}")
    x, w = torch.randn(5, 48), torch.randn(33, 48)
    first = invariant.linear(x, w)
    w.data.copy_(w * 2)
    stale = invariant.linear(x, w)
    assert torch.equal(stale, first), "the version counter saw the .data write: forget is not needed"
    cpu_invariant.forget(w)
    assert torch.equal(invariant.linear(x, w), 2 * first)      # x 2 is exact in fp32


@pytest.mark.parametrize("shape", [(48,), (2, 33, 48)])
def test_linear_refuses_a_weight_that_is_not_2d(shape):
    with pytest.raises(ValueError, match=r"weight must be \[D_out, D_in\]"):
        invariant.linear(torch.randn(5, 48), torch.randn(*shape))


def test_threads_split_columns_without_changing_bits(gemm):
    """A GEMM large enough to share its column groups among OpenMP threads gives the one-thread bits (the one-thread
    call skips OpenMP altogether), also for 1 and 2 rows."""
    gen = torch.Generator().manual_seed(21)
    x, w = torch.randn(64, 128, generator=gen), torch.randn(600, 128, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemm.linear(x, w)
        torch.set_num_threads(3)
        assert torch.equal(gemm.linear(x, w), one)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, gemm.reference(x, w))
    for m in (1, 2):
        assert torch.equal(gemm.linear(x[:m], w), one[:m])


def test_forget_reaches_every_c_form_of_a_model():
    """After ``.data`` writes to every weight of a model (MoE layers, an MLA layer, KDA layers) and
    ``forget(*model.parameters())``, prefill and decode give the logits of a model built with those weights: the
    C forms' own caches (the MoE and MLA blocks, the decode layer's transposed gates) follow ``forget`` too, and
    none keeps pointing at a packed copy that ``forget`` freed."""
    if cpu_invariant.backend() is None:
        pytest.skip(f"no C GEMM on this host: {cpu_invariant.reason()}")
    from kda_core.config import ModelConfig
    from kda_core.model import HybridLM
    cfg = ModelConfig(name="forget", num_layers=3, mla_layers=(1,), hidden_size=32, num_heads=2, head_k_dim=8,
                      head_v_dim=8, kv_lora_rank=8, qk_rope_head_dim=4, num_mla_heads=2, qk_nope_head_dim=8,
                      v_head_dim=8, intermediate_size=32, mla_use_nope=True, num_experts=4, num_experts_per_token=2,
                      moe_intermediate_size=8, first_k_dense_replace=1, seed=3)
    model, other = HybridLM(cfg), HybridLM(ModelConfig(**{**cfg.__dict__, "seed": 9}))
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    model.decode_step(ids[0, -1], model.prefill(ids[:, :-1])[1])          # every cache filled
    new = other.state_dict()
    for name, t in model.state_dict().items():
        t.data.copy_(new[name])                                            # unseen by the version counters
    cpu_invariant.forget(*model.parameters())
    (got, got_cache), (want, want_cache) = model.prefill(ids[:, :-1]), other.prefill(ids[:, :-1])
    assert torch.equal(got, want), "prefill after forget"
    assert torch.equal(model.decode_step(ids[0, -1], got_cache)[0], other.decode_step(ids[0, -1], want_cache)[0]), \
        "decode after forget"


def test_weights_replaced_through_data_reach_every_c_form():
    """``p.data = new`` for every parameter (a new tensor under the same Parameter: its address moves, its version
    counter need not): the GEMM, MoE and MLA caches key on the address and follow; the decode layer's cached gates
    and conv weights must too, so decode gives the logits of a model built with the new weights."""
    if cpu_invariant.backend() is None:
        pytest.skip(f"no C GEMM on this host: {cpu_invariant.reason()}")
    from kda_core.config import ModelConfig
    from kda_core.model import HybridLM
    cfg = ModelConfig(name="data", num_layers=3, mla_layers=(1,), hidden_size=32, num_heads=2, head_k_dim=8,
                      head_v_dim=8, kv_lora_rank=8, qk_rope_head_dim=4, num_mla_heads=2, qk_nope_head_dim=8,
                      v_head_dim=8, intermediate_size=32, mla_use_nope=True, num_experts=4, num_experts_per_token=2,
                      moe_intermediate_size=8, seed=3)
    model, other = HybridLM(cfg), HybridLM(ModelConfig(**{**cfg.__dict__, "seed": 9}))
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    model.decode_step(ids[0, -1], model.prefill(ids[:, :-1])[1])          # every cache filled
    new = dict(other.named_parameters())
    for name, p in model.named_parameters():
        p.data = new[name].data.clone()
    (got, got_cache), (want, want_cache) = model.prefill(ids[:, :-1]), other.prefill(ids[:, :-1])
    assert torch.equal(got, want), "prefill after .data replacement"
    assert torch.equal(model.decode_step(ids[0, -1], got_cache)[0], other.decode_step(ids[0, -1], want_cache)[0]), \
        "decode after .data replacement"
