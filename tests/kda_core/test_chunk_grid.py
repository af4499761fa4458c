"""The 64-token prefill grid: a prefill split at a multiple of ``CHUNK_SIZE`` is bitwise the unsplit one.

This is what makes a warm prefix-cache run bitwise equal to the cache-off run (``serve.engine``): the KDA
chunks and the MLA row blocks of both runs sit on the same grid, and every other op is row-invariant.
"""
from pathlib import Path

import pytest
import torch

from kda_core.chunk import CHUNK_SIZE, kda_chunk
from kda_core.config import PRESETS
from kda_core.layer import KDALayer, MLALayer, _block_causal_attention
from kda_core.model import HybridLM, cache_equal

TINY = PRESETS["demo-tiny"]
TRAINED = Path(__file__).resolve().parents[2] / "weights" / "kda-demo"   # the demo model's shipped weights


def _tokens(T, seed=0):
    return torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(seed))


def _x(T, d, seed=0):
    return torch.randn(1, T, d, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["demo-tiny", "demo-random", "demo-trained"])
def model(request):
    """Seeded inits and the trained demo model (trained gates: realistic decays, larger logits)."""
    if request.param == "demo-trained":
        return HybridLM.from_pretrained(TRAINED)
    return HybridLM(PRESETS[request.param.removesuffix("-random")])


@pytest.mark.parametrize("split", [64, 128, 192, 256])
def test_model_prefill_split_on_grid_is_bitwise(model, split):
    toks = _tokens(300)
    full = model.forward(toks)
    first = model.forward(toks[:, :split])
    rest = model.forward(toks[:, split:], first.cache)
    assert torch.equal(torch.cat([first.logits, rest.logits], 1), full.logits)
    assert cache_equal(rest.cache, full.cache)


@pytest.mark.parametrize("split", [64, 128, 256])
def test_mla_layer_split_on_grid_is_bitwise(split):
    mla = MLALayer(PRESETS["demo"], torch.Generator().manual_seed(0))
    x = _x(300, PRESETS["demo"].hidden_size)
    y, lat = mla(x, None, mode="chunk")
    y1, c1 = mla(x[:, :split], None, mode="chunk")
    y2, c2 = mla(x[:, split:], c1, mode="chunk")
    assert torch.equal(torch.cat([y1, y2], 1), y) and torch.equal(c2, lat)


@pytest.mark.parametrize("split", [64, 128])
def test_kda_layer_split_on_grid_is_bitwise(split):
    layer = KDALayer(TINY, torch.Generator().manual_seed(0))
    x = _x(200, TINY.hidden_size)
    y, c, *_ = layer(x, None, mode="chunk")
    y1, c1, *_ = layer(x[:, :split], None, mode="chunk")
    y2, c2, *_ = layer(x[:, split:], c1, mode="chunk")
    assert torch.equal(torch.cat([y1, y2], 1), y)
    assert torch.equal(c2.recurrent, c.recurrent) and torch.equal(c2.conv, c.conv)


def test_state_at_keeps_the_grid(model):
    """Asking for states off the grid must not move the grid: the logits stay bitwise those of a plain
    forward; states on the grid are bitwise a prefill of exactly t tokens, others within fp32 rounding."""
    toks = _tokens(300, seed=1)
    plain = model.forward(toks)
    out = model.forward(toks, state_at=(16, 48, 128, 200, 256))
    assert torch.equal(out.logits, plain.logits) and cache_equal(out.cache, plain.cache)
    for t in (16, 48, 128, 200, 256):
        ref = model.forward(toks[:, :t]).cache
        for i in model.cfg.kda_layers:
            got, want = out.states_at[t][i], ref.layers[i]
            if t % CHUNK_SIZE == 0:
                assert torch.equal(got.recurrent, want.recurrent) and torch.equal(got.conv, want.conv)
            else:  # one short chunk from the grid point below t: same maths, another summation order
                assert (got.recurrent - want.recurrent).abs().max() <= 1e-5
                assert (got.conv - want.conv).abs().max() <= 1e-5


@pytest.mark.parametrize("start,T", [(0, 150), (37, 150), (64, 1), (0, 64)])
def test_block_causal_attention_equals_masked_softmax(start, T):
    g = torch.Generator().manual_seed(start + T)
    q = torch.randn(1, 2, T, 24, generator=g)
    k = torch.randn(1, 2, start + T, 24, generator=g)
    v = torch.randn(1, 2, start + T, 8, generator=g)
    got = _block_causal_attention(q, k, v, start, 0.2)
    mask = torch.ones(T, start + T, dtype=torch.bool).tril(diagonal=start)
    p = torch.softmax((q.double() @ k.double().transpose(-1, -2) * 0.2).masked_fill(~mask, float("-inf")), -1)
    assert (got.double() - p @ v.double()).abs().max() <= 1e-6


def test_kda_chunk_pieces_are_bitwise():
    g = torch.Generator().manual_seed(2)
    B, T, H, K, V = 1, 600, 2, 16, 12
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v, beta = torch.randn(B, T, H, V, generator=g), torch.rand(B, T, H, generator=g)
    gate = -torch.rand(B, T, H, K, generator=g) * 0.1
    whole = kda_chunk(q, k, v, gate, beta, piece_tokens=1024)
    for piece in (64, 128, 256):
        part = kda_chunk(q, k, v, gate, beta, piece_tokens=piece)
        assert torch.equal(part.o, whole.o) and torch.equal(part.h, whole.h)
