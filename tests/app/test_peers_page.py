"""Page 16's peers table: the committed bench.peers run, stamped as recorded (date, host, load), never as live."""
import lab.peers
from lab.peers import recorded_peers
from tests.app.page_helpers import open_page

PAGE = "app_pages/16_continuous_batching.py"


def test_p16_shows_the_recorded_peers_table():
    rec = recorded_peers()
    at = open_page(PAGE)
    assert any(s.value == "4 · Beside llama.cpp and transformers, recorded" for s in at.subheader)
    captions = [c.value for c in at.caption]
    assert rec.stamp in captions and rec.stamp.startswith("Recorded ")
    assert not any("live" in c.lower() for c in captions if c.startswith("Recorded"))
    (table,) = [d for d in at.dataframe if "ours ÷ llama.cpp" in d.value.columns]
    assert list(table.value["measure"]) == list(rec.table["measure"])


def test_p16_says_how_to_record_when_there_is_no_run(monkeypatch, tmp_path):
    monkeypatch.setattr(lab.peers, "result_path", lambda bench: tmp_path / f"{bench}.json")
    at = open_page(PAGE)
    assert any("python -m bench.peers" in i.value for i in at.info)
