"""Page 01's last section (ReplaySSM as the batched engine's decode-time state write): the predicted bytes chart
renders at defaults with the ring widget, and the engine measurement waits behind its button."""
from pathlib import Path

from streamlit.testing.v1 import AppTest

PAGE = str(Path(__file__).resolve().parents[2] / "app_pages" / "01_snapshot_vs_projection.py")


def test_state_write_section_first_render():
    at = AppTest.from_file(PAGE, default_timeout=120).run()
    assert not at.exception, [e.value for e in at.exception]
    charts = {c.proto.id.rsplit("-", 1)[-1] for c in at.get("plotly_chart")}
    assert any(c.endswith("p01_state_write_bytes") for c in charts), charts
    assert not any(c.endswith("p01_state_write_steps") for c in charts), "the sweep ran before its button"
    assert "p01_sweep_button" in [b.key for b in at.button]   # the acceptance section above has its own button
    assert at.select_slider(key="p01_ring").value == 16
