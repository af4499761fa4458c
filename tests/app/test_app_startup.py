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
