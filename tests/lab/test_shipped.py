"""lab.shipped: the reader of the bench results the pages show."""
import pytest

from lab.shipped import missing_note, read_shipped, result_path


def test_a_missing_result_is_none_and_a_shipped_one_is_read(tmp_path):
    assert read_shipped(tmp_path / "none.json") is None
    d = read_shipped(result_path("state_dtype"))
    assert isinstance(d, dict) and "summary" in d


def test_a_result_that_is_not_an_object_is_refused(tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="r.json must hold a JSON object"):
        read_shipped(bad)


def test_the_note_names_the_command_and_the_file():
    assert missing_note("drafters") == "No shipped run: `python -m bench.drafters` writes bench/results/drafters.json."
