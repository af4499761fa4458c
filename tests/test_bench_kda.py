"""bench.kda: the executed-FLOP count per phase, the phase timing and the results file (small T, fast)."""
import json

import bench.kda as bk
from kda_core.chunk import kernel_in_use


def test_executed_flops_count_each_phase():
    C, d = bk.CHUNK_SIZE, bk.K
    fl = bk.executed_flops(2 * C)                   # 2 chunks x H heads
    units = 2 * bk.H
    assert fl["scan"] == units * 4 * C * d * d       # w S and K~^T v_new per chunk
    assert fl["outputs"] == units * (2 * C * C * d + 2 * C * d * d)
    assert fl["prepare"] == units * (10 * C * C * d + 2 * C ** 3 // 3)
    assert sum(fl.values()) > bk.paper_flops(2 * C, d)   # the implementation executes more than the paper counts


def test_main_writes_the_phases_and_a_legend(tmp_path, capsys):
    out = tmp_path / "kda.json"
    bk.main(["--no-table", "--repeats", "5", "--ratio-T", "128", "--out", str(out)])
    text = capsys.readouterr().out
    assert "ratio = the kernel's GFLOP/s" in text and "time goes" in text
    res = json.loads(out.read_text())
    ph = res["phases"]
    assert ph["T"] == 128 and all(ph[n]["cpu_ms"] > 0 for n in ("prepare", "scan", "outputs"))
    assert ph["floor_ms"] > 0 and res["roofline"][0]["threads"] == 1
    r = res["roofline"][0]
    assert r["fwd_torch"]["ms"]["median"] > 0 and r["fwd"]["speedup_vs_torch_form"]["median"] > 0
    assert "torch form" in text and res["conditions"]["forward_kernel"]
    # it names the path that ran and the CPU's vector width, and times every other path this CPU runs beside it
    cond = res["conditions"]
    assert f"this CPU: {cond['cpu_model']}, {cond['cpu_vector_bits']}-bit vector registers" in text
    assert f"forward, {kernel_in_use()} " in text
    for path in cond["other_paths_timed"]:
        assert r[f"fwd_{path}"]["ratio"]["median"] > 0 and r[f"fwd_{path}"]["speedup_vs_torch_form"]["median"] > 0
