"""lab.kcp: flat rows of a run, the comparison with the one-rank run, the projection
model and the byte comparison against MLA (page 10's numbers)."""
import math
import sys
import types

import pytest

from kda_core.config import PRESETS
from lab.kcp import PhaseCosts, RankRow, bytes_vs_context, compare_with, phase_costs, project, single_rank
from serve.parallel.launch import run_ranks
from serve.parallel.run import KCPConfig

SMALL = dict(seq_len=150, num_heads=2, head_k_dim=16, head_v_dim=12, start_method="forkserver", timeout_s=60)


def _row(rank, start, end, **ms):
    t = {f"{p}_ms": ms.get(p, 0.0) for p in ("prepare", "summary", "exchange", "fold", "scan", "output")}
    return RankRow(rank, start, end, *t.values(), sum(t.values()), 0, 0, math.nan, math.nan)


@pytest.mark.parametrize("variant", ["allgather", "ring"])
def test_compare_with_single_rank(variant, ranks_gone):
    ref = single_rank(KCPConfig(world_size=1, **SMALL))
    ranks_gone(ref.pids)
    rows = compare_with(KCPConfig(world_size=3, variant=variant, **SMALL), ref)
    assert [(r.start, r.end) for r in rows] == [(0, 50), (50, 100), (100, 150)]
    assert all(r.max_abs_err_o <= 1e-5 for r in rows)
    assert math.isnan(rows[0].max_abs_err_state) and rows[-1].max_abs_err_state <= 1e-5
    assert all(r.total_ms > 0 and r.prepare_ms > 0 and r.scan_ms > 0 for r in rows)


def test_compare_with_rejects_a_different_reference():
    ref = single_rank(KCPConfig(world_size=1, **SMALL))
    with pytest.raises(ValueError, match="reference must be single_rank"):
        compare_with(KCPConfig(world_size=2, **{**SMALL, "seq_len": 151}), ref)
    with pytest.raises(ValueError, match="single_rank needs world_size = 1"):
        single_rank(KCPConfig(world_size=2, **SMALL))


def test_phase_costs():
    single = [_row(0, 0, 1000, prepare=500, scan=200, output=100)]
    multi = [_row(0, 0, 500, summary=40, fold=0.0), _row(1, 500, 1000, summary=60, fold=3.0)]
    c = phase_costs(single, multi)
    assert c == PhaseCosts(0.5, 0.1, 0.2, 0.1, 3.0)
    with pytest.raises(ValueError, match="one-rank run"):
        phase_costs(multi, multi)
    with pytest.raises(ValueError, match=">= 2 ranks"):
        phase_costs(single, single)


def test_project():
    c = PhaseCosts(0.5, 0.1, 0.2, 0.1, 3.0)
    pts = project(c, 800.0, 1000, [1, 2, 4], "allgather", 1, 4, 128, 128, bandwidth_gbps=1.0)
    assert pts[0].total_ms == 800.0 and pts[0].speedup == 1.0
    hop = 4 * 128 * 256 * 4 / 1e9 * 1e3                                    # ms per payload at 1 GB/s
    assert pts[1].compute_ms == pytest.approx(500 * 0.9 + 3.0)
    assert pts[2].total_ms == pytest.approx(250 * 0.9 + 3 * 3.0 + 3 * hop)
    assert pts[2].speedup == pytest.approx(800.0 / pts[2].total_ms)
    ring = project(c, 800.0, 1000, [4], "ring", 1, 4, 128, 128, bandwidth_gbps=1.0)[0]
    assert ring.total_ms == pytest.approx(250 * (0.5 + 4 * 0.2 + 0.1) + 3 * 4 * 128 * 128 * 4 / 1e6)
    slow = project(c, 800.0, 1000, [4], "allgather", 1, 4, 128, 128, bandwidth_gbps=0.01)[0]
    assert slow.speedup < pts[2].speedup
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        project(c, 800.0, 1000, [2], "ring", 1, 4, 128, 128, bandwidth_gbps=0)
    with pytest.raises(ValueError, match="seq_len must be an int >= world_size"):
        project(c, 800.0, 3, [4], "ring", 1, 4, 128, 128, bandwidth_gbps=1.0)


def test_bytes_vs_context_kimi_linear():
    cfg = PRESETS["kimi-linear-48b-a3b"]
    rows = bytes_vs_context(cfg, [4096, 65536, 2 ** 20], 2, "allgather")
    per_layer = 32 * 128 * (128 + 128) * 4 + (2 * 32 * 128 + 32 * 128) * 3 * 4   # summaries + conv halo
    assert [r.kcp_bytes for r in rows] == [20 * per_layer] * 3 == [86_835_200] * 3
    assert rows[1].mla_bytes == 7 * 32768 * (512 + 64) * 2 == 264_241_152
    assert rows[2].mla_bytes == 16 * rows[1].mla_bytes
    ring = bytes_vs_context(cfg, [4096], 4, "ring")[0]
    assert ring.kcp_bytes == 20 * (32 * 128 * 128 * 4 + 3 * (2 * 32 * 128 + 32 * 128) * 3 * 4)
    assert ring.mla_bytes == 7 * 3072 * 576 * 2


def _ok(rank, world_size):
    return rank


def test_page_script_does_not_rerun_in_ranks(tmp_path, monkeypatch, ranks_gone):
    """Bug found on page 10: under Streamlit, __main__ is the page script, and spawn/forkserver children
    re-import __main__, so every rank re-ran the page. The launcher hides __main__ while it starts ranks."""
    marker = tmp_path / "ran"
    script = tmp_path / "page.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    fake = types.ModuleType("__main__")
    fake.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", fake)
    out = run_ranks(_ok, 2, start_method="forkserver", timeout_s=60)
    ranks_gone(out.pids)
    assert out.results == [0, 1] and not marker.exists()
    assert sys.modules["__main__"] is fake


def test_kcp_experiment_one_call():
    """Page 10's call: baseline + ranks compared, bytes for both models, projection for every bandwidth."""
    from lab.kcp import BANDWIDTHS_GBPS, MODELS, kcp_experiment

    run = kcp_experiment(150, 3, 2, 16, 12, "ring", True, timeout_s=60)
    assert [(r.start, r.end) for r in run.ranks] == [(0, 50), (50, 100), (100, 150)] and len(run.single) == 1
    assert run.worst_error <= run.tolerance and run.speedup == run.single_ms / run.slowest_ms
    assert set(run.bytes.model) == set(MODELS.values()) and run.bytes_world_size == 3
    assert sorted(run.projection.bandwidth_gbps.unique()) == list(BANDWIDTHS_GBPS) and run.costs is not None
    assert run.ranks[-1].received_bytes == run.formula_received
    one = kcp_experiment(150, 1, 2, 16, 12, "allgather", False, timeout_s=60)
    assert one.costs is None and one.projection.empty and one.bytes_world_size == 2


def test_kcp_experiment_repeats_spread_and_fair_baselines():
    """Every run is >= 5 timed repeats with its spread; the one-thread baseline is the one-rank run, the
    phase gap sets the slowest rank against the one-rank per-token costs, and the in-process baselines time
    the same kda_chunk with several threads."""
    from lab.kcp import REPEATS, kcp_experiment, one_rank_baselines

    run = kcp_experiment(150, 2, 2, 16, 12, "allgather", False, timeout_s=60)
    assert REPEATS >= 5 and run.conditions.repeats == REPEATS and run.conditions.torch_threads == 1
    for t in (run.single_timing, run.kcp_timing):
        assert len(t.samples_s) == REPEATS and t.min_s <= t.q1_s <= t.median_s <= t.q3_s <= t.max_s
    assert run.single_timing.median_s * 1e3 == pytest.approx(run.single_ms)
    assert list(run.gap.phase) == list(run.phases)
    slow = max(run.ranks, key=lambda r: r.total_ms)
    assert run.gap.measured_ms.tolist() == pytest.approx([getattr(slow, f"{p}_ms") for p in run.phases])
    assert run.gap.set_index("phase").loc[["summary", "exchange", "fold"]].one_rank_ms.eq(0).all()
    timings, cond = one_rank_baselines(150, 2, 16, 12, False, (1, 2))
    assert [t.label for t in timings] == ["1 rank in this process, 1 thread(s)", "1 rank in this process, 2 thread(s)"]
    assert all(len(t.samples_s) >= 5 and t.median_s > 0 for t in timings) and cond.torch_threads == 2
    with pytest.raises(ValueError, match="threads"):
        one_rank_baselines(150, 2, 16, 12, False, (0,))
    with pytest.raises(ValueError, match="thread_counts"):
        one_rank_baselines(150, 2, 16, 12, False, ())


def _timing(label, *ms):
    from lab.timing import summarize

    return summarize(label, [m / 1e3 for m in ms])


def test_speedup_is_against_the_best_one_rank_baseline():
    """Page 10 printed "2 ranks are 6.65x as fast as one rank given every core": the 2-thread one-rank baseline
    was oversubscribed (5,557 ms against 881 ms for one thread) and the ratio was taken against it. The speedup
    must be against the fastest one-rank configuration measured, with its spread."""
    from lab.kcp import speedup_vs_best

    one = _timing("1 rank, 1 thread", 870, 875, 881, 890, 900)
    many = _timing("1 rank in this process, 2 thread(s)", 5400, 5500, 5557, 5600, 5700)
    kcp = _timing("2 ranks, 1 thread each", 820, 830, 835, 840, 850)
    sp = speedup_vs_best([many, one], kcp)
    assert sp.baseline is one and sp.baselines == 2
    assert sp.speedup == pytest.approx(881 / 835) and sp.speedup < 1.1        # not 5557 / 835 = 6.65
    assert sp.iqr_low == pytest.approx(875 / 840) and sp.iqr_high == pytest.approx(890 / 830)
    assert sp.worst == pytest.approx(870 / 850) and sp.best == pytest.approx(900 / 820)
    assert speedup_vs_best([one, many], kcp) == sp                           # order does not matter
    fast_many = _timing("1 rank in this process, 2 thread(s)", 500, 510, 520, 530, 540)
    assert speedup_vs_best([one, fast_many], kcp).baseline is fast_many       # more threads win when they are faster
    with pytest.raises(ValueError, match="baselines"):
        speedup_vs_best([], kcp)
