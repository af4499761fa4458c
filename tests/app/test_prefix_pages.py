"""AppTest regressions for the home page and page 07 found in review: short prompts, blank lines, the
generated-token count, and the prompt length cap."""
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app_pages.registry import HOME

APP = str(Path(__file__).resolve().parents[2] / "app.py")
ANATOMY = "app_pages/07_prefix_anatomy.py"


def _page(path: str) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    if path != HOME.path:
        at.switch_page(path)
        at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


@pytest.fixture(scope="module")
def anatomy_page() -> AppTest:
    return _page(ANATOMY)


@pytest.mark.parametrize("text", ["a\nb", "hello world\n\n\nhello there"])
def test_anatomy_prompts_shorter_than_one_block(anatomy_page, text):
    at = anatomy_page
    at.text_area(key="p07_prompts").set_value(text)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert any("shorter than one block" in i.value for i in at.info)
    assert len(at.get("plotly_chart")) == 1
    assert any("Hit b = 0 tokens" in m.value for m in at.markdown)


@pytest.mark.parametrize("text", ["", "only one prompt", "\n\n", "one\n\n"])
def test_anatomy_needs_two_prompts(anatomy_page, text):
    at = anatomy_page
    at.text_area(key="p07_prompts").set_value(text)
    at.run()
    assert not at.exception and not at.error
    assert any("at least two prompts" in i.value for i in at.info)
    assert not at.get("plotly_chart")


def test_anatomy_blank_lines_are_reported(anatomy_page):
    at = anatomy_page
    at.text_area(key="p07_prompts").set_value("x" * 40 + " one\n\n" + "x" * 40 + " two")
    at.run()
    assert not at.exception
    assert any("1 blank line(s) ignored: 2 prompts" in c.value for c in at.caption)
    assert any("Hit b = 32 tokens" in m.value for m in at.markdown)


@pytest.fixture(scope="module")
def home_page() -> AppTest:
    return _page(HOME.path)


def test_home_counts_generated_tokens_not_bytes(home_page):
    """The success message counts generated tokens (bytes of the byte-level model), whatever the output's text:
    a token that is not valid UTF-8 on its own shows as U+FFFD, 3 bytes."""
    at = home_page
    for n in (8, 3):
        at.slider(key="p00_new").set_value(n)
        at.run()
        assert not at.exception
        assert any(f"run: {n} greedy tokens" in s.value for s in at.success), [s.value for s in at.success]


def test_home_caps_prompt_bytes(home_page):
    at = home_page
    at.text_area(key="p00_second").set_value("é" * 1_500)         # 1,500 characters, 3,000 bytes
    at.run()
    assert not at.exception
    assert any("exceeds 2,000 bytes" in e.value for e in at.error)
    assert not at.get("plotly_chart")
    at.text_area(key="p00_second").set_value("")
    at.run()
    assert not at.exception and not at.error
    assert any("Type both prompts" in i.value for i in at.info)


@pytest.mark.parametrize("shared", ["0", "1"])
def test_prefix_hit_no_block_shared_shows_a_note_not_an_empty_chart(shared):
    """Page 08 with a shared prefix under one 16-token block: nothing is reused, so section 2 says so in a note and
    draws no bar chart of zeros (it drew an empty -1..1 KiB axis)."""
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update(p08_shared=shared, p08_new="1")
    at.run()
    at.switch_page("app_pages/08_prefix_hit.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert not [c for c in at.get("plotly_chart") if c.proto.id.endswith("p08_bytes_chart")]
    assert any("No whole 16-token block shared" in i.value and "nothing reused" in i.value for i in at.info)
