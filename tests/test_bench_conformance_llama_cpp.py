"""``python -m bench.conformance_llama_cpp``: a finding is kept only while its check has the status it was written
for (else the report says it is yet to be written), a passing check needs none (a note on one is kept), and a missing llama-server or GGUF
ends the command with argparse's message (exit 2) before anything starts."""
from __future__ import annotations

import pytest

from bench.conformance_llama_cpp import findings, main


def test_findings_follow_the_recorded_status():
    report = {"checks": [{"id": "prefix_hit", "status": "pass", "summary": "ok"},
                         {"id": "chunked_prefill", "status": "pass", "summary": "ok"},
                         {"id": "speculative", "status": "n/a", "summary": "no draft"},
                         {"id": "cache_order", "status": "fail", "summary": "token 3 differs"}]}
    written = {"chunked_prefill": ("pass", "a note on a pass"),
               "speculative": ("n/a", "llama.cpp proposes no n-gram draft here"),
               "cache_order": ("n/a", "written for another status")}
    assert findings(report, written) == [
        "chunked_prefill (pass): a note on a pass",
        "speculative (n/a): llama.cpp proposes no n-gram draft here",
        "cache_order (fail): no finding written for this status yet (token 3 differs)"]


@pytest.mark.parametrize("flag", ["--server", "--gguf"])
def test_a_missing_file_exits_2(flag, tmp_path, capsys):
    present = tmp_path / "present"
    present.write_text("")
    other = "--gguf" if flag == "--server" else "--server"
    with pytest.raises(SystemExit) as exit_:
        main([flag, str(tmp_path / "absent"), other, str(present), "--out", str(tmp_path / "o.json")])
    assert exit_.value.code == 2 and f"{flag}: {tmp_path / 'absent'} not found" in capsys.readouterr().err
