"""``python -m conformance``: its options (bad ones exit 2 with argparse's message), a run against a running server
(exit 0, the table, the JSON report; settings the server cannot take per request are not applicable, saying to
use --launch), exit 1 on a failure, and an engine that does not start."""
from __future__ import annotations

import json
import sys

import pytest

from conformance.__main__ import main
from conformance.launch import Launched
from conformance.ours import Ours, serve_in_process
from conformance.registry import CHECKS, select_checks
from conformance.report import Status
from conformance.suite import RunSettings, run_suite
from tests.conformance.bugs import state_not_restored

SERVER = ["--max-model-len", "512", "--max-num-seqs", "4"]


def test_list_names_every_check_and_its_sources(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"{cid}:" in out for cid in CHECKS) and "https://github.com/vllm-project/vllm/issues/43090" in out


@pytest.mark.parametrize("argv, message", [
    ([], "one of the arguments --base-url --launch --list is required"),
    (["--base-url", "http://127.0.0.1:1"], "--model is required with --base-url"),
    (["--launch", "x", "--checks", "nope"], "unknown check(s) ['nope']"),
    (["--launch", "x", "--chunk-sizes", "16,0"], "must be ints >= 1"),
    (["--launch", "x", "--grid", "16:50"], "INTERVAL a multiple of BLOCK"),
    (["--launch", "x", "--engine", "tgi"], "invalid choice: 'tgi'"),
    (["--launch", "x", "--json", "/no/such/folder/out.json"], "folder '/no/such/folder' does not exist"),
    (["--launch", "x", "--note", "version"], "--note must be KEY=VALUE"),
], ids=["no-target", "no-model", "unknown-check", "chunk-0", "grid", "engine", "json-folder", "note"])
def test_bad_options_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: python -m conformance") and message in err, err


def test_a_run_against_a_running_server(tmp_path, capsys):
    out = tmp_path / "report.json"
    with serve_in_process(SERVER) as (url, model):
        status = main(["--base-url", url, "--model", model, "--checks", "prefix_hit,state_hit_metrics",
                       "--max-tokens", "6", "--seed", "5", "--json", str(out), "--note", "version=test"])
    assert status == 0
    table = capsys.readouterr().out
    assert "pass    prefix_hit" in table and "pass    state_hit_metrics" in table
    report = json.loads(out.read_text())
    assert [c["id"] for c in report["checks"]] == ["prefix_hit", "state_hit_metrics"]
    assert report["settings"]["seed"] == 5 and report["settings"]["version"] == "test"
    shared = next(p for p in report["checks"][0]["parts"] if p["name"] == "shared prefix")
    assert shared["status"] == "n/a" and "--launch" in shared["summary"]    # our cache toggle is a start-up flag


def test_a_failure_exits_1(monkeypatch, capsys):
    state_not_restored(monkeypatch)
    with serve_in_process(SERVER) as (url, model):
        assert main(["--base-url", url, "--model", model, "--checks", "prefix_hit", "--max-tokens", "6"]) == 1
    assert "fail    prefix_hit" in capsys.readouterr().out


def test_an_engine_that_does_not_start_fails_its_checks_with_its_exit_status():
    target = Launched(Ours(), [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"], "m", 20)
    result = run_suite(target, select_checks(["cache_order"]), RunSettings(seed=1)).results[0]
    assert result.status is Status.FAIL
    assert "did not start" in result.summary and "exit status 3" in result.summary and "no such model" in result.summary


def test_an_adapter_not_run_here_says_so(capsys):
    """vLLM's and SGLang's adapters are written from their docs and code: a report through them says so first."""
    with serve_in_process(SERVER) as (url, model):
        assert main(["--engine", "vllm", "--base-url", url, "--model", model, "--checks", "state_hit_metrics"]) == 0
    out = capsys.readouterr().out
    assert "note: the vllm adapter is written from its docs and code and has not been run against it here" in out
    assert "n/a     state_hit_metrics" in out                # vLLM counts one prefix-cache hit
