"""The suite against our server, started in this process: every check passes on the server as it is (each part
ran and passed, none skipped), and each check fails once a bug of its class is put into the engine
(:mod:`tests.conformance.bugs`): proof that no check passes whatever the engine does."""
from __future__ import annotations

import pytest

from conformance.launch import InProcess
from conformance.ours import Ours
from conformance.registry import CHECKS, select_checks
from conformance.report import Status
from conformance.suite import RunSettings, run_suite
from tests.conformance.bugs import BUGS

ARGS = ["--max-model-len", "512", "--max-num-seqs", "8"]       # python -m serve.http's flags
SETTINGS = {"seed": 11, "max_tokens": 8, "chunk_sizes": (16, 100)}


def run(ids):
    return run_suite(InProcess(Ours(), ARGS), select_checks(ids), RunSettings(**SETTINGS))


def test_our_server_passes_every_check():
    report = run([])
    assert [r.id for r in report.results] == list(CHECKS)
    bad = [(r.id, p.name, p.status, p.summary) for r in report.results for p in r.parts if p.status is not Status.PASS]
    assert not bad, report.table()
    spec = next(r for r in report.results if r.id == "speculative")
    assert spec.parts[0].evidence["accepted"] > 0, "no draft was accepted: the rollback path did not run"
    assert not report.failed


def test_every_check_has_a_bug():
    assert set(BUGS) == set(CHECKS)


@pytest.mark.parametrize("check_id", list(CHECKS))
def test_a_bug_of_its_class_fails_the_check(check_id, monkeypatch):
    BUGS[check_id](monkeypatch)
    result = run([check_id]).results[0]
    assert result.status is Status.FAIL, result.summary
