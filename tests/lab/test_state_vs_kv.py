"""lab.state_vs_kv: the page-03 measurement returns one positive row per context, in order."""
import pytest

from kda_core.config import PRESETS
from lab.state_vs_kv import measure_decode_cost


def test_measure_decode_cost_rows():
    rows = measure_decode_cost(PRESETS["kimi-linear-48b-a3b"], [64, 256], num_heads=1, repeats=2)
    assert [r.context_tokens for r in rows] == [64, 256]
    assert all(r.kda_step_us > 0 and r.mla_decode_us > 0 for r in rows)


@pytest.mark.parametrize("kwargs,match", [
    (dict(contexts=[]), "contexts"), (dict(contexts=[0]), "contexts"), (dict(contexts=[8], num_heads=0), "num_heads"),
])
def test_measure_decode_cost_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        measure_decode_cost(PRESETS["kimi-k3"], **kwargs)


def test_state_vs_kv_one_call():
    from kda_core import config as kc
    from lab.state_vs_kv import CONTEXTS, state_vs_kv

    run = state_vs_kv("kimi-k3", "fp32", "bf16", (1024, 4096), 1, 1024, repeats=1)
    cfg = kc.PRESETS["kimi-k3"]
    assert run.cfg == cfg and run.break_even_tokens == kc.break_even_tokens(cfg)
    assert run.bytes.num_tokens.iloc[0] == 1024 and run.bytes.num_tokens.iloc[-1] == 4096
    assert sorted(run.layers.context_tokens.unique()) == list(CONTEXTS)
    assert list(run.decode.context_tokens) == [256, 512, 1024]
    custom = state_vs_kv("custom", "bf16", "fp8 (e4m3)", (64, 64), 1, 1024, custom=(8, 3, 2, 32), repeats=1)
    assert custom.cfg.num_layers == 8 and custom.kv_dtype_bytes == 1 and len(custom.bytes) == 2
    for kwargs, match in ((dict(model="custom"), "custom"), (dict(model="x"), "model"), (dict(kv_dtype="int4"), "kv_dtype")):
        args = dict(model="kimi-k3", state_dtype="fp32", kv_dtype="bf16", context_range=(64, 128), measure_heads=1,
                    measure_max_tokens=1024) | kwargs
        with pytest.raises(ValueError, match=match):
            state_vs_kv(**args)
