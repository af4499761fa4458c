"""The served entry point: ``streamlit run streamlit_app.py`` serves the app (``app.py``, which only routes) as
Streamlit's ``st.App`` and starts the engine's start-up work when the server starts, not when the first session does.

The start-up work (:func:`start_up`: torch's import, the fused chunk kernel built once per machine then loaded and
self-checked, and every other C form of :func:`kda_core.cpu_forms.start_up`, the demo model) takes 2-4 s of a fresh
server on a busy 2-core host. Started with the server, it runs while the first visitor's browser loads the frontend
(about 1 s before the first script run), instead of after it: Home's first render on a fresh server went from 4.43
to 3.70 s (median of 3 interleaved fresh-server pairs, load average 3.6-4.3). Home's verification run itself still
runs when the visitor opens it.
``streamlit run app.py`` serves the same app; its first visitor then waits for the start-up work as well (``app.py``
starts the kernel's part in the background on its first run, as before).
"""
import contextlib
import threading

import streamlit as st


def start_up() -> None:
    """Import torch, build / load / self-check the fused chunk kernel, load the decode step's library and the demo
    model (what Home's first verification run needs); each is done once per process, later callers wait for it."""
    from kda_core import cpu_forms
    from lab.models import demo_model

    cpu_forms.start_up()
    demo_model("demo")


@contextlib.asynccontextmanager
async def _lifespan(_app):
    threading.Thread(target=start_up, name="kda-start-up", daemon=True).start()   # the server listens meanwhile
    yield


app = st.App("app.py", lifespan=_lifespan)
