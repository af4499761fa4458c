"""``lab.conformance``: the invariants table (every check, its sources as links), a report as rows, the recorded
llama.cpp run read from bench/results (None while absent, a clear error for a file that is not a report), and the
live run of our engine (one check here: the suite's own tests run them all)."""
from __future__ import annotations

import json

import pytest

import lab.conformance as lc
from conformance.registry import CHECKS
from conformance.suite import RunSettings


def test_invariants_name_every_check_with_its_sources():
    df = lc.invariants()
    assert list(df["check"]) == list(CHECKS)
    assert all(s.startswith("[") and "](https://github.com/" in s for s in df["sources"])


def test_live_run_of_one_check():
    run = lc.live_run(["state_hit_metrics"], RunSettings(max_tokens=2, seed=0))
    assert list(run.table["check"]) == ["state_hit_metrics"] and list(run.table["status"]) == ["pass"]
    assert json.loads(run.report_json)["checks"][0]["id"] == "state_hit_metrics" and run.seconds > 0
    with pytest.raises(ValueError, match="unknown check"):
        lc.live_run(["nope"])


def test_recorded_run_absent_present_and_malformed(tmp_path, monkeypatch):
    path = tmp_path / "conformance_llama_cpp.json"
    monkeypatch.setattr(lc, "result_path", lambda bench: path)
    assert lc.recorded_llama_cpp() is None
    report = {"engine": "llama.cpp", "target": "llama-server -m x.gguf", "findings": ["speculative: n/a because"],
              "settings": {"version": "b1 (abc)", "date": "2026-12-07"},
              "checks": [{"id": "prefix_hit", "status": "fail", "summary": "token 3 differs",
                          "parts": [{"status": "fail"}, {"status": "n/a"}]}]}
    path.write_text(json.dumps(report))
    rec = lc.recorded_llama_cpp()
    assert (rec.version, rec.date, rec.findings) == ("b1 (abc)", "2026-12-07", ["speculative: n/a because"])
    assert rec.table.to_dict("records") == [{"check": "prefix_hit", "status": "fail", "summary": "token 3 differs",
                                             "parts pass / fail / n/a": "0 / 1 / 1"}]
    path.write_text(json.dumps({"engine": "x"}))
    with pytest.raises(ValueError, match="is not a conformance report"):
        lc.recorded_llama_cpp()


def test_recorded_agreement_reads_the_committed_run(tmp_path, monkeypatch):
    """The three-implementation table: one row per prompt of the committed file; a file of another shape is a
    ValueError naming it, an absent one None."""
    import json

    import lab.conformance as conf

    rec = conf.recorded_agreement()
    assert rec is not None and len(rec.table) == len(json.loads(conf.result_path(conf.AGREEMENT_BENCH).read_text())[
        "prompts"])
    assert set(rec.table["llama.cpp greedy"]) <= {f"all {n}" for n in range(1, 257)} | {
        f"differs at {i}" for i in range(256)}
    bad = tmp_path / f"{conf.AGREEMENT_BENCH}.json"
    bad.write_text(json.dumps({"prompts": [{"prompt": "x"}]}))
    monkeypatch.setattr(conf, "result_path", lambda name: tmp_path / f"{name}.json")
    with pytest.raises(ValueError, match=conf.AGREEMENT_BENCH):
        conf.recorded_agreement()
    bad.unlink()
    assert conf.recorded_agreement() is None
