"""Page 15 behind its button: the policy sweep draws hit ratio and TTFT against the budget and the state
interval, and names what to choose (the policy with the lowest mean TTFT per budget, the best interval)."""
from tests.app.test_pages import _check, _fresh
from tests.app.verdicts import chart_spec, plotly_values

PAGE = "pages/15_real_scale.py"


def test_sweep_shows_ttft_against_the_interval_and_a_choice():
    at = _fresh(PAGE)
    at.slider(key="p15_requests").set_value(1000).run()
    at.session_state["p15_sweep_on"] = True     # what the button sets (AppTest does not follow its st.rerun)
    at.run()
    _check(at, f"{PAGE} sweep")
    hit = {t["name"]: plotly_values(t["y"]) for t in chart_spec(at, "p15_interval_chart")["data"]}
    ttft = {t["name"]: plotly_values(t["y"]) for t in chart_spec(at, "p15_interval_ttft_chart")["data"]}
    assert set(ttft) == set(hit) == {"ours", "SGLang extra_buffer"}
    assert all(len(v) == 5 and min(v) > 0 for v in ttft.values())
    choice = next(m.value for m in at.markdown if m.value.startswith("**What to choose"))
    best = min(ttft["ours"])
    assert "ours → " in choice and f"({best:.1f} ms)" in choice, choice
