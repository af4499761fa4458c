"""Page 15 behind its button: the policy sweep draws hit ratio and TTFT against the budget and the state
interval, names what to choose (the policy with the lowest mean TTFT per budget, the best interval), and
stacks the bytes held at the peak under the budget line."""
from lab.real_scale import BUDGET_FRACTIONS, free_bytes
from serve.scale.hardware import hardware
from tests.app.test_pages import _check, _fresh
from tests.app.verdicts import chart_spec, plotly_values

PAGE = "app_pages/15_real_scale.py"


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
    # the bytes bar: one stack per policy of the default sweep (vLLM all is an opt-in counterfactual), never
    # above the budget line (the old bars stacked per-kind peaks reached at different times and passed it)
    spec = chart_spec(at, "p15_bytes_chart")
    bars = [t for t in spec["data"] if t["type"] == "bar"]
    stacks = [sum(v) for v in zip(*(plotly_values(t["y"]) for t in bars))]
    budget = free_bytes("kimi-linear-48b-a3b", hardware("H200"), 8) * BUDGET_FRACTIONS[3] / 1e9   # the middle one
    assert len(stacks) == 4 and not any("vLLM all" in x for x in bars[0]["x"]), bars[0]["x"]
    assert max(stacks) <= budget * (1 + 1e-12) and min(stacks) > 0, (stacks, budget)
    assert [sh["y0"] for sh in spec["layout"]["shapes"]] == [budget]                    # the budget line


def test_roofline_at_defaults_keeps_fitted_predicted_published_apart():
    """At the defaults (H200 x TP8) the charts label physical roofline / fitted / published, the validation table
    is that setup's (the verdict), the held-out error is a headline, and the largest-batch text sets the roofline
    beside the report's 6.3x and 6x."""
    at = _fresh(PAGE)
    _check(at, PAGE)
    table = next(d.value for d in at.dataframe if "setup" in d.value.columns)
    assert set(table.setup) == {"H200 x TP8"}
    held = table[(table.role == "held out") & (table.context_tokens >= 512 * 1024)]
    assert len(held) == 2 and (held.rel_error.abs() <= 25).all(), table    # percent (app_pages.charts.pct)
    assert any(m.label.startswith("Held-out prefill error") for m in at.metric)
    batch = next(m.value for m in at.markdown if "largest batch its memory holds" in m.value)
    assert "6.25×" in batch and "up to **6×**" in batch and "kernel efficiency" in batch, batch


def test_k3_says_its_fit_comes_from_kimi_linear():
    at = _fresh(PAGE)
    at.selectbox(key="p15_model").set_value("kimi-k3").run()
    _check(at, f"{PAGE} k3")
    note = " ".join(i.value for i in at.info)
    assert "Kimi-Linear-48B-A3B" in note and "unchecked" in note, note
