"""ReplaySSM as the batched engine's decode-time state write vs the slot write: ``python -m bench.replay_ssm_batch``.

Demo model (6 KDA + 2 MLA layers, H = 4, K = V = 32, fp32), one torch thread, batch 1 … 64, ring 4 … 64:

1. step time and bytes per decode step (:func:`lab.state_write.state_write_sweep`): B requests all decoding in
   one :class:`serve.engine.ServeEngine` per state write, 8-step windows interleaved over 8 repeats after a
   warm-up window (64 measured steps: whole flush periods of every ring size); bytes COUNTED by the engine's
   runner, step time MEASURED; speedup = slot step time ÷ ReplaySSM step time in the same run.
2. where the time goes (MEASURED, median of 5 after a warm-up): the ReplaySSM read at its worst step (every row
   replays R - 1 records; :func:`lab.state_write.replay_read_ms`), the slot write's state + conv scatter of B
   rows vs the conv-only scatter a ReplaySSM step does (the difference is what a non-materialising step saves),
   and the rollback of B recorded verifies (``ReplaySSM.discard()``: a cursor move each).
3. bytes per verify (T = 1 + 3), PREDICTED by the formulas of ``bench.replay_ssm.bytes_written`` with one
   materialisation per R tokens (the engine's verify rows still write the committed state every step).

Writes ``bench/results/replay_ssm_batch.json`` and prints the tables.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.replay_ssm import bytes_written
from lab.batching import decoding_engine
from lab.models import demo_model
from lab.ring import prompt_state
from lab.state_write import BATCHES, RING_SIZES, predicted_bytes, replay_read_ms, state_write_sweep
from lab.threads import one_thread
from lab.timing import conditions
from serve.spec_decode.replay_ssm import ReplaySSM
from serve.spec_decode.verify import verify

OUT = Path(__file__).parent / "results" / "replay_ssm_batch.json"


def scatter_ms(batch: int, repeats: int = 5) -> dict[str, float]:
    """Median ms to write B rows' state + conv window (the slot write) and their conv windows only (a
    non-materialising ReplaySSM step), interleaved, after a warm-up."""
    model = demo_model("demo")
    eng = decoding_engine(model, batch, 4)
    pages = [eng.requests[r].state_pages for r in eng.running]
    dense, keep = eng.runner.gather_states(pages), list(range(batch))
    cases = {"state_and_conv_ms": lambda: eng.runner.scatter_states(pages, dense, keep),
             "conv_only_ms": lambda: eng.runner.scatter_conv(pages, dense, keep)}
    times = {k: [] for k in cases}
    for rep in range(repeats + 1):
        for k, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def rollback_ms(batch: int, ring_size: int, repeats: int = 5) -> float:
    """Median ms to discard B recorded 1 + 3-token verifies through ``ReplaySSM`` (B cursor moves)."""
    model = demo_model("demo")
    state = prompt_state(model)
    out = verify(model, state, [1, 2, 3])
    times = []
    for rep in range(repeats + 1):
        strats = [ReplaySSM(ring_size, 4) for _ in range(batch)]
        for s in strats:
            s.record(model, state.cache, out)
        t0 = time.perf_counter()
        for s in strats:
            s.discard()
        if rep:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--rings", type=int, nargs="+", default=list(RING_SIZES))
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    with one_thread():
        t0 = time.time()
        sweep = state_write_sweep(args.batches, args.rings, args.window, args.repeats,
                                  progress=lambda f: print(f"\r sweep {f:5.0%} ({time.time() - t0:.0f} s)", end=""))
        print()
        cost_cond = conditions(5, 1)
        costs = []
        for b in args.batches:
            row = {"batch": b, **scatter_ms(b)}
            for r in args.rings:
                row[f"replay_read_R{r}_ms"] = replay_read_ms(b, r)
            row["rollback_R16_ms"] = rollback_ms(b, 16)
            costs.append(row)
    cfg = demo_model("demo").cfg
    verify_bytes = {f"ring {r}": bytes_written(cfg, 4, 4, 4, 1 / r) for r in args.rings}
    result = {"conditions": sweep.conditions._asdict(), "cost_conditions": cost_cond._asdict(),
              "machine": platform.processor() or platform.machine(), "window_steps": sweep.window,
              "sweep": sweep.rows, "costs_ms": costs, "predicted_bytes_per_decode_step": predicted_bytes(args.rings),
              "predicted_bytes_per_verify_T4_demo_fp32": verify_bytes}
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    print(sweep.conditions.stamp())
    print("batch  state write      step ms [q1, q3]          vs slot  bytes/step/request (counted = predicted)")
    for r in sweep.rows:
        print(f"{r['batch']:5d}  {r['state_write']:15s}  {r['step_ms']:7.2f} [{r['step_q1_ms']:7.2f}, "
              f"{r['step_q3_ms']:7.2f}]  {r['speedup_vs_slot']:6.3f}x  {r['total_B']:>9,.0f} "
              f"({'=' if abs(r['total_B'] - r['predicted_total_B']) < 1e-6 else '!='} {r['predicted_total_B']:,.0f})")
    print("batch  state+conv scatter ms  conv-only ms  " + "  ".join(f"read R{r} ms" for r in args.rings)
          + "  rollback (B cursor moves) ms")
    for c in costs:
        print(f"{c['batch']:5d}  {c['state_and_conv_ms']:20.3f}  {c['conv_only_ms']:12.3f}  "
              + "  ".join(f"{c[f'replay_read_R{r}_ms']:10.3f}" for r in args.rings) + f"  {c['rollback_R16_ms']:10.3f}")
    for label, by in verify_bytes.items():
        print(f"verify T=4, {label} (predicted):", "  ".join(f"{k}: {v:,.0f} B" for k, v in by.items()))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
