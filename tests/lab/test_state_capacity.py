"""lab.state_capacity: requests per GPU per state format at the real models' bytes, and the low-decay probe."""
import pytest

from lab.state_capacity import capacity_table, low_decay_probe, slot_bytes, slot_parts
from lab.state_dtype import slot_table
from serve.scale.model_shape import preset


def test_capacity_table_at_real_bytes():
    cap = capacity_table(4096)
    for model in ("kimi-linear-48b-a3b", "kimi-k3"):
        shape, c = preset(model), cap[cap.model == model].set_index("format")
        tp = int(c.tp.iloc[0])
        assert slot_bytes(model, "fp32", tp) == shape.num_kda_layers * shape.kda_state_bytes_layer / tp
        assert c.loc["fp8_e4m3", "max_requests"] > c.loc["bf16", "max_requests"] > c.loc["fp32", "max_requests"] > 0
    assert cap.loc[(cap.model == "kimi-linear-48b-a3b") & (cap.format == "fp32"), "tp"].item() == 1


def test_low_decay_probe_state_stays_near_the_values():
    """The delta rule replaces what a key already holds: with beta = 1 and near-zero decay |S| stays within a
    small multiple of max |v| instead of growing with T."""
    df = low_decay_probe(256, decay=1e-6)
    assert len(df) == 256 and (df.max_abs_state <= 4 * df.max_abs_value).all()


def test_bad_input():
    with pytest.raises(ValueError, match="model"):
        slot_bytes("gpt", "fp32", 1)
    with pytest.raises(ValueError, match="fp7"):
        slot_bytes("kimi-k3", "fp7", 16)
    with pytest.raises(ValueError, match="gpu"):
        capacity_table(4096, "TPU")
    with pytest.raises(ValueError, match="decay"):
        low_decay_probe(8, decay=1.5)


def test_slot_parts_add_up_to_the_figures_the_pages_show():
    """Kimi-Linear's fp32 state on pages 03 / 17: recurrent + bf16 conv is capacity_table's slot (43,417,600 B) and
    recurrent + fp32 conv is our engine layout's (slot_table, 44,892,160 B), so the labelled parts agree."""
    parts = slot_parts("kimi-linear-48b-a3b")
    assert parts.recurrent_fp32 + parts.conv_bf16 == slot_bytes("kimi-linear-48b-a3b", "fp32", 1) == 43_417_600
    engine = slot_table(max_model_len=256, max_num_seqs=4)
    fp32 = engine[(engine.model == "kimi-linear-48b-a3b") & (engine.state_dtype == "fp32")].state_bytes.item()
    assert parts.recurrent_fp32 + parts.conv_fp32 == fp32 == 44_892_160
    with pytest.raises(ValueError, match="model"):
        slot_parts("kimi-linear")
