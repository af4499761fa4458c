"""Shared UI helpers for the pages (not a page: app.py does not list it).

- ``show_chart(fig, df, key)``: a Plotly chart with a stable key plus a CSV download of its data.
- ``engine_call(fn, *args, **kwargs)``: run an engine call; on a ValueError/RuntimeError show
  ``st.error`` with the message and stop the page (never a stack trace in the UI).
- ``persist(key, default)``: keep a widget's value across page switches (Streamlit drops the
  state of widgets that are not rendered; re-assigning it in session_state keeps it). The default
  is set through session_state, so do NOT also pass ``value=``/``index=`` to the widget.
  Selectboxes: use display strings as options (no ``format_func``; AppTest cannot evaluate it).
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from serve.errors import UserFacingErrors


def persist(key: str, default=None) -> str:
    """Keep ``st.session_state[key]`` alive across page switches, starting at ``default``.

    Returns key (use it as the widget's ``key=``; pass no ``value=``/``index=`` to the widget)."""
    if key in st.session_state:
        st.session_state[key] = st.session_state[key]
    elif default is not None:
        st.session_state[key] = default
    return key


def show_chart(fig: go.Figure, df: pd.DataFrame, key: str, filename: str | None = None) -> None:
    """Render ``fig`` with ``key`` and a CSV download button of ``df`` (the chart's data)."""
    fig.update_layout(margin=dict(l=10, r=10, t=40, b=10))
    st.plotly_chart(fig, key=key, width="stretch")
    st.download_button("Download CSV", df.to_csv(index=False).encode(), file_name=filename or f"{key}.csv",
                       mime="text/csv", key=f"{key}_csv")


def engine_call(fn, *args, **kwargs):
    """Call ``fn``; show the error text with ``st.error`` and stop the page on bad input."""
    try:
        return fn(*args, **kwargs)
    except UserFacingErrors as exc:
        st.error(f"{type(exc).__name__}: {exc}")
        st.stop()
