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
