"""kda_core.layer / conv / model: split invariance, padding no-op, decode == prefill, validation."""
import dataclasses

import pytest
import torch

from kda_core.config import PRESETS
from kda_core.conv import short_conv
from kda_core.layer import KDALayer, MLALayer
from kda_core.model import HybridLM, bytes_to_text, cache_equal, encode

CFG = PRESETS["demo-tiny"]  # K = 16 != V = 12


@pytest.fixture(scope="module")
def kda_layer():
    return KDALayer(CFG, torch.Generator().manual_seed(0))


def _x(T, seed=0):
    return torch.randn(1, T, CFG.hidden_size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("split", [1, 3, 63, 64, 65])
def test_split_invariance_recurrent_bitwise(kda_layer, split):
    x = _x(130)
    y, c, *_ = kda_layer(x, None, mode="recurrent")
    y1, c1, *_ = kda_layer(x[:, :split], None, mode="recurrent")
    y2, c2, *_ = kda_layer(x[:, split:], c1, mode="recurrent")
    assert torch.equal(torch.cat([y1, y2], 1), y)
    assert torch.equal(c2.recurrent, c.recurrent) and torch.equal(c2.conv, c.conv)


@pytest.mark.parametrize("split", [1, 3, 63, 64, 65])
def test_split_invariance_chunk(kda_layer, split):
    x = _x(130)
    y, c, *_ = kda_layer(x, None, mode="chunk")
    y1, c1, *_ = kda_layer(x[:, :split], None, mode="chunk")
    y2, c2, *_ = kda_layer(x[:, split:], c1, mode="chunk")
    assert (torch.cat([y1, y2], 1) - y).abs().max() <= 1e-5
    assert (c2.recurrent - c.recurrent).abs().max() <= 1e-5 and torch.equal(c2.conv, c.conv)


def test_padding_token_is_noop_but_zero_token_is_not(kda_layer):
    from kda_core.kda import kda_recurrent
    _, c, *_ = kda_layer(_x(20), None, mode="recurrent")
    H, K, V = CFG.num_heads, CFG.head_k_dim, CFG.head_v_dim
    z = torch.zeros(1, 1, H, K)
    # a padding token as kda_chunk pads: g = 0, beta = 0, k = 0
    _, s_pad = kda_recurrent(z, z, torch.zeros(1, 1, H, V), z, torch.zeros(1, 1, H), c.recurrent)
    assert torch.equal(s_pad, c.recurrent)
    # a plain zero *input* token still decays the state and shifts the conv window
    _, c_zero, *_ = kda_layer(torch.zeros(1, 1, CFG.hidden_size), c, mode="recurrent")
    assert not torch.equal(c_zero.recurrent, c.recurrent)


def test_conv_matches_conv1d():
    x = torch.randn(2, 9, 6)
    w = torch.randn(6, 4)
    y, state = short_conv(x, w, None, apply_silu=False)
    ref = torch.nn.functional.conv1d(torch.nn.functional.pad(x.transpose(1, 2), (3, 0)), w.unsqueeze(1), groups=6)
    assert torch.allclose(y, ref.transpose(1, 2), atol=1e-6)
    assert torch.equal(state, x.transpose(1, 2)[..., -3:])
    with pytest.raises(ValueError, match="conv_state"):
        short_conv(x, w, torch.zeros(2, 6, 2))


def test_mla_absorbed_decode_matches_forward():
    m = MLALayer(CFG, torch.Generator().manual_seed(1))
    x = _x(20)
    _, cache = m(x[:, :19], None)
    y, lat = m(x[:, 19:], cache, mode="recurrent")
    assert (m.decode_absorbed(x[:, 19:], lat) - y).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def model():
    return HybridLM(CFG)


def test_decode_after_prefill_equals_prefill(model):
    toks = encode("The KDA state replaces the KV list; the hybrid keeps MLA every 4th layer.")
    full, _ = model.prefill(toks)
    logits, cache = model.prefill(toks[:40])
    for t in range(40, len(toks)):
        step, cache = model.decode_step(toks[t:t + 1], cache)
        assert (step[0] - full[0, t]).abs().max() <= 1e-5


def test_recurrent_multi_token_bitwise_equals_decode_steps(model):
    toks = encode("speculative verify must equal sequential decode")
    _, cache = model.prefill(toks[:20])
    out = model.forward(toks[20:29], cache, mode="recurrent")
    c = cache
    for t in range(20, 29):
        step, c = model.decode_step(toks[t:t + 1], c)
        assert torch.equal(step[0], out.logits[0, t - 20])
    assert cache_equal(c, out.cache)


def test_generate_deterministic_and_text_roundtrip(model):
    a, _ = model.generate(encode("hello"), 8)
    b, _ = HybridLM(CFG).generate(encode("hello"), 8)
    assert torch.equal(a, b) and a.shape == (1, 8)
    assert bytes_to_text(encode("héllo")) == "héllo"


def test_model_validation(model):
    V = CFG.vocab_size
    with pytest.raises(ValueError, match=rf"tokens must be ids in \[0, {V - 1}\]"):
        model.prefill(torch.tensor([1, V]))
    with pytest.raises(ValueError, match="tokens must be ids"):
        model.prefill(torch.tensor([-1, 1]))
    with pytest.raises(ValueError, match="mode"):
        model.forward(torch.tensor([1]), mode="fast")
    with pytest.raises(ValueError, match="at least one token"):
        model.forward(torch.zeros(1, 0, dtype=torch.long))


def test_model_takes_every_id_of_its_vocabulary():
    """The id bound is the config's vocab_size, not the byte range: a 300-id model runs ids 256..299."""
    big = HybridLM(dataclasses.replace(CFG, vocab_size=300))
    logits, _ = big.prefill(torch.tensor([0, 255, 256, 299]))
    assert logits.shape == (1, 4, 300) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match=r"\[0, 299\]"):
        big.prefill(torch.tensor([300]))


@pytest.mark.parametrize("offsets", [(64,), (16, 48, 96), (32, 64)], ids=str)
def test_state_at_equals_split_prefill(model, offsets):
    toks = encode("One chunked prefill yields the cache after exactly t tokens for every checkpoint. " * 2)
    _, base = model.prefill(toks[:16])
    out = model.forward(toks[16:136], base, mode="chunk", state_at=offsets)
    for t in offsets:
        _, ref = model.prefill(toks[16:16 + t], base)
        for i in CFG.kda_layers:
            got, want = out.states_at[t][i], ref.layers[i]
            assert (got.recurrent - want.recurrent).abs().max() <= 1e-5
            assert (got.conv - want.conv).abs().max() <= 1e-5  # layer inputs differ by rounding only
    wrong = model.forward(toks[16:136], base, mode="chunk", state_at=(offsets[0] + 16,)).states_at
    _, ref = model.prefill(toks[16:16 + offsets[0]], base)
    assert (wrong[offsets[0] + 16][CFG.kda_layers[0]].recurrent - ref.layers[CFG.kda_layers[0]].recurrent).abs().max() > 1e-3


def test_state_at_validation(model):
    with pytest.raises(ValueError, match="state_at"):
        model.forward(torch.arange(10), mode="chunk", state_at=(10,))
    with pytest.raises(ValueError, match="state_at"):
        model.forward(torch.arange(10), mode="recurrent", state_at=(4,))


@pytest.mark.parametrize("state_at", [(70.0,), (True,), 5, "5", (None,)], ids=repr)
def test_state_at_must_hold_int_offsets(kda_layer, model, state_at):
    """A float offset raised IndexError inside the chunk states, True was taken as offset 1, and a bare
    int raised TypeError: now one ValueError naming state_at, from the layer and from the model."""
    with pytest.raises(ValueError, match="state_at must be a tuple of int offsets"):
        kda_layer(_x(100), state_at=state_at)
    with pytest.raises(ValueError, match="state_at must be a tuple of int offsets"):
        model.forward(torch.arange(100), mode="chunk", state_at=state_at)


@pytest.mark.parametrize("shape", [(1, 0), (0, 3)], ids=["T0", "B0"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_layers_need_a_token(kda_layer, shape, mode):
    """T = 0 or B = 0 raised a reshape RuntimeError in both layers."""
    x = torch.zeros(*shape, CFG.hidden_size)
    mla = MLALayer(CFG, torch.Generator().manual_seed(0))
    for layer in (kda_layer, mla):
        with pytest.raises(ValueError, match=r"x must hold at least one sequence and one token"):
            layer(x, mode=mode)


def test_forward_returns_one_type_whatever_the_flags(kda_layer):
    """y and the cache by name with or without ``output_aux`` / ``state_at``; what was not asked for is None
    (the return was a 2- or a 3-tuple whose third item meant aux or states by flag)."""
    from kda_core.layer import KDAAux, KDAOutput
    x = _x(100)
    plain = kda_layer(x, None, mode="chunk")
    aux = kda_layer(x, None, mode="recurrent", output_aux=True)
    at = kda_layer(x, None, mode="chunk", state_at=(64, 70))
    assert all(isinstance(o, KDAOutput) for o in (plain, aux, at))
    assert plain.aux is None and plain.states_at is None and at.aux is None and aux.states_at is None
    assert isinstance(aux.aux, KDAAux) and set(at.states_at) == {64, 70}
    assert torch.equal(plain.y, at.y) and torch.equal(plain.cache.recurrent, at.cache.recurrent)
