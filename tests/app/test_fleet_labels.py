"""Pages 11 and 12 name routers as people do ("round robin", "mod-N", "bounded loads"), never by their code names
(``round_robin``, ``mod_n``, ``bounded_load``), in chart legends, chart categories and tables; and their widgets
for the real replica only offer GPUs and TP sizes the model's weights fit in."""
import json

import pytest

from serve.fleet import ROUTERS
from tests.app.page_helpers import open_page, plotly_values

CODE_NAMES = set(ROUTERS)


def _shown_names(at) -> set[str]:
    names = set()
    for chart in at.get("plotly_chart"):
        for trace in json.loads(chart.proto.spec)["data"]:
            names.add(str(trace.get("name", "")))
            if trace.get("x") is not None:
                names |= {str(x) for x in plotly_values(trace["x"])}
    for table in at.dataframe:
        for col in table.value.columns:
            if table.value[col].dtype == object:
                names |= set(map(str, table.value[col]))
    names |= {str(o) for box in at.selectbox for o in box.options}
    names |= {str(o) for box in at.multiselect for o in box.options}
    return names


@pytest.mark.parametrize("path", ["app_pages/11_fleet_hashing.py", "app_pages/12_fleet_scaling.py"])
def test_no_code_names_on_fleet_pages(path):
    at = open_page(path)
    leaked = _shown_names(at) & CODE_NAMES
    assert not leaked, f"{path} shows code names {sorted(leaked)}"


def test_real_replica_widgets_offer_only_what_fits():
    """Kimi K3 fits only 16 x H200 or 16 x B200: picking it leaves those GPUs, TP 16, and no error."""
    from lab.real_scale import free_bytes
    from serve.scale.hardware import hardware
    at = open_page("app_pages/12_fleet_scaling.py", p12_model="kimi-k3")
    gpu = next(b for b in at.selectbox if b.key == "p12_gpu")
    assert list(gpu.options) == ["H200", "B200"] and gpu.value == "H200"
    assert not any(s.key == "p12_tp" for s in at.select_slider)      # one TP fits (16): nothing to choose
    budget = next(m for m in at.metric if m.label == "cache per replica").value
    assert budget == f"{free_bytes('kimi-k3', hardware('H200'), 16) / 8 / 1e9:,.0f} GB"
    assert "Kimi K3, 16 × H200" in " ".join(md.value for e in at.expander for md in e.markdown)


@pytest.mark.parametrize(("path", "model_key", "gpu_key"), [("app_pages/13_fleet_budgets.py", "p13_model", "p13_gpu"),
                                                            ("app_pages/14_fleet_simulation.py", "p14_real_model", "p14_gpu")])
def test_every_fleet_page_offers_only_what_fits(path, model_key, gpu_key):
    """Pages 13 and 14 share the real-replica widgets: Kimi K3 leaves the GPUs it fits (no "weights do not fit"
    error, which open_page would fail on) and names the replica by the model's name."""
    at = open_page(path, **{model_key: "kimi-k3"})
    gpu = next(b for b in at.selectbox if b.key == gpu_key)
    assert list(gpu.options) == ["H200", "B200"]
    assert "kimi-k3" not in " ".join(c.value for c in at.caption) + " ".join(h.value for h in at.subheader)
