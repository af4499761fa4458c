"""Page 18: the invariants with their sources and the how-to render at once, the llama.cpp section says the run is
absent (lab.shipped's note) until its JSON exists, and the live run of our engine waits for its button, then shows
each check's status (one check picked here: the suite's own tests run them all)."""
from __future__ import annotations

from streamlit.testing.v1 import AppTest

import lab.conformance as lc
from conformance.suite import RunSettings
from lab.shipped import missing_note
from tests.app.page_helpers import APP

PAGE = "app_pages/18_conformance.py"


def test_page_renders_then_runs_on_request(monkeypatch, tmp_path):
    monkeypatch.setattr(lc, "LIVE_SETTINGS", RunSettings(max_tokens=2, seed=0))
    monkeypatch.setattr(lc, "result_path", lambda bench: tmp_path / f"{bench}.json")      # no recorded run
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    at.switch_page(PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    text = " ".join(m.value for m in at.markdown)
    assert all(f"(`{cid}`)" in text for cid in lc.CHECKS) and "https://github.com/vllm-project/vllm/issues/43090" in text
    assert [c.value for c in at.code][0].startswith("python -m conformance")
    assert missing_note(lc.LLAMA_CPP_BENCH) in [i.value for i in at.info]
    assert not at.success and "Run the checks against our engine" in [b.label for b in at.button]
    at.multiselect(key="p18_checks").set_value(["state_hit_metrics"]).run()
    at.button(key="p18_live_button").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert [s.value for s in at.success][0].startswith("1 of 1 checks pass")


def test_the_recorded_llama_cpp_run_shows_its_version_date_and_findings():
    rec = lc.recorded_llama_cpp()
    assert rec is not None, "bench/results/conformance_llama_cpp.json is committed"
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    at.switch_page(PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(c.value.startswith(f"llama.cpp {rec.version}, run {rec.date}") for c in at.caption)
    text = " ".join(m.value for m in at.markdown)
    assert rec.findings and all(f in text for f in rec.findings)
