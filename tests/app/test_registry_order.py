"""The sidebar reads in order: app.py groups app_pages/registry.py's tabs by section (SECTIONS order), so that
grouping must list every page by ascending number (it read 01 ... 06, 17, 07 ... with page 17 under Memory),
with the conformance page last."""
from pathlib import Path

from app_pages.registry import HOME, SECTIONS, TABS

REPO = Path(__file__).resolve().parents[2]


def test_sidebar_lists_pages_in_number_order() -> None:
    sidebar = [tab for section in SECTIONS for tab in TABS if tab.section == section]
    numbers = [int(Path(tab.path).stem[:2]) for tab in sidebar]
    assert numbers == sorted(numbers), f"sidebar order {numbers}"
    assert [tab.path for tab in sidebar] == [tab.path for tab in TABS], "TABS is not in sidebar order"
    assert {tab.section for tab in TABS} <= set(SECTIONS)
    assert Path(sidebar[-1].path).stem == "18_conformance"


def test_tab_titles_carry_their_page_number() -> None:
    """The number a visitor reads in the sidebar is the page's file number, its URL keys' prefix (p17_) too."""
    for tab in TABS:
        assert tab.title.startswith(Path(tab.path).stem[:2] + " "), tab
        assert tab.link_prefix == f"p{tab.title[:2]}_", tab


# Every tab's URL path as the deep links already handed out use it (README, bookmarks, the browser test):
# app.py gives each st.Page this url_path explicitly, so renaming or moving a page file keeps its links. Home is
# the default page, served at "/" (its url_path only reserves the name).
DEEP_LINKS = ["snapshot_vs_projection", "verify_and_replay", "kda_state_vs_kv", "raw_input_ring", "page_pool",
              "mla_paging", "prefix_anatomy", "prefix_hit", "prefix_miss", "kcp", "fleet_hashing", "fleet_scaling",
              "fleet_budgets", "fleet_simulation", "real_scale", "state_precision"]


def test_every_existing_deep_link_keeps_its_url_path() -> None:
    paths = [HOME.url_path] + [tab.url_path for tab in TABS]
    assert len(set(paths)) == len(paths), f"duplicate URL paths {paths}"
    assert set(DEEP_LINKS) <= {tab.url_path for tab in TABS}, f"lost deep links {sorted(set(DEEP_LINKS) - set(paths))}"
    assert all((REPO / tab.path).is_file() and Path(tab.path).parts[0] == "app_pages" for tab in [HOME] + TABS)


def test_no_folder_named_pages_next_to_the_entry_file() -> None:
    """A ``pages/`` folder beside app.py switches Streamlit 1.67 to its legacy auto-discovered navigation on a
    fresh server (every file in it a page, the sectioned st.navigation list lost for that run)."""
    assert not (REPO / "pages").exists()
