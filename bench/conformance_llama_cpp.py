"""The conformance suite (``python -m conformance``) against llama.cpp's ``llama-server`` on our shipped weights
converted to GGUF, one thread, started by the suite once per setting it toggles::

    python -m bench.conformance_llama_cpp [--server PATH] [--gguf PATH] [--out PATH]

writes ``bench/results/conformance_llama_cpp.json``: the suite's report with llama.cpp's version, the date, the
command, and the findings of the recorded run (:data:`FINDINGS`: for a check that failed or was not applicable,
its minimal reproduction and whether it is llama.cpp's bug, a documented limitation or the check's error). A
finding is kept only while the check's status is the one it was written for; otherwise the report says to redo it.

Defaults: the llama.cpp tree ``bench.llama_cpp`` builds in ``$KDA_LAB_CACHE`` (default ``~/.cache/kda-lab``),
``llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server``, and the GGUF its converter writes for
``weights/kda-demo``, ``gguf/kda-demo-f32.gguf``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

from conformance.adapters import LlamaCpp
from conformance.launch import Launched
from conformance.registry import CHECKS
from conformance.suite import RunSettings, run_suite

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("KDA_LAB_CACHE", Path.home() / ".cache" / "kda-lab"))
SERVER = CACHE / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"
GGUF = CACHE / "gguf" / "kda-demo-f32.gguf"
OUT = REPO / "bench" / "results" / "conformance_llama_cpp.json"
SERVER_ARGS = ("-t", "1", "-tb", "1", "-np", "4", "-c", "4096", "--no-webui")   # one thread; 4 slots of 1,024
SEED = 0

# check id -> (the status it was written for, the finding). Written after reading the recorded run's evidence and
# the server logs (--log-dir); see the module docstring.
FINDINGS: dict[str, tuple[str, str]] = {}


def version(server: Path) -> str:
    """``llama-server --version``'s version line (build and commit)."""
    run = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
    line = next((ln for ln in (run.stdout + run.stderr).splitlines() if ln.startswith("version:")), "")
    return line.removeprefix("version:").strip() or "unknown"


def findings(report: dict, written: dict = FINDINGS) -> list[str]:
    """One line per check that did not pass: its finding when the check's status is the one it was written for,
    else a line saying the recorded status has no finding yet."""
    out = []
    for c in report["checks"]:
        if c["status"] == "pass":
            continue
        status, text = written.get(c["id"], (None, ""))
        out.append(f"{c['id']} ({c['status']}): {text}" if status == c["status"] else
                   f"{c['id']} ({c['status']}): no finding written for this status yet ({c['summary']})")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.conformance_llama_cpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", type=Path, default=SERVER, help="llama-server (default: %(default)s)")
    p.add_argument("--gguf", type=Path, default=GGUF, help="the converted weights (default: %(default)s)")
    p.add_argument("--out", type=Path, default=OUT, help="the report (default: %(default)s)")
    p.add_argument("--log-dir", type=Path, default=None, help="keep each setting's server log here")
    args = p.parse_args(argv)
    for what, path in (("--server", args.server), ("--gguf", args.gguf)):
        if not path.is_file():
            p.error(f"{what}: {path} not found (bench.llama_cpp builds llama.cpp and converts weights/kda-demo)")
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    ver = version(args.server)
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    target = Launched(LlamaCpp(), [str(args.server), "-m", str(args.gguf), *SERVER_ARGS], log_dir=args.log_dir)
    report = run_suite(target, list(CHECKS.values()),
                       RunSettings(seed=SEED, extra={"version": ver, "date": date, "gguf": args.gguf.name}))
    print(report.table())
    out = report.to_json()
    out["findings"] = findings(out)
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
