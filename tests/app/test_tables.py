"""Every table a page shows at its defaults reads like a table for people, not a pandas dump.

For each ``st.dataframe`` / ``st.table`` on every page (Home and every tab in app_pages/registry.py), the
headers the user sees are checked: the ``column_config`` label when there is one, otherwise the column
name (hidden columns and a hidden index are not shown, so not checked). A header must not be a
snake_case identifier (``measured_bytes``); a float column must carry a number format (precision chosen,
not Streamlit's default of up to four decimals); an integer column reaching 10,000 must be formatted with
thousands separators (or another explicit readable format); booleans are shown as words, not checkboxes.
Tables behind a button are checked with the flag its click sets (``page_helpers.open_revealed``).
"""
import json
import re

import pandas as pd
import pytest

from app_pages.registry import HOME, TABS
from tests.app.page_helpers import open_revealed

SNAKE = re.compile(r"[A-Za-z0-9]_[A-Za-z0-9]")   # an underscore inside a word: a code identifier
READABLE_INT_FORMATS = ("localized", "compact", "engineering", "scientific", "bytes", "accounting", "dollar",
                        "euro", "yen", "percent")


def shown_columns(table) -> list[tuple[str, pd.Series, dict]]:
    """(header the user sees, data, type config) of each visible column of ``table`` (an AppTest
    Dataframe or Table element), in display order; the index counts as a column unless hidden."""
    frame: pd.DataFrame = table.value
    config = json.loads(table.proto.columns) if getattr(table.proto, "columns", "") else {}
    order = list(getattr(table.proto, "column_order", []) or [])
    shown = []
    index_cfg = config.get("_index", {})
    if not index_cfg.get("hidden") and not isinstance(frame.index, pd.RangeIndex):
        name = index_cfg.get("label") or frame.index.name or ""
        shown.append((str(name), pd.Series(frame.index), index_cfg.get("type_config", {})))
    names = order or list(frame.columns)
    for col in names:
        cfg = config.get(str(col), {})
        if cfg.get("hidden"):
            continue
        shown.append((str(cfg.get("label") or col), frame[col], cfg.get("type_config", {})))
    return shown


def table_problems(table) -> list[str]:
    """What makes ``table`` hard to read, one line per column and problem; empty when it reads well."""
    problems = []
    for header, data, type_config in shown_columns(table):
        fmt = type_config.get("format")
        if SNAKE.search(header):
            problems.append(f"header {header!r} is a code identifier")
        if pd.api.types.is_bool_dtype(data):
            problems.append(f"{header!r}: booleans shown as checkboxes, not words")
        elif pd.api.types.is_float_dtype(data) and not fmt:
            problems.append(f"{header!r}: floats without a chosen precision (e.g. {data.iloc[0]!r})")
        elif pd.api.types.is_integer_dtype(data) and len(data) and data.abs().max() >= 10_000 and not (
                fmt and (fmt in READABLE_INT_FORMATS or "," in fmt)):
            problems.append(f"{header!r}: integers up to {data.abs().max()} without thousands separators")
    return problems



@pytest.mark.parametrize("path", [HOME.path] + [t.path for t in TABS], ids=lambda p: p.split("/")[-1][:-3])
def test_tables_readable(path):
    at = open_revealed(path)
    tables = list(at.dataframe) + list(at.table)
    problems = [f"table {i}: {p}" for i, t in enumerate(tables) for p in table_problems(t)]
    assert not problems, f"{path}:\n" + "\n".join(problems)
