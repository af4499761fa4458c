"""KDA Serve Lab: the entry point only routes (st.navigation); each tab is one file in pages/.

The tab list lives in pages/_registry.py (pages/00_home.py, pages/03_kda_state_vs_kv.py, ...).
On a fresh server Streamlit may run a session's first run in its legacy ``pages/`` mode; the pages
send such a run back through here (``pages._common.route_through_navigation``, checked per run).
When the legacy mode runs this file itself as its main page, the ``st.navigation`` below replaces
the auto-discovered page list for that run, so the sectioned navigation is what the browser gets.
"""
import streamlit as st

from pages._registry import HOME, SECTIONS, TABS

st.set_page_config(page_title="KDA Serve Lab", page_icon="assets/icon.png", layout="wide")

nav = {section: [] for section in SECTIONS}
nav[HOME.section].append(st.Page(HOME.path, title=HOME.title, icon=HOME.icon, default=True))
for tab in TABS:
    nav[tab.section].append(st.Page(tab.path, title=tab.title, icon=tab.icon))

st.navigation({section: pages for section, pages in nav.items() if pages}, expanded=True).run()
