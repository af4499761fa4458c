"""Around a live measurement: its stamp (``measured_stamp``), a button that takes it again
(``remeasure_button``), and heavy work started only on request (``requested``: the rest of the page still renders;
``run_on_request``: the page stops there until the click)."""
from __future__ import annotations

import streamlit as st


def remeasure_button(cached_fn, key: str, label: str = "Re-measure") -> None:
    """A button that clears ``cached_fn``'s ``st.cache_data`` entries (only this page's measurement: cached
    measurements are shared by every visitor), so the run the click starts measures afresh. The clear runs
    as the button's ``on_click`` callback, before that run's script: a click is never lost to a rerun."""
    st.button(label, key=key, on_click=cached_fn.clear,
              help="Cached measurements are shared by all visitors; this clears this page's measurement only "
                   "and takes it again now.")


def requested(flag: str, button_key: str, label: str, caption: str, where=None) -> bool:
    """True once ``flag`` is on in this session; until then show ``caption`` and a primary button ``label`` in
    ``where`` (a container; default the page) and return False. A click turns ``flag`` on for the session in the
    button's callback, before the run it starts: the click is never lost to a rerun."""
    if st.session_state.get(flag):
        return True
    (where or st).caption(caption)
    (where or st).button(label, key=button_key, type="primary", on_click=st.session_state.update, kwargs={flag: True})
    return False


def run_on_request(flag: str, button_key: str, label: str, caption: str, where=None) -> None:
    """Heavy work behind a button (:func:`requested`) at the end of a page: until the click, the page stops here."""
    if not requested(flag, button_key, label, caption, where):
        st.stop()


def measured_stamp(conditions) -> None:
    """The stamp under a measured chart: when, repeats, torch threads, cores, load average
    (:meth:`lab.timing.Conditions.stamp`)."""
    st.caption(conditions.stamp())
