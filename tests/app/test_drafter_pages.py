"""Pages 01, 02 and 04 default to a real drafter (prompt lookup) on the trained target; the noisy oracle is a
labelled controlled experiment whose slider shows only when chosen (old ``p02_accept`` links still pick it); the
acceptance-per-position section runs behind its button and draws a chart with units, code vs prose."""
import pytest
from streamlit.testing.v1 import AppTest

from tests.app.page_helpers import APP, chart_spec, open_page, plotly_values

P01, P02 = "app_pages/01_snapshot_vs_projection.py", "app_pages/02_verify_and_replay.py"


@pytest.mark.parametrize(("path", "prefix"), [(P01, "p01"), (P02, "p02")])
def test_pages_default_to_prompt_lookup_without_the_oracle_slider(path, prefix):
    at = open_page(path)
    assert at.selectbox(key=f"{prefix}_drafter").value == "n-gram"
    assert all(s.key != f"{prefix}_accept" for s in at.slider)
    if path == P01:                                  # page 02's oracle: the link test below
        at.selectbox(key=f"{prefix}_drafter").set_value("noisy oracle").run()
        assert not at.exception and at.slider(key=f"{prefix}_accept").value == 0.7


def test_an_old_oracle_link_still_sets_the_oracle():
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update(p02_accept="0.4", p02_seed="3")
    at.run()
    at.switch_page(P02).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="p02_drafter").value == "noisy oracle" and at.slider(key="p02_accept").value == 0.4
    assert at.slider(key="p02_seed").value == 3


def test_acceptance_section_behind_its_button():
    at = open_page(P01, p01_draft=3)
    assert not any(c.proto.id.endswith("p01_acceptance_chart") for c in at.get("plotly_chart"))
    at.button(key="p01_acceptance_button").click().run()
    assert not at.exception, [e.value for e in at.exception]
    fig = chart_spec(at, "p01_acceptance_chart")
    assert "%" in fig["layout"]["yaxis"]["title"]["text"] and "position" in fig["layout"]["xaxis"]["title"]["text"]
    assert [t["name"] for t in fig["data"]] == ["code", "prose"]
    for trace in fig["data"]:
        rates = plotly_values(trace["y"])
        assert len(rates) == 3 and all(a >= b for a, b in zip(rates, rates[1:])), rates
    table = next(d.value for d in at.dataframe if "matches_plain" in d.value.columns)
    assert (table["matches_plain"] == "yes").all()
