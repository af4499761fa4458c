"""Every cache in the app is bounded: the server is shared by every visitor (Streamlit Community Cloud
gives an app about 1 GB), so a cache that grows with the number of distinct widget settings grows
until the app is killed.

Static check over every page (``app_pages/*.py``) and every module the pages call (``serve/``,
``kda_core/``): each ``st.cache_data`` / ``st.cache_resource``, as a decorator or called on a function
(``run = st.cache_data(lab_function, ...)``), passes ``max_entries``
(a positive int), each ``st.cache_data`` (measurements and simulations) also a ``ttl``; no
``functools.cache`` and no ``functools.lru_cache(maxsize=None)``.
"""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FILES = sorted([*REPO.glob("app_pages/*.py"), *REPO.glob("serve/**/*.py"), *REPO.glob("kda_core/**/*.py"), REPO / "app.py"])


def _name(node: ast.expr) -> str:
    """Dotted name of a decorator (``st.cache_data``, ``functools.lru_cache``, ``cache``)."""
    if isinstance(node, ast.Call):
        return _name(node.func)
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _keywords(node: ast.expr) -> dict:
    return {kw.arg: kw.value for kw in node.keywords} if isinstance(node, ast.Call) else {}


def _streamlit_cache_problems(call: ast.expr, where: str) -> list[str]:
    name, kws = _name(call), _keywords(call)
    problems = []
    n = kws.get("max_entries")
    if not (isinstance(n, ast.Constant) and isinstance(n.value, int) and n.value > 0):
        problems.append(f"{where}: {name} without a positive int max_entries")
    if name.endswith("cache_data") and "ttl" not in kws:
        problems.append(f"{where}: {name} without ttl")
    return problems


def unbounded_caches(source: str, filename: str) -> list[str]:
    """One line per cache in ``source`` (decorator, or a call on a function) that is not bounded as the module doc
    requires."""
    problems = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and node.args and _name(node.func).endswith(("cache_data", "cache_resource")):
            problems += _streamlit_cache_problems(node, f"{filename}:{node.lineno} {ast.unparse(node.args[0])}")
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in node.decorator_list:
            name, kws, where = _name(dec), _keywords(dec), f"{filename}:{dec.lineno} {node.name}"
            if name.endswith(("cache_data", "cache_resource")):
                problems += _streamlit_cache_problems(dec, where)
            elif name in ("functools.cache", "cache"):
                problems.append(f"{where}: {name} is unbounded (use lru_cache with a maxsize)")
            elif name.endswith("lru_cache"):
                size = kws.get("maxsize", dec.args[0] if isinstance(dec, ast.Call) and dec.args else None)
                if isinstance(size, ast.Constant) and size.value is None:
                    problems.append(f"{where}: lru_cache(maxsize=None) is unbounded")
    return problems


def test_every_cache_is_bounded():
    assert any(f.name == "10_kcp.py" for f in FILES) and any(f.parts[-2] == "serve" for f in FILES)
    problems = [p for f in FILES for p in unbounded_caches(f.read_text(), str(f.relative_to(REPO)))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source, bad", [
    pytest.param("@st.cache_data\ndef f(): pass", True, id="bare-cache_data"),
    pytest.param("@st.cache_data(max_entries=8)\ndef f(): pass", True, id="cache_data-no-ttl"),
    pytest.param("@st.cache_data(ttl='1h')\ndef f(): pass", True, id="cache_data-no-max_entries"),
    pytest.param("@st.cache_resource(max_entries=None)\ndef f(): pass", True, id="cache_resource-None"),
    pytest.param("@functools.cache\ndef f(): pass", True, id="functools.cache"),
    pytest.param("@functools.lru_cache(maxsize=None)\ndef f(): pass", True, id="lru_cache-None"),
    pytest.param("@st.cache_data(max_entries=8, ttl='1h')\ndef f(): pass", False, id="cache_data-bounded"),
    pytest.param("@st.cache_resource(max_entries=2)\ndef f(): pass", False, id="cache_resource-bounded"),
    pytest.param("@functools.lru_cache(maxsize=3)\ndef f(): pass", False, id="lru_cache-3"),
    pytest.param("run = st.cache_data(lab_fn, show_spinner=False, max_entries=8)", True, id="call-no-ttl"),
    pytest.param("run = st.cache_resource(lab_fn)", True, id="call-no-max_entries"),
    pytest.param("run = st.cache_data(lab_fn, max_entries=8, ttl='1h')", False, id="call-bounded"),
])
def test_unbounded_caches_detects(source, bad):
    assert bool(unbounded_caches(source, "x.py")) is bad


def test_home_first_run_imports_no_pandas():
    """A fresh server's first render is Home's, and it needs torch but not pandas (0.3 s of import): Home builds no
    frame (``app_pages.charts.show_chart`` takes row dicts) and its caches take their ttl in seconds (a ttl of "1h"
    makes Streamlit parse it with pandas). Nor torch._dynamo (2-3 s of import on a loaded host): loading the model
    built it under ``torch.device("meta")``, whose random factories go through torch._refs, which imports it. Run in a
    fresh interpreter: this test process has pandas already."""
    code = ("import sys; from streamlit.testing.v1 import AppTest; at = AppTest.from_file(sys.argv[1], "
            "default_timeout=120); at.run(); assert not at.exception, at.exception; "
            "print(sorted(m for m in ('pandas', 'torch', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(REPO / "app.py")], capture_output=True, text=True,
                         timeout=180, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['torch']", out.stdout
