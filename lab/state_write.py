"""ReplaySSM as the batched engine's decode-time state write, measured against the slot write (page 01's last
section, ``bench/replay_ssm_batch.py``). Plain data out; no Streamlit.

:func:`state_write_sweep` runs B requests, all decoding, through the real :class:`serve.engine.ServeEngine`
with ``state_write="slot"`` and with ``state_write="replay_ssm"`` at each ring size, interleaved: per repeat
every engine runs one window of decode steps (rotating order), after one warm-up window. The bytes each
decode row wrote (state, conv window, records) are COUNTED by the engine's model runner over the measured
windows; the step time is MEASURED (wall, one torch thread). ``window x repeats`` should be a multiple of
every ring size, so each ring's measured steps cover whole flush periods (the rows start in phase and all
flush on the same step; staggered arrivals spread the flushes but keep the mean per period).
:func:`predicted_bytes` gives the formula (:func:`serve.memory.replay_state_write.decode_write_bytes`)
for the demo model and Kimi K3 (fp32) at each ring size, for the first render.
"""
from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import torch

from kda_core.config import PRESETS
from lab.batching import decoding_engine, time_steps
from lab.models import demo_model
from lab.timing import Conditions, conditions
from serve.errors import check_int
from serve.memory.replay_state_write import decode_write_bytes

BATCHES = (1, 2, 4, 8, 16, 32, 64)
RING_SIZES = (4, 8, 16, 32, 64)


class StateWriteSweep(NamedTuple):
    """rows: one per (batch, state write): ``batch``, ``state_write`` ("slot" / "ReplaySSM R=…"),
    ``ring_size`` (0 for the slot write), ``step_ms`` (median of the per-window mean step times, measured),
    ``step_q1_ms`` / ``step_q3_ms`` (quartiles of those), ``speedup_vs_slot`` (slot step_ms ÷ this step_ms,
    same batch, same run; > 1 = faster), ``state_B`` / ``conv_B`` / ``records_B`` / ``total_B`` (bytes one
    request wrote per decode step, counted), ``predicted_total_B`` (formula). conditions: when / how."""

    rows: list
    conditions: Conditions
    window: int


def predicted_bytes(ring_sizes=RING_SIZES, models=("demo", "kimi-k3")) -> list[dict]:
    """Bytes one request writes per plain decode step, whole model, fp32, by the formula: per model, the slot
    write (``ring_size`` 0) and ReplaySSM at each ring size; columns model, ring_size, state_B, conv_B,
    records_B, total_B, vs_slot (total ÷ the slot write's)."""
    rows = []
    for name in models:
        cfg = PRESETS[name]
        slot = sum(decode_write_bytes(cfg, None).values())
        for R in (None, *ring_sizes):
            b = decode_write_bytes(cfg, R)
            total = sum(b.values())
            rows.append({"model": name, "ring_size": R or 0, "state_B": b["state"], "conv_B": b["conv"],
                         "records_B": b["records"], "total_B": total, "vs_slot": total / slot})
    return rows


def state_write_sweep(batches=(1, 4, 16), ring_sizes=(4, 16), window: int = 4, repeats: int = 8,
                      progress=None) -> StateWriteSweep:
    """Measure decode step time and count bytes written per decode step, slot write vs ReplaySSM (see the
    module docstring). ``progress(fraction)`` is called as it goes. Raises ValueError for an empty or bad
    ``batches`` / ``ring_sizes``, ``window`` < 1 or ``repeats`` < 5."""
    if not batches or not ring_sizes:
        raise ValueError("batches and ring_sizes must each name at least one size")
    for b in batches:
        check_int("batch", b)
    for r in ring_sizes:
        check_int("ring_size", r)
    check_int("window", window)
    cond = conditions(repeats, 1)
    torch.set_num_threads(1)
    model = demo_model("demo")
    variants = [("slot", 0)] + [("replay_ssm", r) for r in ring_sizes]
    steps = window * (repeats + 1) + 2
    rows, total, done = [], len(batches) * repeats, 0
    for b in batches:
        engines = {v: decoding_engine(model, b, steps, state_write=v[0], ring_size=v[1] or 1) for v in variants}
        for eng in engines.values():
            time_steps(eng, window)                                     # warm-up window
        before = {v: dict(e.runner.decode_bytes) for v, e in engines.items()}
        secs = {v: [] for v in variants}
        for rep in range(repeats):
            for i in range(len(variants)):
                v = variants[(rep + i) % len(variants)]
                secs[v].append(time_steps(engines[v], window) / window)
            done += 1
            if progress is not None:
                progress(done / total)
        base = statistics.median(secs[variants[0]])
        for v in variants:
            ms = sorted(1e3 * s for s in secs[v])
            q1, med, q3 = statistics.quantiles(ms, n=4, method="inclusive")
            wrote = {k: (engines[v].runner.decode_bytes[k] - before[v][k]) / (b * window * repeats) for k in before[v]}
            rows.append({"batch": b, "state_write": "slot" if not v[1] else f"ReplaySSM R={v[1]}", "ring_size": v[1],
                         "step_ms": med, "step_q1_ms": q1, "step_q3_ms": q3, "speedup_vs_slot": base * 1e3 / med,
                         "state_B": wrote["state"], "conv_B": wrote["conv"], "records_B": wrote["records"],
                         "total_B": sum(wrote.values()),
                         "predicted_total_B": sum(decode_write_bytes(model.cfg, v[1] or None).values())})
    return StateWriteSweep(rows, cond, window)


def replay_read_ms(batch: int, ring_size: int, repeats: int = 5) -> float:
    """Measured median ms of the ReplaySSM read at its worst step (every row replays ``ring_size - 1``
    records onto its checkpoint, all KDA layers of the demo model), after a warm-up; one torch thread."""
    from serve.memory.replay_state_write import ReplayStateWrite
    check_int("batch", batch)
    cfg = demo_model("demo").cfg
    gen = torch.Generator().manual_seed(0)
    rings = ReplayStateWrite(cfg, ring_size)
    H, K, V = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
    rids = list(range(batch))
    for _ in range(ring_size - 1):
        recs = {i: (torch.randn(batch, H, K, generator=gen), torch.randn(batch, H, V, generator=gen),
                    -torch.rand(batch, H, K, generator=gen)) for i in cfg.kda_layers}
        rings.commit(rids, recs, [False] * batch, [False] * batch)
    states = {i: torch.randn(batch, H, K, V, generator=gen) for i in cfg.kda_layers}
    times = []
    for _ in range(repeats + 1):
        work = {i: s.clone() for i, s in states.items()}
        t0 = time.perf_counter()
        rings.read(rids, work)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3
