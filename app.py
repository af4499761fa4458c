"""KDA Serve Lab: the entry point only routes (st.navigation); each tab is one file in the ``app_pages`` folder.

The tab list lives in ``app_pages.registry`` (``HOME``, ``TABS``: one file per tab, such as ``00_home.py`` and
``03_kda_state_vs_kv.py``), each with its URL path stated (``/kda_state_vs_kv``). The folder is not named ``pages``:
a folder of that name next to the entry file switches Streamlit to its legacy auto-discovered navigation.
"""
import threading

import streamlit as st

from app_pages.links import keep_page_links
from app_pages.registry import HOME, SECTIONS, TABS

st.set_page_config(page_title="KDA Serve Lab", page_icon="assets/icon.png", layout="wide")


def _load_kernel() -> None:
    # imports torch: 1-4 s on a busy 2-core host, off the first page's thread
    from kda_core import cpu_forms

    cpu_forms.start_up()             # every C form: chunk kernel, row-invariant GEMM, decode layer, MoE, MLA


# import torch and build / load / self-check the fused chunk kernel once per server process, in the background: the
# first page draws meanwhile (a page that needs torch waits on the import lock, then on the kernel's own lock)
@st.cache_resource(show_spinner=False, max_entries=1)
def _start_kernel_load() -> threading.Thread:
    thread = threading.Thread(target=_load_kernel, name="kda-kernel-load", daemon=True)
    thread.start()
    return thread


_start_kernel_load()

nav = {section: [] for section in SECTIONS}
tab_of = []   # (st.Page, Tab)
for tab in [HOME, *TABS]:
    page = st.Page(tab.path, title=tab.title, icon=tab.icon, url_path=tab.url_path, default=tab is HOME)
    nav[tab.section].append(page)
    tab_of.append((page, tab))

page = st.navigation({section: pages for section, pages in nav.items() if pages}, expanded=True)
tab = next(tab for p, tab in tab_of if p is page)
keep_page_links(tab.link_prefix)   # other tabs' keys leave the URL
page.run()   # its first call, declare(...), checks the URL against the parameters it declares
