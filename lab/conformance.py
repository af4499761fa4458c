"""Page 18's data: the KDA conformance suite (``conformance/``) as tables: each invariant with the bug it comes from
and its sources, our engine put through every check live (our server started in this process from
``python -m serve.http``'s flags, once per setting), the recorded llama.cpp run, and the commands that run the
suite against another engine."""
from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import pandas as pd

from conformance.launch import InProcess
from conformance.ours import Ours
from conformance.registry import CHECKS, select_checks
from conformance.suite import RunSettings, run_suite
from lab.shipped import read_shipped, result_path

LLAMA_CPP_BENCH = "conformance_llama_cpp"            # bench/results/conformance_llama_cpp.json
CHECK_IDS = tuple(CHECKS)
LIVE_SERVER = ("--max-model-len", "512", "--max-num-seqs", "4")
LIVE_SETTINGS = RunSettings(max_tokens=6, chunk_sizes=(16, 100), concurrency=3, seed=0)


def invariants() -> pd.DataFrame:
    """One row per check: id, title, the invariant, the bug class it comes from, its sources as Markdown links."""
    return pd.DataFrame([{"check": c.id, "title": c.title, "invariant": c.invariant, "bug": c.bug,
                          "sources": ", ".join(f"[{s.label}]({s.url})" for s in c.sources)} for c in CHECKS.values()])


def results_table(report: dict) -> pd.DataFrame:
    """A report's checks (the suite's JSON) as rows: check, status, summary, parts passed / failed / n/a."""
    rows = []
    for c in report["checks"]:
        count = {s: sum(p["status"] == s for p in c["parts"]) for s in ("pass", "fail", "n/a")}
        rows.append({"check": c["id"], "status": c["status"], "summary": c["summary"],
                     "parts pass / fail / n/a": f"{count['pass']} / {count['fail']} / {count['n/a']}"})
    return pd.DataFrame(rows)


class LiveRun(NamedTuple):
    """Our engine through the suite: ``table`` (:func:`results_table`), ``report`` (the suite's JSON) and
    ``report_json`` (its text), ``seconds`` of wall time, ``server`` (the flags it was started with)."""

    table: pd.DataFrame
    report: dict
    report_json: str
    seconds: float
    server: str


def live_run(checks=(), settings: RunSettings | None = None) -> LiveRun:
    """Put our server through ``checks`` (ids; empty: every check) now, with ``settings`` (None:
    :data:`LIVE_SETTINGS`): started in this process (small pool, ``LIVE_SERVER``), once per setting the checks need
    (the deployment, prefix cache off, speculative decoding, each chunk size), short prompts and few tokens.
    Raises ValueError naming an unknown check."""
    settings = LIVE_SETTINGS if settings is None else settings
    settings = dataclasses.replace(settings, checks=tuple(checks))
    t0 = time.perf_counter()
    report = run_suite(InProcess(Ours(), list(LIVE_SERVER)), select_checks(settings.checks), settings)
    return LiveRun(results_table(report.to_json()), report.to_json(), report.dumps(), time.perf_counter() - t0,
                   " ".join(LIVE_SERVER))


class Recorded(NamedTuple):
    """A recorded run: ``engine``, ``version``, ``date``, ``command`` (how the engine was started), ``table``
    (:func:`results_table`), ``findings`` (one line per check: what a failure or n/a means), ``report``."""

    engine: str
    version: str
    date: str
    command: str
    table: pd.DataFrame
    findings: list
    report: dict


def recorded_llama_cpp() -> Recorded | None:
    """The committed llama.cpp run (``bench/results/conformance_llama_cpp.json``), or None while there is none.
    Raises ValueError naming the file if it holds something other than a report."""
    path = result_path(LLAMA_CPP_BENCH)
    d = read_shipped(path)
    if d is None:
        return None
    try:
        s = d["settings"]
        return Recorded(d["engine"], s.get("version", "unknown"), s.get("date", "unknown"), d["target"],
                        results_table(d), list(d.get("findings", [])), d)
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a conformance report ({type(err).__name__}: {err})") from None


HOW_TO = (
    ("Any running engine (its deployment as it is)",
     "python -m conformance --engine llama.cpp --base-url http://127.0.0.1:8080 --model MODEL --json out.json"),
    ("Ours, started by the suite once per setting",
     'python -m conformance --engine ours --launch "python -m serve.http --max-model-len 512"'),
    ("llama.cpp, started by the suite (prefix cache per request; speculation and -b / -ub by flags)",
     'python -m conformance --engine llama.cpp --launch "llama-server -m model.gguf -t 1 -np 4 -c 4096"'),
    ("vLLM (written from its docs and code; not run here)",
     'python -m conformance --engine vllm --launch "vllm serve MODEL --enable-prefix-caching --mamba-cache-mode align '
     '--mamba-ssm-cache-dtype float32" --atol 0.02'),
    ("SGLang (written from its docs and code; not run here)",
     'python -m conformance --engine sglang --launch "python -m sglang.launch_server --model-path MODEL '
     '--mamba-radix-cache-strategy extra_buffer --page-size 64 --mamba-track-interval 256" --atol 0.02'),
)


AGREEMENT_BENCH = "llama_cpp_agreement"            # bench/results/llama_cpp_agreement.json


class Agreement(NamedTuple):
    """The recorded three-implementation run (``bench/results/llama_cpp_agreement.json``): ``table`` one row per
    held-out prompt (prompt, tokens, for each engine against transformers: max |delta logprob| of its top 5 tokens
    over 256 greedy positions, nats, and the first greedy position that differs, "all 256" when none);
    ``model`` the folder's name; ``date``; ``versions`` a one-line string."""

    table: pd.DataFrame
    model: str
    date: str
    versions: str


def _first_diff(e: dict | None) -> str:
    if e is None:
        return "not run"
    d = e["greedy_first_difference"]
    return f"all {e['n']}" if d is None else f"differs at {d}"


def recorded_agreement() -> Agreement | None:
    """Our engine, transformers and llama.cpp on the same weights (:data:`AGREEMENT_BENCH`), or None while the file
    is absent. Raises ValueError naming the file if it is not such a run."""
    path = result_path(AGREEMENT_BENCH)
    d = read_shipped(path)
    if d is None:
        return None
    try:
        rows = []
        for p in d["prompts"]:
            ours, llama = p.get("ours"), p["llama_cpp"]
            rows.append({"prompt": p["prompt"], "tokens": p["prompt_tokens"],
                         "ours max |Δ logprob|": None if ours is None else ours["max_abs_dlogprob"],
                         "ours greedy": _first_diff(ours),
                         "llama.cpp max |Δ logprob|": llama["max_abs_dlogprob"],
                         "llama.cpp greedy": _first_diff(llama)})
        v = d["versions"]
        versions = (f"llama.cpp {v['llama_cpp']['server_version']} ({v['llama_cpp']['sdist']}), transformers "
                    f"{v['transformers']}, torch {v['torch']}")
        return Agreement(pd.DataFrame(rows), d["model"]["folder"], d["date"], versions)
    except (KeyError, TypeError) as err:
        raise ValueError(f"{path} is not an agreement run ({type(err).__name__}: {err})") from None
