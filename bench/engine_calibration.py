"""Vidur-style operator profiling of the batched engine on this machine, for ``bench/sim_vs_engine.py``:
:func:`calibrate` times single engine steps of known composition and fits the fleet simulator's step model
(:class:`serve.fleet.sim.service_model.ServiceModel`) to them, twice: on wall time and on the engine thread's
CPU time (``time.thread_time``). The CPU-time fit hardly moves when other processes load the shared cores;
the wall-time fit is what the engine alone gets under the load of the moment.
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from bench.engine_timeline import predicted_step_ms
from kda_core.chunk import CHUNK_SIZE
from serve.engine.model_runner import DECODE_BUCKETS
from serve.engine.request import RequestStatus
from serve.fleet.sim.service_model import ServiceModel, attention_pairs
from serve.http.model import EngineSpec, build_engine

REPEATS = 5
PREFILL = ((32, 0, 1), (128, 0, 1), (256, 0, 1), (512, 0, 1), (1000, 0, 1), (256, 512, 1), (32, 0, 8), (128, 0, 4),
           (512, 16, 1))
HELD_OUT = ((768, 0, 0, 0, 1), (128, 256, 0, 0, 1), (256, 48, 0, 0, 1), (64, 0, 0, 0, 4), (128, 0, 4, 256, 1),
            (256, 0, 16, 128, 1), (64, 0, 8, 256, 3))


def fit_step_model(points: dict[tuple, float], source: str) -> ServiceModel:
    """Least squares of ``step_ms = fixed (larger with prefill rows) + prompts * per_row + new tokens / rate +
    attention pairs * per_pair + new tokens cached off the 64-token grid * per_off_grid + decode rows * per_seq +
    decode rows * context * per_context`` over ``points``
    ``{(new tokens per prompt, cached tokens, decode rows, context, prompts): ms}``, each coefficient clipped at 0
    (:class:`ServiceModel` with ``mixed_steps``, the engine's decode buckets). Raises ValueError with fewer than
    8 points (8 coefficients)."""
    if len(points) < 8:
        raise ValueError(f"fit_step_model needs >= 8 points, got {len(points)}")
    a = np.array([[n > 0, n == 0, k * n, k * attention_pairs(n, c) if n else 0, k if n else 0,
                   k * n * (c % CHUNK_SIZE != 0), b, b * x] for n, c, b, x, k in points], dtype=float)
    coef, *_ = np.linalg.lstsq(a, np.array(list(points.values())), rcond=None)
    fixed_p, fixed, per_tok, per_pair, per_row, off_grid, per_seq, per_ctx = (max(float(v), 0.0) for v in coef)
    return ServiceModel(prefill_tokens_per_s=1000.0 / max(per_tok, 1e-6), prefill_overhead_ms=fixed_p,
                        decode_step_base_ms=max(fixed, 1e-3), decode_step_per_seq_ms=per_seq, max_batch_requests=64,
                        decode_per_context_token_ms=per_ctx, decode_buckets=DECODE_BUCKETS,
                        prefill_per_token_pair_ms=per_pair, prefill_per_row_ms=per_row,
                        prefill_off_grid_per_token_ms=off_grid, prefill_grid_tokens=CHUNK_SIZE, mixed_steps=True,
                        source=source)


def calibrate(model, prefill=PREFILL, batches=(1, 4, 16), contexts=(32, 512), held_out=HELD_OUT,
              repeats: int = REPEATS) -> tuple[ServiceModel, ServiceModel, dict]:
    """Fit the step model to steps of the BATCHED engine timed alone, in this process.

    Points ``(new tokens, cached tokens, decode rows, context, prompts)``: a prefill step of ``prompts`` prompts
    of each ``prefill`` ``(new, cached, prompts)`` (cached > 0: the prompt extends one run before, so the step
    restores its checkpoint) and a
    decode step of ``batches`` running requests of each of ``contexts`` tokens; each the median of ``repeats``
    timings after one warm-up round, the points interleaved (round r times every point once), on the server's
    engine (prefix cache on, max_num_seqs 64, ``torch.inference_mode`` as in the server's loop). The
    ``held_out`` points (a longer prompt, a prompt after a hit, mixed steps) are measured the same way and NOT
    fitted: their prediction error validates the step model.
    Returns ``(cpu_model, wall_model, {"steps": rows, "repeats"})``: the step model fitted to the engine
    thread's CPU time and to wall time (:func:`fit_step_model`), and per point its measured medians, spread and
    both predictions. Raises RuntimeError if a cached point does not get its hit."""
    rng = np.random.default_rng(0)

    def step(n: int, hit: int, b: int, ctx: int, k: int) -> tuple[float, float]:
        """(wall ms, CPU ms) of one engine step: ``b`` decode rows of ``ctx`` tokens and ``k`` prefill rows of
        ``n`` new tokens after ``hit`` cached ones."""
        engine = build_engine(EngineSpec(max_num_seqs=64), model)
        base = rng.integers(0, 256, hit + n).tolist()
        if hit:                                        # run base[:hit + 1] so a checkpoint lands at ``hit``
            rid = engine.submit(base[: hit + 1], 1)
            while engine.result(rid).status is not RequestStatus.FINISHED:
                engine.step()
        rids = [engine.submit(rng.integers(0, 256, ctx).tolist(), 8) for _ in range(b)]
        while any(engine.result(r).status is not RequestStatus.DECODE for r in rids):
            engine.step()
        rid = None
        for _ in range(k if n else 0):
            rid = engine.submit(base if hit else rng.integers(0, 256, n).tolist(), 2)
        c0, t0 = time.thread_time(), time.perf_counter()
        engine.step()
        wall, cpu = (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3
        if rid is not None and engine.result(rid).hit_tokens != hit:
            raise RuntimeError(f"calibration point with {hit} cached tokens got {engine.result(rid).hit_tokens}")
        return wall, cpu

    fitted = [(n, c, 0, 0, k) for n, c, k in prefill] + [(0, 0, b, c, 0) for c in contexts for b in batches]
    points = fitted + list(held_out)
    times: dict[tuple, list] = {pt: [] for pt in points}
    with torch.inference_mode():
        for r in range(repeats + 1):                       # round 0 is the warm-up
            for pt in points:
                t = step(*pt)
                if r:
                    times[pt].append(t)
    wall = {pt: statistics.median(w for w, _ in v) for pt, v in times.items()}
    cpu = {pt: statistics.median(c for _, c in v) for pt, v in times.items()}
    cpu_model = fit_step_model({pt: cpu[pt] for pt in fitted}, "fitted to the engine thread's CPU time of "
                               "batched-engine steps on this machine")
    wall_model = fit_step_model({pt: wall[pt] for pt in fitted}, "fitted to the wall time of batched-engine "
                                "steps timed alone on this machine")
    rows = []
    for pt in points:
        n, c, b, x, k = pt
        comp = {"decode_rows": b, "decode_context": b * x, "prefill": [[n, c]] * k if n else []}
        rows.append(dict(prefill_tokens=n, cached_tokens=c, prompts=k, decode_rows=b, decode_context=x,
                         role="fitted" if pt in fitted else "held out", measured_median_ms=wall[pt],
                         measured_min_ms=min(w for w, _ in times[pt]), measured_max_ms=max(w for w, _ in times[pt]),
                         predicted_ms=predicted_step_ms(wall_model, comp), cpu_median_ms=cpu[pt],
                         cpu_predicted_ms=predicted_step_ms(cpu_model, comp)))
    return cpu_model, wall_model, {"steps": rows, "repeats": repeats}
