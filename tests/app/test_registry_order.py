"""The sidebar reads in order: app.py groups pages/_registry.py's tabs by section (SECTIONS order),
so that grouping must list the pages 01..14 by ascending number. Pages added later (number > 14)
sit in their topic's section and are exempt."""
from pathlib import Path

from pages._registry import SECTIONS, TABS


def test_sidebar_lists_pages_in_number_order() -> None:
    sidebar = [tab for section in SECTIONS for tab in TABS if tab.section == section]
    numbers = [int(Path(tab.path).stem[:2]) for tab in sidebar]
    assert numbers == sorted(numbers), f"sidebar order {numbers}"
    assert {tab.section for tab in TABS} <= set(SECTIONS)
