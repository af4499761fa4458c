"""The layers, pinned by parsing every ``import`` with :mod:`ast` (no module is imported here).

    kda_core/  maths: imports nothing of ours
    serve/       infra: no lab, no app_pages, no Streamlit
    lab/         experiments for the pages: no app_pages, no Streamlit, no bench (bench imports lab, never back)
    train/       corpus, training and export of the demo model: ours only kda_core (no serve, lab, app_pages,
                 Streamlit)
    conformance/ the conformance suite, a client tool: ours only conformance (no kda_core, lab, app_pages,
                 Streamlit), except conformance/ours.py, which starts our server (serve.http); nothing of serve
                 or kda_core imports it
    app_pages/   thin Streamlit pages: ours only through lab.* and the pages' own helper modules (+ Streamlit,
                 Plotly, pandas, numpy, stdlib)

and nothing imports a private name (``_x``) from another package. A package is the top-level directory
plus its first subpackage: ``serve.memory``, ``serve.prefix``, ``kda_core``, ``lab``, ``app_pages``; so
``kda_core/chunk.py`` may import ``kda_core.kda._check_inputs``, ``serve/engine/engine.py`` may not import
``serve.memory.pool._x``. The pages' helper modules are the files of ``app_pages/`` whose name does not start
with the tab number (``links.py``, ``charts.py``, ``errors.py``, ``registry.py``, ...; see ``app_pages/__init__.py``).
No import cycle among the app's modules, function-level imports included (:func:`test_no_import_cycle`); every
package's docstring table names its modules; the fleet's sub-packages import one way (routing <- scaling <- sim).

The shipped models come from one place (:func:`test_shipped_models_come_from_one_place`): ``serve/runnable.py`` is
the only module that defines ``demo_model`` / ``draft_model`` and calls ``HybridLM.from_pretrained`` (outside
``kda_core``, ``train`` and the tests); ``serve/`` imports them from it, everything else from ``lab.models``.
"""
from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = ("kda_core", "serve", "lab", "app_pages", "bench", "app", "tests", "train", "conformance")
CONFORMANCE_SERVER = ("conformance.ours", ("serve.http",))   # the suite's one module that starts our server
# Third-party libraries a page may use directly (drawing and tables; no maths, no engine).
PAGE_LIBRARIES = {"streamlit", "plotly", "pandas", "numpy"}
# What pages may import of ours: the lab layer and the pages' own helper modules. app_pages.errors shows the
# engine's user-facing errors, so it alone also catches serve.errors' exception types, and it hands the server
# process's freed memory back to the OS after each call (serve.process_memory).
PAGE_OURS = ("lab", "app_pages")
ERRORS_EXTRA = ("serve.errors", "serve.process_memory")


class Import(NamedTuple):
    """One imported thing: ``module`` (absolute dotted path) and ``name`` (the name taken from it with
    ``from module import name``; None for ``import module``); ``line`` for the message."""

    module: str
    name: str | None
    line: int


@functools.lru_cache(maxsize=4096)   # every test here walks the same few hundred files: parse each once
def nodes_of(source: str) -> tuple[ast.AST, ...]:
    """Every node of ``source``'s syntax tree (``ast.walk`` order)."""
    return tuple(ast.walk(ast.parse(source)))


def imports_of(source: str) -> list[Import]:
    """Every import statement of ``source``, at any depth (functions too)."""
    out = []
    for node in nodes_of(source):
        if isinstance(node, ast.Import):
            out += [Import(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [Import(node.module, alias.name, node.lineno) for alias in node.names]
    return out


def module_of(path: Path) -> str:
    """Dotted module name of a file of the repo (``serve/memory/pool.py`` -> ``serve.memory.pool``)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """Top-level directory plus first subpackage: ``serve.memory.pool`` -> ``serve.memory``,
    ``serve.config`` -> ``serve``, ``kda_core.kda`` -> ``kda_core``. A test belongs to the package its
    directory mirrors (``tests.serve.memory.test_pool`` -> ``serve.memory``), so it may test private helpers."""
    parts = module.split(".")
    if parts[0] == "tests" and len(parts) > 2:
        parts = parts[1:]
    if len(parts) >= 2 and (REPO / parts[0] / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_names(imp: Import) -> list[str]:
    """The private parts of an import: modules or names starting with one ``_``."""
    parts = imp.module.split(".") + ([imp.name] if imp.name else [])
    return [p for p in parts if _private(p)]


def is_page_helper(module: str) -> bool:
    """True for a helper module of the pages (``app_pages.links``), False for a page (``app_pages.05_page_pool``,
    not importable: its name starts with the tab number) or anything else."""
    parts = module.split(".")
    return len(parts) == 2 and parts[0] == "app_pages" and not parts[1][:1].isdigit()


def layer_violations(path: Path, source: str) -> list[str]:
    """Every broken layer rule of the file at ``path`` (relative to the repo) with ``source``."""
    me = module_of(path)
    top = me.split(".")[0]
    errors = []
    for imp in imports_of(source):
        root = imp.module.split(".")[0]
        where = f"{path.relative_to(REPO)}:{imp.line}: imports {imp.module}" + (f".{imp.name}" if imp.name else "")
        ours = root in OURS
        if top == "kda_core" and ours and root != "kda_core":
            errors.append(f"{where} (kda_core imports nothing of ours)")
        if top == "serve" and root in ("lab", "app_pages", "streamlit"):
            errors.append(f"{where} (serve imports no lab, app_pages or Streamlit)")
        if top == "lab" and root in ("app_pages", "streamlit", "bench"):
            errors.append(f"{where} (lab imports no app_pages, Streamlit or bench)")
        if top == "train" and (root == "streamlit" or ours and root not in ("kda_core", "train")):
            errors.append(f"{where} (train imports of ours only kda_core, and no Streamlit)")
        if top == "conformance" and (root == "streamlit" or ours and root != "conformance"):
            server, allowed_mods = CONFORMANCE_SERVER
            if not (me == server and any(imp.module == a or imp.module.startswith(a + ".") for a in allowed_mods)):
                errors.append(f"{where} (conformance is a client: of ours it imports only conformance, and "
                              "conformance.ours serve.http)")
        if top in ("kda_core", "serve") and root == "conformance":
            errors.append(f"{where} (the engine imports no conformance suite)")
        if top == "app_pages":
            extra = ERRORS_EXTRA if me == "app_pages.errors" else ()
            allowed = (root == "lab" or is_page_helper(imp.module)
                       or any(imp.module == a or imp.module.startswith(a + ".") for a in extra))
            if ours and not allowed:
                errors.append(f"{where} (pages import ours only through lab.* and the pages' helper modules)")
            if not ours and root not in PAGE_LIBRARIES and root not in sys.stdlib_module_names:
                errors.append(f"{where} (pages draw with {sorted(PAGE_LIBRARIES)} and the stdlib only)")
        if ours and package_of(imp.module) != package_of(me):
            errors += [f"{where} (private name {p} of another package)" for p in private_names(imp)]
    return errors


def _files() -> list[Path]:
    skip = {".git", ".venv", "results", "__pycache__"}
    return sorted(p for p in REPO.rglob("*.py") if not skip & set(p.relative_to(REPO).parts))


@pytest.mark.parametrize("top", ["kda_core", "serve", "lab", "app_pages", "bench", "app", "tests", "train",
                                 "conformance"])
def test_layers(top):
    errors = []
    for path in _files():
        if module_of(path).split(".")[0] == top:
            errors += layer_violations(path, path.read_text())
    assert not errors, "\n".join(errors)


BAD = {  # a deliberately bad import per rule, in a file of that layer: each must be reported
    "kda_core/kda.py": "from serve.engine import ServeEngine",
    "serve/engine/engine.py": "import lab.prefix",
    "serve/memory/pool.py": "import streamlit as st",
    "lab/fleet.py": "from app_pages.links import persist",
    "lab/kcp.py": "import streamlit",
    "lab/batching.py": "def f():\n    from bench.batch import run",                  # lab never imports bench
    "lab/state_write.py": "import bench.replay_ssm_batch",
    "app_pages/08_prefix_hit.py": "from serve.engine import ServeEngine",
    "app_pages/11_fleet_hashing.py": "from kda_core.chunk import CHUNK_SIZE",
    "app_pages/12_fleet_scaling.py": "import torch",
    "app_pages/13_fleet_budgets.py": "from app_pages.registry import TABS\nfrom serve.x import y",
    "app_pages/charts.py": "from serve.errors import UserFacingErrors",          # only app_pages.errors shows them
    "app_pages/links.py": "from app_pages.charts import show_chart\nimport app_pages.x.y",
    "serve/engine/engine.py ": "from serve.memory.pool import _poison",
    "lab/prefix.py": "def f():\n    from serve.prefix.cache import _walk",
    "bench/prefix.py": "from kda_core.kda import _check_inputs",
    "tests/serve/memory/test_pool.py": "from serve.prefix.cache import _x",
    "train/loop.py": "from serve.engine import ServeEngine",
    "train/export.py": "import lab.prefix",
    "conformance/suite.py": "from serve.http.app import create_app",
    "conformance/client.py": "def f():\n    import kda_core.model",
    "conformance/ours.py": "from serve.engine import ServeEngine",           # ours.py: serve.http only
    "conformance/report.py": "import streamlit",
    "serve/http/app.py": "from conformance.client import EngineClient",
}


@pytest.mark.parametrize("path", list(BAD), ids=[p.strip() for p in BAD])
def test_a_bad_import_is_caught(path):
    """Proof the test can fail: each file with one bad import added gives exactly one violation."""
    file = REPO / path.strip()
    assert layer_violations(file, file.read_text()) == []
    found = layer_violations(file, file.read_text() + "\n" + BAD[path] + "\n")
    assert len(found) == 1, found


def test_private_names_within_a_package_are_allowed():
    chunk = REPO / "kda_core" / "chunk.py"
    assert layer_violations(chunk, "from kda_core.kda import _check_inputs\n") == []
    assert package_of("serve.memory.pool") == "serve.memory" and package_of("serve.config") == "serve"
    assert layer_violations(REPO / "serve" / "memory" / "layout.py", "from serve.memory.pool import _x\n") == []
    assert package_of("tests.serve.memory.test_pool") == "serve.memory"
    assert layer_violations(REPO / "tests" / "lab" / "test_pool.py", "from lab.pool import _x\n") == []


# --- the shipped models: one place ------------------------------------------------------------------------
MODEL_HOME = "serve.runnable"       # loads the shipped weights; serve/ imports them from it
MODEL_DOOR = "lab.models"           # everything outside serve/ imports them from here
SHIPPED = {"demo_model", "draft_model", "RUNNABLE", "TRAINED_WEIGHTS", "DRAFT_WEIGHTS", "is_trained"}
LOADERS = ("demo_model", "draft_model")
LOADING_LAYERS = ("serve", "lab", "app_pages", "bench", "app")   # kda_core defines from_pretrained; train exports


def model_source_violations(path: Path, source: str) -> list[str]:
    """Every place in the file at ``path`` (relative to the repo) with ``source`` where a shipped model does not
    come from its one home: a definition of :data:`LOADERS` or a ``HybridLM.from_pretrained`` call outside
    ``serve/runnable.py``, ``serve.runnable`` imported outside ``serve/`` (and ``lab/models.py``), or a name of
    :data:`SHIPPED` imported from any module but ``serve.runnable`` (in ``serve/``) or ``lab.models`` (elsewhere)."""
    me = module_of(path)
    rel = path.relative_to(REPO)
    home = me == MODEL_HOME
    serve_side = package_of(me).split(".")[0] == "serve"           # serve/ and tests/serve/
    want = MODEL_HOME if serve_side or me == MODEL_DOOR else MODEL_DOOR
    errors = []
    for node in nodes_of(source):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in LOADERS and not home:
            errors.append(f"{rel}:{node.lineno}: defines {node.name} (only {MODEL_HOME} defines the shipped models)")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_pretrained"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "HybridLM" and not home
                and me.split(".")[0] in LOADING_LAYERS):
            errors.append(f"{rel}:{node.lineno}: calls HybridLM.from_pretrained (only {MODEL_HOME} loads weights)")
    for imp in imports_of(source):
        if imp.module == MODEL_HOME and want != MODEL_HOME:
            errors.append(f"{rel}:{imp.line}: imports {MODEL_HOME} (outside serve/, the models come from {want})")
        elif imp.name in SHIPPED and imp.module != want:
            errors.append(f"{rel}:{imp.line}: imports {imp.name} from {imp.module} (it comes from {want})")
    return list(dict.fromkeys(errors))          # one line per import statement, not per name in it


def test_shipped_models_come_from_one_place():
    """``demo_model`` is defined once (``serve/runnable.py``) and reached through one door per side: lab/prefix.py
    re-exported it and lab.batching, lab.state_write and bench.replay_ssm_batch imported it from there;
    lab.state_precision and lab.drafters loaded the trained weights a second time with their own from_pretrained."""
    errors = [e for path in _files() for e in model_source_violations(path, path.read_text())]
    assert not errors, "\n".join(errors)


MODEL_BAD = {   # a second source of a model per kind, in a file that has none: each must be reported once
    "lab/batching.py": "from lab.prefix import demo_model",                       # the old hub
    "lab/prefix.py": "def demo_model(preset):\n    return None",                   # a second definition
    "lab/state_precision.py": "def f():\n    return HybridLM.from_pretrained(MODEL_PATH)",   # a second loader
    "app_pages/acceptance.py": "from lab.drafters import draft_model",
    "bench/batch.py": "from serve.runnable import demo_model",                    # bench goes through lab.models
    "lab/ring.py": "import serve.runnable",
    "serve/fleet/sim/service_model.py": "from lab.models import demo_model",      # serve's home is serve.runnable
}


@pytest.mark.parametrize("path", list(MODEL_BAD))
def test_a_second_model_source_is_caught(path):
    file = REPO / path
    assert model_source_violations(file, file.read_text()) == []
    found = model_source_violations(file, file.read_text() + "\n" + MODEL_BAD[path] + "\n")
    assert len(found) == 1, found


# --- import cycles ----------------------------------------------------------------------------------------
CYCLE_LAYERS = ("kda_core", "serve", "lab", "pages", "app_pages", "app", "conformance")   # the app's code (not tests, bench)


def _module_file(module: str) -> Path | None:
    """The file of our module ``module`` (``a.b`` -> ``a/b.py`` or ``a/b/__init__.py``), None if not ours."""
    base = REPO.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` (module -> source) it imports, at any depth (function-level
    imports count: they run when the function does). ``from a import b`` is an edge to ``a.b`` when that is a
    module, else to ``a``; a package's ``__init__`` is its own node (importing ``a.b`` runs ``a/__init__.py``,
    but an ``__init__`` holding only a docstring closes no cycle)."""
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for me, source in sources.items():
        for imp in imports_of(source):
            target = f"{imp.module}.{imp.name}" if imp.name and f"{imp.module}.{imp.name}" in sources else imp.module
            if target in sources and target != me:
                graph[me].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _sources() -> dict[str, str]:
    return {module_of(p): p.read_text() for p in _files() if module_of(p).split(".")[0] in CYCLE_LAYERS}


def test_no_import_cycle():
    """No two modules of the app import each other, directly or through others, at module or function level (a
    deferred import inside a function hides a cycle instead of removing it)."""
    assert import_cycles(import_graph(_sources())) == []


@pytest.mark.parametrize("path, extra, cycle", [
    ("serve/fleet/sim/replica.py", "def f():\n    from serve.fleet.sim.simulation import FleetSim\n",
     ["serve.fleet.sim.replica", "serve.fleet.sim.simulation"]),
    ("lab/fleet.py", "def f():\n    from lab.real_scale import make_policy\n", ["lab.fleet", "lab.real_scale"]),
    ("serve/traces/limits.py", "from serve.traces import mooncake\n", ["serve.traces.limits", "serve.traces.mooncake"]),
], ids=["replica-simulation", "fleet-real_scale", "traces-limits"])
def test_a_cycle_is_caught(path, extra, cycle):
    """Proof the cycle test can fail: the two cycles this tree had (replica <-> simulation, lab.fleet <->
    lab.real_scale through a deferred import), put back, and one through ``from package import module``."""
    sources = _sources()
    module = module_of(REPO / path)
    sources[module] += "\n" + extra
    assert cycle in import_cycles(import_graph(sources))


# --- the packages and their direction ---------------------------------------------------------------------
PACKAGES = sorted(str(p.parent.relative_to(REPO)) for p in (REPO / "serve").rglob("__init__.py")
                  if p.parent != REPO / "serve" and p.parent != REPO / "serve" / "fleet")   # fleet: sub-package table
FLEET_ORDER = ("serve.fleet.routing", "serve.fleet.scaling", "serve.fleet.sim")   # each imports only those before it


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_in_its_package_table(package):
    """Each package's docstring is its map: it names every module file of the package."""
    init = REPO / package / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    missing = [p.name for p in sorted((REPO / package).glob("*.py")) if p.name not in ("__init__.py", "__main__.py") and p.name not in doc]
    assert not missing, f"{package}/__init__.py's table does not name {missing}"


def test_the_old_flat_modules_are_gone():
    for old in ("serve/traces.py", "serve/azure_trace.py", "serve/trace_limits.py", "serve/vtc_artifact.py",
                "serve/spec", "serve/fleet/simulation.py", "serve/fleet/router.py",
                "serve/spec_decode/replay_state_write.py", "serve/engine.py", "serve/scheduler.py",
                "serve/model_runner.py", "serve/request.py", "serve/sampling.py"):
        assert not (REPO / old).exists(), old


def test_fleet_sub_packages_import_one_way():
    """routing <- scaling <- sim: routing imports neither of the others, scaling not sim; the fleet's root holds
    only the real-scale replica beside the sub-packages."""
    errors = []
    for path in sorted((REPO / "serve" / "fleet").rglob("*.py")):
        me = module_of(path)
        mine = next((i for i, p in enumerate(FLEET_ORDER) if me == p or me.startswith(p + ".")), None)
        if mine is None:
            continue
        for imp in imports_of(path.read_text()):
            theirs = next((i for i, p in enumerate(FLEET_ORDER) if imp.module == p or imp.module.startswith(p + ".")),
                          None)
            if theirs is not None and theirs > mine:
                errors.append(f"{path.relative_to(REPO)}:{imp.line}: {me} imports {imp.module}")
    assert not errors, "\n".join(errors)
    assert sorted(p.name for p in (REPO / "serve" / "fleet").glob("*.py")) == ["__init__.py", "real_replica.py"]
