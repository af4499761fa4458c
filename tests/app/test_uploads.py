"""Uploads on pages 09 and 11–14: a malformed file shows ``st.error`` naming the line (no exception), an
upload over a page's budget shows ``st.info`` saying what was kept, and page 13's caption gives the burst
size the Azure file really produced. AppTest has no file-upload driver, so ``st.file_uploader`` is
replaced by one returning an in-memory file (the pages only call ``getvalue()`` and ``name``)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import streamlit as st
from streamlit.delta_generator import DeltaGenerator
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[2] / "app.py")
TRACE_PAGES = ["app_pages/09_prefix_miss.py", "app_pages/11_fleet_hashing.py", "app_pages/12_fleet_scaling.py",
               "app_pages/14_fleet_simulation.py"]


class _Upload:
    def __init__(self, data: bytes, name: str):
        self._data, self.name = data, name

    def getvalue(self) -> bytes:
        return self._data


def _run_with_upload(monkeypatch, page: str, data: bytes, name: str) -> AppTest:
    monkeypatch.setattr(st, "file_uploader", lambda *a, **k: _Upload(data, name))
    monkeypatch.setattr(DeltaGenerator, "file_uploader", lambda self, *a, **k: _Upload(data, name))  # columns
    at = AppTest.from_file(APP, default_timeout=180)
    at.run()
    at.switch_page(page)
    at.session_state["p09_replay_on"] = True          # page 09 reads the trace only for its replay (a button)
    at.session_state["p15_sweep_on"] = True           # page 15 too (its policy sweep)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _line(i: int, blocks: int) -> str:
    return json.dumps({"timestamp": i, "input_length": 512 * blocks, "output_length": 4,
                       "hash_ids": list(range(i * blocks, (i + 1) * blocks))})


@pytest.mark.parametrize("page", TRACE_PAGES)
def test_hash_id_outside_int64_is_an_error_naming_the_line(monkeypatch, page):
    """Regression: pages 11, 12 and 14 raised OverflowError (a stack trace) on such an id."""
    data = (_line(0, 2) + "\n" + json.dumps({"timestamp": 1, "input_length": 5, "output_length": 1,
                                             "hash_ids": [1 << 64]}) + "\n").encode()
    at = _run_with_upload(monkeypatch, page, data, "bad.jsonl")
    assert [e.value for e in at.error] == [
        "TraceFormatError: bad.jsonl: line 2: field 'hash_ids' holds an integer of 65 bits, outside the 64-bit "
        "signed range [-9,223,372,036,854,775,808, 9,223,372,036,854,775,807]"]


def test_page_11_says_what_the_block_budget_cut(monkeypatch):
    data = "".join(_line(i, 2048) + "\n" for i in range(70)).encode()
    at = _run_with_upload(monkeypatch, "app_pages/11_fleet_hashing.py", data, "big.jsonl")
    assert [i.value for i in at.info] == [
        "Kept the first 64 requests (131,072 blocks) of big.jsonl: the 131,072-block budget (512-token blocks this "
        "page replays within a few seconds) stopped the upload at line 65; the rest was not read."]


def test_page_13_caption_gives_the_real_burst_size(monkeypatch):
    """Regression: a 2-request Azure file made a 2-request burst while the caption said 1,500 (the burst asked
    for: the burst load x the fleet's capacity x the burst duration)."""
    data = b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,100,10\n2023-11-16 18:17:04,200,20\n"
    at = _run_with_upload(monkeypatch, "app_pages/13_fleet_budgets.py", data, "short.csv")
    [info] = [i.value for i in at.info]
    asked = re.fullmatch(r"The burst has 2 Standard requests, not the ([\d,]+) asked for: the Azure trace gave only "
                         r"2\.", info)
    assert asked and int(asked.group(1).replace(",", "")) > 2, info
    assert any(re.search(r"\(2 Standard requests[,)]", c.value) for c in at.caption)   # the caption may go on
    assert not any(re.search(rf"\({asked.group(1)} Standard requests[,)]", c.value) for c in at.caption)


def test_upload_parts_keeps_empty_uploads():
    """An empty upload is ``b""`` (the loaders report it), never None (which means: no upload)."""
    from app_pages.caching import upload_parts

    assert upload_parts(None) == (None, "")
    assert upload_parts(_Upload(b"", "empty.jsonl")) == (b"", "empty.jsonl")
    assert upload_parts(_Upload(b"x", "")) == (b"x", "uploaded file")


@pytest.mark.parametrize("page", [*TRACE_PAGES, "app_pages/15_real_scale.py"])
def test_a_zero_length_request_is_taken_as_the_readme_says(monkeypatch, page):
    """Regression: page 15 showed ``ValueError: new_tokens must be an int >= 1, got 0`` for a trace holding a
    request with ``input_length`` 0 (serve/traces/README.md accepts it; pages 09, 11, 12 and 14 take the same file): such a
    request still prefills one token (its first decode input), as the fleet simulator charges it."""
    lines = [_line(i, 2) for i in range(3)] + [json.dumps({"timestamp": 3, "input_length": 0, "output_length": 10,
                                                           "hash_ids": []})] + [_line(i, 2) for i in range(4, 8)]
    at = _run_with_upload(monkeypatch, page, ("\n".join(lines) + "\n").encode(), "zero.jsonl")
    assert not [e.value for e in at.error], [e.value for e in at.error]
    assert at.get("plotly_chart")
