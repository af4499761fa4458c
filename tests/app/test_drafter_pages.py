"""Pages 01, 02 and 04 default to a real drafter (prompt lookup) on the trained target; the noisy oracle is a
labelled controlled experiment whose slider shows only when chosen (old ``p02_accept`` links still pick it); the
acceptance-per-position section runs behind its button and draws a chart with units, code vs prose."""
import pytest
from streamlit.testing.v1 import AppTest

from lab.drafters import bench_drafters
from tests.app.page_helpers import APP, chart_spec, open_page, plotly_values

P01, P02 = "app_pages/01_snapshot_vs_projection.py", "app_pages/02_verify_and_replay.py"


@pytest.mark.parametrize(("path", "prefix"), [(P01, "p01"), (P02, "p02")])
def test_pages_default_to_prompt_lookup_without_the_oracle_slider(path, prefix):
    at = open_page(path)
    assert at.selectbox(key=f"{prefix}_drafter").value == "n-gram"
    assert at.selectbox(key=f"{prefix}_drafter").options[0] == "prompt lookup (n-gram)"   # one name, as the text has it
    assert at.radio(key=f"{prefix}_acceptance_size").value == "bench"                   # the bench's conditions (bench/README.md)
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
    """The quick run (the bench's prompts take 30-60 s) behind the button; its caption states this run's conditions
    beside the bench's (bench/README.md's table) and the bench's accepted drafts of both real drafters, so the page and
    bench/README.md never read as a contradiction; the y title is short enough not to be cut (it was cut at "dra")."""
    at = open_page(P01, p01_draft=3, p01_acceptance_size="quick")
    assert at.radio(key="p01_acceptance_size").value == "quick"
    assert not any(c.proto.id.endswith("p01_acceptance_chart") for c in at.get("plotly_chart"))
    at.button(key="p01_acceptance_button").click().run()
    assert not at.exception, [e.value for e in at.exception]
    fig = chart_spec(at, "p01_acceptance_chart")
    ytitle = fig["layout"]["yaxis"]["title"]["text"]
    assert "%" in ytitle and len(ytitle) <= 30 and "position" in fig["layout"]["xaxis"]["title"]["text"]
    shipped = bench_drafters().summary.set_index(["drafter", "kind"]).mean_accepted
    caption = next(c.value for c in at.caption if c.value.startswith("This page's run:"))
    assert caption.startswith("This page's run: 2 prompts per kind of ≤ 192 bytes, 32 bytes generated after each, "
                              "n = 3; the bench's (`bench/results/drafters.json`, bench/README.md's table): 6 prompts per "
                              "kind of ≤ 256 bytes, 96 bytes each, n = 6, where prompt lookup (n-gram) accepted "
                              f"code {shipped['n-gram', 'code']:.2f}, prose {shipped['n-gram', 'prose']:.2f} drafts "
                              f"per verify vs draft model's code {shipped['draft model', 'code']:.2f}"), caption
    assert "prompt lookup copies those loops" in caption
    assert [t["name"] for t in fig["data"]] == ["code", "prose"]
    for trace in fig["data"]:
        rates = plotly_values(trace["y"])
        assert len(rates) == 3 and all(a >= b for a, b in zip(rates, rates[1:])), rates
    table = next(d.value for d in at.dataframe if "matches_plain" in d.value.columns)
    assert (table["matches_plain"] == "yes").all()
