"""lab.peers: the side-by-side table, the goals judged on it, the recorded stamp, and the committed file."""
import pandas as pd
import pytest

from lab.peers import GOALS, caveats, markdown, peers_table, recorded, recorded_peers, stamp, verdicts


def _spread(median):
    return {"median": median, "min": median * 0.9, "max": median * 1.1, "samples": [median] * 5}


def _result():
    """Two threads' matmul; ours faster than llama.cpp at batch 8, slower at batch 1 (but above half), no
    transformers at batch 64, and a prefill at 1,024 tokens slower than llama.cpp."""
    rows = [
        {"measure": "prefill", "size": 1024, "threads": 1, "flops_per_token": 4e6,
         "ours": _spread(2000.0), "llama.cpp": _spread(4000.0), "transformers": _spread(800.0)},
        {"measure": "decode", "size": 1, "threads": 1, "flops_per_token": 4e6,
         "ours": _spread(900.0), "llama.cpp": _spread(1500.0), "transformers": _spread(50.0)},
        {"measure": "decode", "size": 8, "threads": 2, "flops_per_token": 4e6,
         "ours": _spread(3000.0), "llama.cpp": _spread(2500.0), "transformers": _spread(400.0)},
        {"measure": "decode", "size": 64, "threads": 2, "flops_per_token": 4e6,
         "ours": _spread(5000.0), "llama.cpp": None, "transformers": None},
    ]
    return {"measured_at": "2026-12-07 19:00", "host": {"cpu": "AMD EPYC", "cores": 2, "torch": "2.13.0+cpu",
                                                        "transformers": "5.25.0", "llama_cpp": "0.5.0-dev"},
            "load_avg_1m": {"before": 1.5, "after": 2.25}, "repeats": 5, "warmup": 1, "quick": False,
            "matmul_gflops": {"1": _spread(40.0), "2": _spread(80.0)}, "rows": rows, "notes": ["how it ran"]}


def test_verdicts_judge_every_goal_on_its_rows():
    got = [(v.row, v.threads, v.goal, v.status) for v in verdicts(_result())]
    assert got == [
        ("prefill 1,024 tokens", 1, ">= 1x llama.cpp", "not met"),
        ("decode batch 1", 1, ">= 0.5x llama.cpp", "met"),             # 0.6
        ("decode batch 1", 1, ">= 10x transformers", "met"),           # 18
        ("decode batch 8", 2, ">= 1x llama.cpp", "met"),               # 1.2
        ("decode batch 8", 2, ">= 10x transformers", "not met"),       # 7.5
        ("decode batch 64", 2, ">= 1x llama.cpp", "not run"),
        ("decode batch 64", 2, ">= 10x transformers", "not run"),
    ]
    assert len(GOALS) == 4


def test_peers_table_ratios_limit_and_goals():
    t = peers_table(_result())
    assert list(t["measure"]) == ["prefill 1,024 tokens", "decode batch 1", "decode batch 8", "decode batch 64"]
    assert list(t["ours ÷ llama.cpp"]) == ["0.50", "0.60", "1.20", "—"]
    assert list(t["ours ÷ transformers"]) == ["2.50", "18.00", "7.50", "—"]
    # limit = matmul GFLOP/s at the row's threads / FLOPs per token: 40e9 / 4e6 = 10,000; 80e9 / 4e6 = 20,000
    assert list(t["limit (tokens/s)"]) == ["10,000", "10,000", "20,000", "20,000"]
    assert list(t["ours % of limit"]) == ["20.0 %", "9.0 %", "15.0 %", "25.0 %"]
    assert t["ours (tokens/s)"].iloc[1] == "900 (810–990)"
    assert t["goals"].iloc[2] == ">= 1x llama.cpp: met; >= 10x transformers: not met"


def test_markdown_and_stamp():
    md = markdown(pd.DataFrame({"a": ["x|y"], "b": [1]}))
    assert md == "| a | b |\n|---|---|\n| x\\|y | 1 |"
    s = stamp(_result())
    assert s.startswith("Recorded 2026-12-07 19:00 UTC on AMD EPYC (2 cores, shared), load average 1.50 → 2.25")
    assert "live" not in s.lower()


def test_caveats_name_a_busy_machine_and_a_quick_run():
    busy = _result()                                                   # load 1.5 -> 2.25 on 2 cores
    (note,) = caveats(busy)
    assert note.startswith("The machine was busy: load average 1.5 → 2.2 on 2 cores")
    quiet = {**busy, "load_avg_1m": {"before": 0.4, "after": 1.9}}
    assert caveats(quiet) == []
    assert caveats({**quiet, "quick": True}) == ["A --quick run: fewer decode steps per repeat and transformers' "
                                                 "prefill at 128 tokens only."]


def test_recorded_rejects_other_json():
    with pytest.raises(ValueError, match="not a bench.peers result"):
        recorded({"rows": "nope"})


def test_recorded_peers_reads_the_committed_run():
    rec = recorded_peers()
    assert rec is not None, "bench/results/peers.json is committed"
    assert rec.stamp.startswith("Recorded ") and rec.result["repeats"] >= 5
    assert set(rec.table["threads"]) == {1, 2}
    assert {"prefill 128 tokens", "prefill 1,024 tokens", "decode batch 64"} <= set(rec.table["measure"])
