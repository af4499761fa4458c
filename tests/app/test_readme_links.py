"""The "Links to a view" examples of ``app_pages/README.md`` (the README shows the first) open the view they describe:
numbers, an option's label, a range given as a repeated key, and a checkbox's true; the README's counts are the
app's."""
from pathlib import Path

from streamlit.testing.v1 import AppTest

REPO = Path(__file__).resolve().parents[2]


def _open(page: str, params: dict) -> AppTest:
    at = AppTest.from_file(str(REPO / "app_pages" / page), default_timeout=300)
    for key, value in params.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.toast, [t.value for t in at.toast]          # no link value reported as ignored
    return at


def test_readme_link_examples():
    readme = (REPO / "app_pages" / "README.md").read_text()
    assert "/kda_state_vs_kv?p03_meas_heads=2&p03_meas_max=2048" in readme
    assert "/kda_state_vs_kv?p03_meas_heads=2&p03_meas_max=2048" in (REPO / "README.md").read_text()
    assert "?p03_preset=Kimi%20K3" in readme and "?p03_context=4096&p03_context=65536" in readme
    assert "/prefix_anatomy?p07_drop=true" in readme
    at = _open("03_kda_state_vs_kv.py", {"p03_meas_heads": "2", "p03_meas_max": "2048", "p03_preset": "Kimi K3",
                                         "p03_context": ["4096", "65536"]})
    widgets = {w.key: w.value for w in [*at.slider, *at.select_slider, *at.selectbox]}
    assert widgets["p03_meas_heads"] == 2 and widgets["p03_meas_max"] == 2048 and widgets["p03_preset"] == "Kimi K3"
    assert tuple(widgets["p03_context"]) == (4096, 65536)
    at = _open("07_prefix_anatomy.py", {"p07_drop": "true"})
    assert at.checkbox(key="p07_drop").value is True


def test_readme_counts_match_the_app():
    """The README said "Home and 15 tabs" (the registry has 17) and "Home's TTFT repeats (12 engine runs)" while Home
    says 30: its counts (and app_pages/README.md's) are read from the registry and from Home's own text, and its tab
    table has one row per tab."""
    import re

    from app_pages.registry import TABS
    readme = " ".join((REPO / "README.md").read_text().split())          # lines joined: a count may wrap
    assert f"Home and {len(TABS)} tabs run" in readme
    assert all(f"| {tab.title} |" in readme for tab in TABS), [t.title for t in TABS if f"| {t.title} |" not in readme]
    pages = " ".join((REPO / "app_pages" / "README.md").read_text().split())
    home = (REPO / "app_pages" / "00_home.py").read_text()
    runs = re.search(r"\((\d+) engine runs,", home).group(1)
    assert f"Home's TTFT repeats ({runs} engine runs" in pages
