"""Page 01's one call: the parts it returns are the measured rows, the model table and K3's config."""
import pytest
import torch

from kda_core.config import PRESETS
from lab.rollback import LAYER_PRESETS, measure_layer_bytes, model_rollback_table, rollback_page


def test_rollback_page_is_the_parts():
    shape = LAYER_PRESETS["S1 small (H=4, K=V=64)"]
    page = rollback_page(tuple(shape), 3, "bf16")
    assert page.shape == shape and page.elem_bytes == 2
    assert page.layer == measure_layer_bytes(shape, 3, torch.bfloat16)
    assert all(r.measured_bytes == r.formula_bytes for r in page.layer)
    assert page.models == model_rollback_table() and page.k3 == PRESETS["kimi-k3"]


def test_rollback_page_validation():
    with pytest.raises(ValueError, match="dtype_name"):
        rollback_page((1, 16, 16, 4, 64), 2, "fp8")
    with pytest.raises(ValueError, match="num_draft"):
        rollback_page((1, 16, 16, 4, 64), -1, "fp32")
