"""lab.state_vs_kv: the page-03 measurement returns one row per context, in order, each the median of
>= 5 interleaved repeats with its IQR, the a + b N fits and the measurement conditions."""
import pytest

from kda_core.config import PRESETS
from lab.state_vs_kv import DecodeCost, measure_decode_cost
from lab.timing import Conditions, fit_linear


def test_measure_decode_cost_rows():
    costs = measure_decode_cost(PRESETS["kimi-linear-48b-a3b"], [64, 256, 1024], num_heads=1, repeats=5)
    rows = costs.rows
    assert [r.context_tokens for r in rows] == [64, 256, 1024]
    for r in rows:
        assert 0 < r.kda_q1_us <= r.kda_step_us <= r.kda_q3_us and 0 < r.mla_q1_us <= r.mla_decode_us <= r.mla_q3_us
    ns = [r.context_tokens for r in rows]
    assert costs.kda_fit == fit_linear(ns, [r.kda_step_us / 1e6 for r in rows])   # the fit is over the medians
    assert costs.mla_fit == fit_linear(ns, [r.mla_decode_us / 1e6 for r in rows])
    assert costs.mla_fit.b_s > 0                        # an MLA decode reads every latent: it costs per token
    assert isinstance(costs.conditions, Conditions) and costs.conditions.repeats == 5
    assert costs.conditions.torch_threads == 1 and costs.conditions.warmup >= 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(contexts=[]), "contexts"), (dict(contexts=[0]), "contexts"), (dict(contexts=[8, 16], num_heads=0), "num_heads"),
    (dict(contexts=[8]), "two distinct"), (dict(contexts=[8, 8]), "two distinct"),
    (dict(contexts=[8, 16], repeats=3), "repeats"),
])
def test_measure_decode_cost_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        measure_decode_cost(PRESETS["kimi-k3"], **kwargs)


def test_measure_head_scaling_one_run():
    """Page 03 showed MLA decode at 1 and at 4 heads only from different runs (3.5 vs 14.2 ms at different loads):
    every head count is now timed in one interleaved run over the same latents."""
    from lab.state_vs_kv import HeadCost, measure_head_scaling

    cfg = PRESETS["kimi-linear-48b-a3b"]
    hs = measure_head_scaling(cfg, 512, heads=(4, 1, 2), repeats=5)
    assert [r.num_heads for r in hs.rows] == [1, 2, 4] and all(isinstance(r, HeadCost) for r in hs.rows)
    assert all(0 < r.mla_q1_us <= r.mla_decode_us <= r.mla_q3_us for r in hs.rows)
    assert hs.context_tokens == 512 and hs.latent_bytes == 512 * cfg.latent_dim * 4       # fp32 latents
    assert hs.conditions.repeats == 5 and hs.conditions.torch_threads == 1
    assert hs.ratio(4) == hs.rows[2].mla_decode_us / hs.rows[0].mla_decode_us and hs.ratio(2, 2) == 1
    for kwargs, match in ((dict(heads=(1,)), "two distinct"), (dict(heads=(1, 1, 2)), "two distinct"),
                          (dict(heads=(0, 2)), "heads"), (dict(context_tokens=0), "context_tokens"),
                          (dict(context_tokens=2 ** 19), "context_tokens"), (dict(repeats=2), "repeats")):
        with pytest.raises(ValueError, match=match):
            measure_head_scaling(cfg, **({"context_tokens": 64} | kwargs))


def test_state_vs_kv_one_call():
    from kda_core import config as kc
    from lab.state_vs_kv import CONTEXTS, state_vs_kv

    run = state_vs_kv("kimi-k3", "fp32", "bf16", (1024, 4096), 1, 1024, repeats=5)
    cfg = kc.PRESETS["kimi-k3"]
    assert run.cfg == cfg and run.break_even_tokens == kc.break_even_tokens(cfg)
    assert run.bytes.num_tokens.iloc[0] == 1024 and run.bytes.num_tokens.iloc[-1] == 4096
    assert sorted(run.layers.context_tokens.unique()) == list(CONTEXTS)
    assert list(run.decode.context_tokens) == [256, 512, 1024]
    assert list(run.decode.columns) == list(DecodeCost._fields) and run.conditions.repeats == 5
    assert run.mla_fit.b_s > 0 and run.kda_fit.a_s > 0
    assert [r.num_heads for r in run.heads.rows] == [1, 2, 4, 8, 16] and run.heads.context_tokens == 1024
    custom = state_vs_kv("custom", "bf16", "fp8 (e4m3)", (64, 64), 1, 1024, custom=(8, 3, 2, 32), repeats=5)
    assert custom.cfg.num_layers == 8 and custom.kv_dtype_bytes == 1 and len(custom.bytes) == 2
    for kwargs, match in ((dict(model="custom"), "custom"), (dict(model="x"), "model"), (dict(kv_dtype="int4"), "kv_dtype")):
        args = dict(model="kimi-k3", state_dtype="fp32", kv_dtype="bf16", context_range=(64, 128), measure_heads=1,
                    measure_max_tokens=1024) | kwargs
        with pytest.raises(ValueError, match=match):
            state_vs_kv(**args)


def test_fit_reading_says_what_a_line_means():
    """Page 03 shows the fit a + b·N beside its reading, not as a headline: a flat KDA step (R² near 0), a bent MLA
    line (a < 0), a poor line and a good one each read differently."""
    from lab.state_vs_kv import fit_reading, fit_table
    from lab.timing import LinearFit, fit_linear
    ns = [256, 512, 1024, 2048, 4096]
    flat = fit_linear(ns, [5.0, 5.2, 4.9, 5.1, 5.0])
    bent = fit_linear(ns, [1.0, 1.0, 1.1, 2.0, 9.0])            # rises past a cache size: a < 0
    good = fit_linear(ns, [2 + 0.01 * n for n in ns])
    assert fit_reading(flat).startswith("flat") and bent.a_s < 0 and fit_reading(bent).startswith("not one straight")
    assert fit_reading(good).startswith("a good line")
    assert fit_reading(LinearFit(1.0, 0.01, 0.5, 0.001)).startswith("a poor line (R² 0.50")
    table = fit_table({"KDA": flat, "MLA": good})
    assert list(table.kind) == ["KDA", "MLA"] and table.loc[1, "b_ns"] == pytest.approx(0.01 * 1e9)
