"""Ours beside llama.cpp and transformers, as recorded by ``python -m bench.peers`` (``bench/results/peers.json``):
the table, the goals each row is held to, and the one-line stamp that says when, where and under which load it was
recorded. Plain data for page 16 and for the README sections the bench regenerates; nothing here measures.

The results file (written by :mod:`bench.peers`) holds ``rows``: one per measure and thread count, each with
``measure`` ("prefill" or "decode"), ``size`` (prompt tokens for a prefill, batch rows for a decode), ``threads``,
``flops_per_token`` (FLOP, the model's arithmetic per token at that row's context), and per engine (:data:`ENGINES`)
a spread of tokens/s (``median``, ``min``, ``max``, ``samples``) or None where that engine did not run; and
``matmul_gflops``: per thread count (as a string key) the spread of this machine's fp32 matmul rate (GFLOP/s).

Goals (:data:`GOALS`, from the engine's plan): decode tokens/s at batch >= 8 at least llama.cpp's, at batch 1 at
least half of llama.cpp's; decode at every batch at least 10x transformers'; prefill at 1,024 tokens at least
llama.cpp's. A goal is judged on the ratio of medians in the same run; "not run" where a peer did not run.
"""
from __future__ import annotations

from typing import NamedTuple

import pandas as pd

from lab.shipped import read_shipped, result_path

BENCH = "peers"                                       # bench/results/peers.json
ENGINES = ("ours", "llama.cpp", "transformers")


class Goal(NamedTuple):
    """One goal: ``peer`` (an engine of :data:`ENGINES`), ``measure`` ("prefill" / "decode"), the row sizes it
    applies to (prompt tokens or batch rows, ``min_size`` to ``max_size`` inclusive; None: no upper end),
    ``min_ratio`` (ours / peer, medians, at least)."""

    peer: str
    measure: str
    min_size: int
    max_size: int | None
    min_ratio: float

    def applies(self, row: dict) -> bool:
        """True when ``row`` is of this goal's measure and size range."""
        return (row["measure"] == self.measure and row["size"] >= self.min_size
                and (self.max_size is None or row["size"] <= self.max_size))

    @property
    def label(self) -> str:
        """">= 0.5x llama.cpp"."""
        return f">= {self.min_ratio:g}x {self.peer}"


GOALS = (Goal("llama.cpp", "decode", 8, None, 1.0), Goal("llama.cpp", "decode", 1, 1, 0.5),
         Goal("transformers", "decode", 1, None, 10.0), Goal("llama.cpp", "prefill", 1024, 1024, 1.0))


def _median(row: dict, engine: str) -> float | None:
    spread = row.get(engine)
    return None if spread is None else float(spread["median"])


def ratio(row: dict, peer: str) -> float | None:
    """ours / ``peer`` of ``row``'s median tokens/s; None when either did not run."""
    ours, theirs = _median(row, "ours"), _median(row, peer)
    return None if ours is None or theirs is None or theirs <= 0 else ours / theirs


def limit_tokens_per_s(result: dict, row: dict) -> float | None:
    """The row's ceiling: this machine's median fp32 matmul rate at the row's thread count over the model's FLOPs
    per token (tokens/s); None when the matmul was not measured at that thread count."""
    mm = result.get("matmul_gflops", {}).get(str(row["threads"]))
    return None if mm is None else mm["median"] * 1e9 / row["flops_per_token"]


class Verdict(NamedTuple):
    """A goal judged on one row: ``row`` its label, ``threads``, ``goal`` (:attr:`Goal.label`), ``ratio`` (ours /
    peer, None when not run) and ``status`` ("met", "not met" or "not run")."""

    row: str
    threads: int
    goal: str
    ratio: float | None
    status: str


def row_label(row: dict) -> str:
    """"prefill 1,024 tokens" / "decode batch 8"."""
    return f"prefill {row['size']:,} tokens" if row["measure"] == "prefill" else f"decode batch {row['size']}"


def verdicts(result: dict) -> list[Verdict]:
    """Every goal of :data:`GOALS` on every row it applies to, in row order."""
    out = []
    for row in result["rows"]:
        for goal in GOALS:
            if goal.applies(row):
                r = ratio(row, goal.peer)
                status = "not run" if r is None else "met" if r >= goal.min_ratio else "not met"
                out.append(Verdict(row_label(row), row["threads"], goal.label, r, status))
    return out


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def _spread(s: dict | None) -> str:
    return "—" if s is None else f"{_num(s['median'])} ({_num(s['min'])}–{_num(s['max'])})"


def _ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}" if r >= 0.1 else f"{r:.3f}"


def peers_table(result: dict) -> pd.DataFrame:
    """The side-by-side table, one row per measure and thread count, as display strings: tokens/s median
    (min–max) per engine, ours / llama.cpp and ours / transformers (ratio of medians), the matmul-rate limit
    (tokens/s), ours as a share of it, and each goal on that row with its status."""
    by_row = {}
    for v in verdicts(result):
        by_row.setdefault((v.row, v.threads), []).append(f"{v.goal}: {v.status}")
    rows = []
    for row in result["rows"]:
        label, limit, ours = row_label(row), limit_tokens_per_s(result, row), _median(row, "ours")
        rows.append({"measure": label, "threads": row["threads"],
                     **{f"{e} (tokens/s)": _spread(row.get(e)) for e in ENGINES},
                     "ours ÷ llama.cpp": _ratio(ratio(row, "llama.cpp")),
                     "ours ÷ transformers": _ratio(ratio(row, "transformers")),
                     "limit (tokens/s)": _num(limit),
                     "ours % of limit": "—" if limit is None or ours is None else f"{100 * ours / limit:.1f} %",
                     "goals": "; ".join(by_row.get((label, row["threads"]), [])) or "—"})
    return pd.DataFrame(rows)


def markdown(df: pd.DataFrame) -> str:
    """``df`` as a GitHub markdown table (numbers right-aligned by the caller's strings; ``|`` escaped)."""
    cells = [[str(c).replace("|", "\\|") for c in row] for row in [list(df.columns), *df.astype(str).values]]
    lines = ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join([lines[0], "|" + "---|" * len(df.columns), *lines[1:]])


def stamp(result: dict) -> str:
    """When, where and how the table was recorded, in one line (never "live")."""
    load, host = result["load_avg_1m"], result["host"]
    return (f"Recorded {result['measured_at']} UTC on {host['cpu']} ({host['cores']} cores, shared), load average "
            f"{load['before']:.2f} → {load['after']:.2f} (1 min); median (min–max) of {result['repeats']} interleaved "
            f"repeats after {result['warmup']} warm-up; torch {host['torch']}, transformers "
            f"{host.get('transformers') or 'not run'}, llama.cpp {host.get('llama_cpp') or 'not run'}"
            + ("; --quick sizes" if result.get("quick") else ""))


def caveats(result: dict) -> list[str]:
    """What the reader must know to read the table: the machine was busy (a load average at or above its cores,
    where a 2-thread row measures contention for the cores more than the engine), or a ``--quick`` run."""
    out = []
    load, cores = result["load_avg_1m"], result["host"]["cores"]
    if max(load["before"], load["after"]) >= cores:
        out.append(f"The machine was busy: load average {load['before']:.1f} → {load['after']:.1f} on {cores} cores, "
                   "so other processes held the cores; rows at 2 threads then time the engines' threads waiting for "
                   "one another (oversubscription) more than their arithmetic. Compare rows at the same thread count.")
    if result.get("quick"):
        out.append("A --quick run: fewer decode steps per repeat and transformers' prefill at 128 tokens only.")
    return out


class Recorded(NamedTuple):
    """The recorded run: ``table`` (:func:`peers_table`), ``verdicts`` (:func:`verdicts` as a frame: row, threads,
    goal, ratio, status), ``stamp`` (:func:`stamp`), ``conditions`` (the bench's sizes and flags, one line each),
    ``caveats`` (:func:`caveats`), ``result`` (the file's JSON)."""

    table: pd.DataFrame
    verdicts: pd.DataFrame
    stamp: str
    conditions: list[str]
    caveats: list[str]
    result: dict


def recorded(result: dict) -> Recorded:
    """:class:`Recorded` of a results dict. Raises ValueError naming the missing key if it is not one."""
    try:
        return Recorded(peers_table(result), pd.DataFrame(verdicts(result), columns=Verdict._fields),
                        stamp(result), list(result.get("notes", [])), caveats(result), result)
    except (KeyError, TypeError) as err:
        raise ValueError(f"not a bench.peers result ({type(err).__name__}: {err})") from None


def recorded_peers() -> Recorded | None:
    """The committed run (``bench/results/peers.json``), or None while there is none. Raises ValueError naming the
    file if it holds something else."""
    path = result_path(BENCH)
    d = read_shipped(path)
    if d is None:
        return None
    try:
        return recorded(d)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
