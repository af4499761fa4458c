"""A new session's first run goes through ``app.py`` before any page: what it imports at module level is paid by the
first visitor of a fresh server before anything draws. torch (1-4 s of import on a busy 2-core host) is imported by
the kernel's start-up thread instead, while the first page draws."""
import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_app_entry_imports_no_torch():
    tree = ast.parse((REPO / "app.py").read_text())
    imports = [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert any("app_pages" in line for line in imports), imports
    code = "; ".join(imports) + "; import sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", f"app.py's module-level imports load torch: {imports}"


def test_the_served_entry_serves_the_app_and_starts_the_engine_with_the_server(monkeypatch):
    """``streamlit run streamlit_app.py`` runs it as Streamlit's ``st.App`` of ``app.py``, whose lifespan starts the
    start-up work in a thread when the server starts (Home's first render on a fresh server waits less)."""
    import asyncio
    import importlib.util
    import threading

    from streamlit.web.server.app_discovery import discover_asgi_app

    found = discover_asgi_app(REPO / "streamlit_app.py")
    assert found.is_asgi_app and found.app_name == "app", found
    spec = importlib.util.spec_from_file_location("streamlit_app", REPO / "streamlit_app.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    assert entry.app.script_path.name == "app.py"
    started = threading.Event()
    monkeypatch.setattr(entry, "start_up", started.set)

    async def serve_briefly():
        async with entry._lifespan(entry.app):
            assert started.wait(timeout=10), "the lifespan did not start the start-up work"

    asyncio.run(serve_briefly())
