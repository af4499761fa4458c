"""What each page must show for the sweep in test_pages.py to pass, besides "no exception" and no
``st.error`` outside tests/app/allowed_errors.py.

``VERDICTS``: per page, a check of the page's own positive verdict (outputs identical, bitwise equal,
hit as the lookup rule predicts, equal within 1e-5, ...) read from the rendered elements. Each check
holds at every widget setting the sweep visits and fails when its verdict element is missing.

Pages without a verdict (03, 06, 12) show byte formulas, timings or fractions with no pass/fail claim.
"""
from __future__ import annotations

import math
import re

from streamlit.testing.v1 import AppTest

from kda_core.chunk import CHUNK_SIZE
from lab.drafters import DRAFTER_LABELS
from lab.fleet import DISPLAY_NAMES
from lab.prefix import WARM_TOLERANCE, shared_prefix_prompts
from tests.app.page_helpers import chart_spec, plotly_values

LOGIT_TOL = WARM_TOLERANCE   # cache-on vs cache-off logits: the pages print "≤ 5e-5 required" (fp32, chunked vs split prefill)


def _metric(at: AppTest, label: str):
    found = [m for m in at.metric if m.label == label]
    assert found, f"no metric {label!r}; metrics: {[m.label for m in at.metric]}"
    return found[0]


def _widget(at: AppTest, key: str):
    return next(w for w in [*at.slider, *at.select_slider, *at.selectbox, *at.text_area, *at.number_input]
                if w.key == key).value


def _one(texts: list[str], pattern: str, where: str) -> re.Match:
    found = [m for m in (re.search(pattern, t) for t in texts) if m]
    assert found, f"{where}: no text matches {pattern!r}"
    return found[0]


def expected_hit(earlier: list[list[int]], last: list[int], block: int, interval: int) -> int:
    """Hit b of ``last`` after each of ``earlier`` went through a cache (checkpoint every group at once),
    restated from the engine's documented rules rather than read from its cache: a checkpoint at b of
    prompt p is usable if ``last`` shares p's first b tokens; p (length L) writes checkpoints at every
    multiple of C up to L, at floor((L-1)/N)·N and at floor(L/N)·N; b is the largest usable one
    <= min(KV run, len(last) - 1), the KV run being the whole blocks shared with a cached prompt."""
    kv, usable = 0, set()
    for p in earlier:
        common = next((i for i, (a, b) in enumerate(zip(p, last)) if a != b), min(len(p), len(last)))
        kv = max(kv, common // block * block)
        L = len(p)
        usable |= {b for b in {*range(interval, L + 1, interval), (L - 1) // block * block, L // block * block}
                   if 0 < b <= common}
    return max((b for b in usable if b <= min(kv, len(last) - 1)), default=0)


def _home(at: AppTest) -> None:
    ok = _one([s.value for s in at.success], r"^Outputs identical to the cache-off run: (\d+) greedy tokens, "
              r"max \|Δ logits\| = (\S+) ", "home")
    assert int(ok.group(1)) == _widget(at, "p00_new"), ok.group(0)
    assert float(ok.group(2)) <= LOGIT_TOL, ok.group(0)
    hit = _one([c.value for c in at.caption], r"^Hit: (\d+) of (\d+) tokens", "home")
    first, second = (list(_widget(at, k).encode()) for k in ("p00_first", "p00_second"))
    want = expected_hit([first], second, _widget(at, "p00_block"), _widget(at, "p00_interval_c"))
    if want and want % CHUNK_SIZE == 0:  # a prefill checkpoint on the chunk grid: the warm run is bitwise
        assert "logits bitwise equal" in ok.string, f"home: hit b = {want} is on the grid: {ok.string!r}"
    assert (int(hit.group(1)), int(hit.group(2))) == (want, len(second)), f"home: hit {hit.group(0)!r}, expected b = {want}"
    bars = chart_spec(at, "p00_tokens_chart")["data"]            # cold, request 1, warm: reused + prefilled
    reused, prefilled = (plotly_values(t["x"]) for t in bars[:2])
    assert reused == [0, 0, want], f"home: tokens chart reuses {reused}, expected b = {want} for the warm run only"
    assert [a + b for a, b in zip(reused, prefilled)] == [len(second), len(first), len(second)], (reused, prefilled)


def _p01(at: AppTest) -> None:
    table = next(d.value for d in at.dataframe if "matches" in d.value.columns)   # "Measured = formula": yes / no
    assert (table["matches"] == "yes").all(), table[["strategy", "measured_bytes", "formula_bytes"]]


def _p02(at: AppTest) -> None:
    _one([s.value for s in at.success], r"^Bitwise equal: max \|state − sequential reference\| = 0\.0 at all \d+ steps",
         "02")
    if _widget(at, "p02_mode") == "interrupted":
        assert _metric(at, "Caches untouched · retry equal").value == "yes · yes"
    rates = plotly_values(chart_spec(at, "p02_position_chart")["data"][0]["y"])   # unconditional: falls with i
    assert len(rates) == _widget(at, "p02_draft") and all(a >= b for a, b in zip(rates, rates[1:])), rates


def _p04(at: AppTest) -> None:
    sizes = _one([m.value for m in at.markdown], r"\*\*(\d+) forced write-backs?\*\*", "04")
    crosses = next(t for t in chart_spec(at, "p04_occupancy_chart")["data"] if t["name"].startswith("forced write-back"))
    assert len(plotly_values(crosses.get("x", []))) == int(sizes.group(1)), f"04: text {sizes.group(0)!r} vs chart"
    steps = chart_spec(at, "p04_occupancy_chart")["data"][0]
    assert max(plotly_values(steps["y"])) <= _widget(at, "p04_capacity"), "04: more slots in use than the capacity"
    name = re.escape(DRAFTER_LABELS[_widget(at, "p04_drafter")])                 # one name: "prompt lookup (n-gram)"
    _one([m.value for m in at.markdown], f"from the {name}( \\(controlled, p = [\\d.]+\\))? drafter \\(\\d+ accepted", "04")


def _p05(at: AppTest) -> None:
    """The caption's claim: a static sub-pool never goes above its dashed size line."""
    fig = chart_spec(at, "p05_util")
    caps = {s["yref"]: s["y0"] for s in fig["layout"]["shapes"] if s["y0"] == s["y1"]}
    static = [t for t in fig["data"] if t["name"].startswith("static split")]
    assert len(static) == 2 and len(caps) == 2
    for t in static:
        assert max(plotly_values(t["y"])) <= caps[t.get("yaxis", "y")] + 1e-9, t["name"]
    grid = chart_spec(at, "p05_grid")["data"][0]            # readable at any pool size: pages aggregate into cells
    z = grid["z"]
    rows = int(str(z["shape"]).split(",")[0]) if isinstance(z, dict) else len(z)   # a typed array carries its shape
    assert 0 < rows <= 48, f"pool grid has {rows} rows"


def _p07(at: AppTest) -> None:
    prompts = [list(line.encode()) for line in _widget(at, "p07_prompts").splitlines() if line.strip()]
    hit = _one([m.value for m in at.markdown], r"\*\*Hit b = (\d+) tokens\*\*", "07")
    block = _widget(at, "p07_block")
    want = expected_hit(prompts[:-1], prompts[-1], block, block * _widget(at, "p07_every"))
    assert int(hit.group(1)) == want, f"07: page says b = {hit.group(1)}, the rule gives {want}"


def _identical(metric) -> None:
    assert metric.value == "yes", f"{metric.label}: {metric.value}"
    assert float(metric.proto.delta.removeprefix("max |Δ logits| ")) <= LOGIT_TOL, metric.proto.delta


def _p08(at: AppTest) -> None:
    out = _metric(at, "Warm vs cache-off output")
    assert out.value in ("bitwise", "within 1e-5"), f"08: warm vs cache-off output {out.value!r}"
    assert float(out.proto.delta.removeprefix("max |Δ logits| ")) <= LOGIT_TOL, out.proto.delta
    first, second = shared_prefix_prompts(_widget(at, "p08_shared"), _widget(at, "p08_unique"), seed=0)
    want = expected_hit([first], second, _widget(at, "p08_block"), _widget(at, "p08_interval"))
    if want and want % CHUNK_SIZE == 0:  # a prefill checkpoint on the chunk grid: the warm run is bitwise
        assert out.value == "bitwise", f"08: hit b = {want} is on the {CHUNK_SIZE}-token grid, output {out.value!r}"
    shown = _metric(at, "Prefill tokens skipped").value
    assert shown == f"{want:,} of {len(second):,}", f"08: skipped {shown!r}, the rule gives b = {want}"


def _p09(at: AppTest) -> None:
    _identical(_metric(at, "Next output identical"))
    prompt = _widget(at, "p09_prompt")
    first = shared_prefix_prompts(prompt, 0, 0)[0]                       # as lab.prefix.miss_then_hit builds them
    second = first[:min(_widget(at, "p09_next"), prompt)] + shared_prefix_prompts(16, 0, 1)[0]
    want = expected_hit([first], second, _widget(at, "p09_block"), _widget(at, "p09_interval"))
    shown = _metric(at, "Next request: hit b").value
    assert shown == f"{want} tokens", f"09: hit b {shown!r}, the rule gives {want}"
    if not any(c.proto.id.endswith("p09_capacity_chart") for c in at.get("plotly_chart")):
        return                                          # the trace replay runs behind its button (test_heavy_extras)
    fig = chart_spec(at, "p09_capacity_chart")                          # no capacity beats an infinite cache
    for unit in ("block", "token"):
        ideal = next(t for t in fig["data"] if t["name"].startswith(f"ideal {unit} ratio"))
        measured = next(t for t in fig["data"] if t["name"].startswith(f"{unit} hit ratio"))
        assert max(plotly_values(measured["y"])) <= plotly_values(ideal["y"])[0] + 1e-12, unit


def _p10(at: AppTest) -> None:
    ok = _one([m.value for m in at.markdown], r"^\*\*\d+ rank\(s\), \w+: (.*)\*\* \(worst max \|Δ\| = (\S+), fp32\)", "10")
    assert ok.group(1) == "equal within 1e-5" and float(ok.group(2)) <= 1e-5, ok.group(0)


def _percent(text: str) -> float:
    assert text.endswith("%"), text
    return float(text[:-1].replace(",", "")) / 100


SHOWN_PCT_TOL = 0.0015   # three values each rounded to 0.1 % for display: at most 3 x 0.05 percentage points


def _p11(at: AppTest) -> None:
    """The replicas' caches never beat one infinite shared cache; with policy caches, neither do their hits plus
    the KV they held without a state to reuse it."""
    hit = _percent(_metric(at, "token hit ratio (per-replica caches)").value)
    ideal = _percent(_metric(at, "block ideal").value)
    assert hit <= ideal, f"11: per-replica hit {hit} above the one-shared-cache ideal {ideal}"
    lost = [m for m in at.metric if m.label == "KV cached, no state to reuse it"]
    if lost:
        assert hit + _percent(lost[0].value) <= ideal + SHOWN_PCT_TOL, f"11: hit {hit} + lost {lost[0].value} > {ideal}"


def _p12(at: AppTest) -> None:
    """Each trace is paired with its own no-event replay: the change is exactly 0 before the event; no
    algorithm's no-event hit ratio (plus KV held without a state) beats the block ideal."""
    fig = chart_spec(at, "p12_dip_chart")
    at_request = next(s["x0"] for s in fig["layout"]["shapes"] if s["x0"] == s["x1"])
    for t in (t for t in fig["data"] if t.get("name")):          # the lines (the bands have no name)
        xs, ys = plotly_values(t["x"]), plotly_values(t["y"])
        window = xs[1] - xs[0] if len(xs) > 1 else math.inf
        before = [y for x, y in zip(xs, ys) if x + window <= at_request]   # windows that end before the event
        assert all(y == 0 for y in before), f"12: {t['name']} changes before the event: {before[:5]}"
    ideal = _percent(_metric(at, "block ideal").value)
    table = next(d.value for d in at.dataframe if "hit_ratio_no_event" in d.value.columns)
    shown = table.hit_ratio_no_event / 100 + (table.lost_no_event / 100 if "lost_no_event" in table else 0)
    assert (shown <= ideal + SHOWN_PCT_TOL).all(), f"12: no-event hit ratios {list(shown)} above the ideal {ideal}"


def _p13(at: AppTest) -> None:
    """The caption's claim: a class's admitted tokens never cross its budget line (burst + rate · t); and the
    cost of isolation is shown: the bursting class's P50 with isolation, with its change vs without."""
    burst = [m for m in at.metric if "(bursting) P50" in m.label]
    assert burst and burst[0].delta and burst[0].delta.endswith("vs without"), [m.label for m in at.metric]
    pays = next(c.value for c in at.caption if "What to notice" in c.value)   # the caption says what the delta shows
    assert ("class pays" in pays) == (float(burst[0].delta.split()[0].replace(",", "")) > 0), (pays, burst[0].delta)
    for box in chart_spec(at, "p13_ttft_chart")["data"]:   # min <= P25 <= P50 <= P75 <= P99 per class
        stats = [plotly_values(box[k]) for k in ("lowerfence", "q1", "median", "q3", "upperfence")]
        assert all(a <= b for lo_hi in zip(*stats) for a, b in zip(lo_hi, lo_hi[1:])), (box["name"], stats)
    if any("No bucketed class admitted" in i.value for i in at.info):
        return
    data = chart_spec(at, "p13_budget_chart")["data"]
    assert data
    for admitted in (t for t in data if t["name"].endswith(": admitted")):
        budget = next(t for t in data if t["name"] == admitted["name"].replace("admitted", "budget (burst + rate·t)"))
        assert plotly_values(admitted["x"]) == plotly_values(budget["x"])
        over = [(t, a, b) for t, a, b in zip(plotly_values(admitted["x"]), plotly_values(admitted["y"]),
                                             plotly_values(budget["y"])) if a > b + 1e-6]
        assert not over, f"{admitted['name']} above its budget at (t, admitted, budget) {over[:3]}"


def _p14(at: AppTest) -> None:
    fig = chart_spec(at, "p14_hit_chart")
    ideal = next(s["y0"] for s in fig["layout"]["shapes"] if s["y0"] == s["y1"])
    assert max(plotly_values(fig["data"][0]["y"])) <= ideal + 1e-12, "a policy beat one infinite shared cache"
    bars = chart_spec(at, "p14_balance_chart")["data"][0]   # what bounded loads bounds: it never routes above its cap
    over = dict(zip(bars["x"], plotly_values(bars["y"])))
    bounded = DISPLAY_NAMES["bounded_load"]                   # the bars are named by display name
    assert bounded in over, f"bounded loads runs at the page's defaults, bars {list(over)}"
    assert over[bounded] == 0.0, f"bounded loads routed {over[bounded]:.1%} above its cap"
    if not any(c.proto.id.endswith("p14_kda_chart") for c in at.get("plotly_chart")):
        return                                          # an A10G / CPU replica: no policy cache
    kda = chart_spec(at, "p14_kda_chart")   # hit + KV-without-state <= what one infinite shared cache holds
    ideal = next(s["y0"] for s in kda["layout"]["shapes"] if s["y0"] == s["y1"])
    hit, lost = (plotly_values(t["y"]) for t in kda["data"][:2])
    assert all(0 <= h and 0 <= lo and h + lo <= ideal + 1e-12 for h, lo in zip(hit, lost)), (hit, lost, ideal)
    held = chart_spec(at, "p14_bytes_chart")
    stacks = [plotly_values(t["y"]) for t in held["data"]]
    assert max(stacks[0]) > 0 and all(v > 0 for v in stacks[2]), "no replica cached KV, or one reserved no slot"
    budget = [s["y0"] for s in held["layout"].get("shapes", []) if s["y0"] == s["y1"]]
    totals = [sum(v) for v in zip(*stacks)]     # bytes held when each replica's cache peaked: within its budget
    assert len(budget) == 1 and max(totals) <= budget[0] * (1 + 1e-12), (max(totals), budget)


def _p15(at: AppTest) -> None:
    """Fitted, physical and published ratios labelled apart; the ratio table is the chosen setup's (one setup), its
    rows held out (prefill, on the setup the one fit was made on) or predicted, its error the model's against the
    published; no policy above the ideal."""
    ratio = chart_spec(at, "p15_ratio_chart")["data"]
    names = {t["name"] for t in ratio}
    assert {"prefill (Fig. 7a): published", "TPOT, batch 1 (Fig. 7b): physical roofline",
            "TPOT, batch 1 (Fig. 7b): published"} <= names, names
    assert len({"prefill (Fig. 7a): fitted (MLA held out)", "prefill (Fig. 7a): predicted, α · β of H100 x TP8"}
               & names) == 1, names
    assert all(plotly_values(t["y"]) and min(plotly_values(t["y"])) > 0 for t in ratio)
    for key in ("p15_prefill_chart", "p15_tpot_chart", "p15_batch_chart"):
        labels = " | ".join(t["name"] for t in chart_spec(at, key)["data"])
        assert "physical roofline" in labels and "published" in labels, (key, labels)
    assert "fitted" in " | ".join(t["name"] for t in chart_spec(at, "p15_prefill_chart")["data"])
    table = next(d.value for d in at.dataframe if "setup" in d.value.columns and "quantity" in d.value.columns)
    assert len(table) and table.setup.nunique() == 1, table
    assert "predicted" in set(table.role) and set(table.role) <= {"held out", "predicted"}, table
    assert (table.role == "held out").any() == (table.setup.iloc[0] == "H100 x TP8"), table
    error = table.model / table.published - 1                         # shown in percent (app_pages.charts.pct)
    assert ((table.rel_error / 100 - error).abs() < 1e-9).all(), table
    if not any(c.proto.id.endswith("p15_hit_chart") for c in at.get("plotly_chart")):
        return                                          # the policy sweep runs behind its button
    fig = chart_spec(at, "p15_hit_chart")["data"]
    ideal = next(t for t in fig if t["name"].startswith("block ideal"))
    for t in fig:
        if t is not ideal:
            assert max(plotly_values(t["y"])) <= plotly_values(ideal["y"])[0] + 1e-12, t["name"]


def _p17(at: AppTest) -> None:
    """Every format admits at least fp32's requests (fewer bytes per slot, same free memory); the shipped engine
    run draws one agreement line per 16-bit dtype, fractions in [0, 1]; with the live run
    revealed, fp32 storage is bitwise a plain decode over the chosen number of tokens and its drift is zero."""
    for trace in chart_spec(at, "p17_capacity_chart")["data"]:
        y = plotly_values(trace["y"])
        assert y and all(v >= y[0] for v in y), (trace["name"], y)
    engine = chart_spec(at, "p17_engine_agreement")["data"]            # the shipped engine run: a line per dtype
    assert {t["name"] for t in engine} == {"bf16", "fp16"}
    assert all(0 <= v <= 1 for t in engine for v in plotly_values(t["y"]))
    if not any(c.proto.id.endswith("p17_run_state_rel_err") for c in at.get("plotly_chart")):
        return                                          # the live run is behind its button
    ok = _one([s.value for s in at.success], r"^fp32 storage is bitwise today's decode: logits of (\d+) tokens", "p17")
    assert int(ok.group(1)) == _widget(at, "p17_tokens")
    names = {t["name"] for t in chart_spec(at, "p17_run_state_rel_err")["data"]}
    assert "fp32" not in names and {"bf16", "int8 + error feedback"} <= names, names


VERDICTS = {
    "app_pages/00_home.py": _home, "app_pages/01_snapshot_vs_projection.py": _p01, "app_pages/02_verify_and_replay.py": _p02,
    "app_pages/04_raw_input_ring.py": _p04, "app_pages/05_page_pool.py": _p05, "app_pages/07_prefix_anatomy.py": _p07,
    "app_pages/08_prefix_hit.py": _p08, "app_pages/09_prefix_miss.py": _p09, "app_pages/10_kcp.py": _p10,
    "app_pages/11_fleet_hashing.py": _p11, "app_pages/12_fleet_scaling.py": _p12, "app_pages/13_fleet_budgets.py": _p13, "app_pages/14_fleet_simulation.py": _p14,
    "app_pages/15_real_scale.py": _p15, "app_pages/17_state_precision.py": _p17,
}
