"""Benchmark of ReplaySSM beside the other rollback strategies at batch 1: ``python -m bench.replay_ssm``.

On the demo model (6 KDA + 2 MLA layers, H = 4, K = V = 32; fp32, one torch thread):

1. bytes written per decode step (T = 1) and per verify (T = 1 + n, n = 3), whole model: each strategy's
   per-token buffers plus the state it writes back (snapshot: every per-token state; projection replay and
   the raw-input ring: the committed state once per step; ReplaySSM: one ``(k, u, g, conv input)`` record per
   token and the state only at a materialisation, whose rate is *measured* over a run of decode steps);
   the same formulas at Kimi K3 sizes (records bf16, states fp32) are printed as *predicted*.
2. ReplaySSM at ring sizes 4..64: rollback (``discard()`` after a recorded verify: the cursor move), the state
   read (checkpoint + replay of a full ring of committed records, what a commit computes), and the
   materialisation (``materialise()``: fold of the full ring). Interleaved over ring sizes, a warm-up
   round, >= 5 repeats; median and quartiles. Materialisation ms = a + b records is *fitted* on ring sizes
   4..32 and *validated* on 64.
3. Commit time of all four strategies after a fresh verify of 1 + 3 tokens (:func:`lab.ring.commit_times`).

Writes ``bench/results/replay_ssm.json``.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from kda_core.config import PRESETS, ModelConfig
from kda_core.model import HybridLM
from lab.ring import commit_times, prompt_state
from lab.threads import one_thread
from lab.timing import conditions, fit_linear, summarize
from serve.spec_decode.replay_ssm import ReplaySSM, replay_ssm_bytes_per_token
from serve.spec_decode.rollback import (
    LayerShape,
    projection_bytes_per_token,
    raw_input_bytes_per_token,
    snapshot_bytes_per_token,
)
from serve.spec_decode.verify import verify, verify_and_replay

OUT = Path(__file__).parent / "results" / "replay_ssm.json"
RING_SIZES = (4, 8, 16, 32, 64)
FIT_ON = (4, 8, 16, 32)


def bytes_written(cfg: ModelConfig, num_tokens: int, rec_bytes: int, state_bytes: int,
                  materialisations_per_token: float) -> dict[str, float]:
    """Bytes one step of ``num_tokens`` verify tokens writes, whole model (all KDA layers)."""
    shape, L = LayerShape.from_config(cfg), cfg.num_kda_layers
    state = L * snapshot_bytes_per_token(shape, state_bytes)                 # state + conv window, all layers
    return {"snapshot": num_tokens * state,
            "projection replay": L * num_tokens * projection_bytes_per_token(shape, rec_bytes) + state,
            "raw-input ring": L * num_tokens * raw_input_bytes_per_token(shape, rec_bytes) + state,
            "ReplaySSM": L * num_tokens * replay_ssm_bytes_per_token(shape, rec_bytes)
            + state * materialisations_per_token * num_tokens}


def materialisation_rate(model: HybridLM, ring_size: int, steps: int) -> float:
    """Materialisations per decode token over ``steps`` plain decode steps (n = 0), measured."""
    strat, state = ReplaySSM(ring_size, 1), prompt_state(model)
    for _ in range(steps):
        state = verify_and_replay(model, state, [], strat).state
    return strat.num_materialisations / steps


def _filled(model: HybridLM, ring_size: int, fill: int):
    """A ReplaySSM whose ring holds ``fill`` committed records after the prompt (plain decode steps)."""
    strat, state = ReplaySSM(ring_size, min(4, ring_size)), prompt_state(model)
    for _ in range(fill):
        state = verify_and_replay(model, state, [], strat).state
    return strat, state


def ring_timings(model: HybridLM, repeats: int) -> tuple[list[dict], object]:
    """Per ring size: rollback (cursor move), state read (replay of the full ring) and materialisation (ms)."""
    samples = {(r, k): [] for r in RING_SIZES for k in ("rollback", "read", "materialise")}
    cond = conditions(repeats, 1)
    for rep in range(repeats + 1):                         # round 0: warm-up, not kept
        order = RING_SIZES[rep % len(RING_SIZES):] + RING_SIZES[: rep % len(RING_SIZES)]
        for R in order:
            strat, state = _filled(model, R, R - 1)        # one record free: a 1-token verify fits, no fold
            strat.record(model, state.cache, verify(model, state, []))
            t0 = time.perf_counter()
            strat.discard()                                # rollback of a fully rejected step
            t1 = time.perf_counter()
            state = verify_and_replay(model, state, [], strat).state     # ring now full: R committed records
            t2 = time.perf_counter()
            strat.read_state(strat.commit_end)
            t3 = time.perf_counter()
            strat.materialise()
            t4 = time.perf_counter()
            if rep:
                for k, t in (("rollback", t1 - t0), ("read", t3 - t2), ("materialise", t4 - t3)):
                    samples[(R, k)].append(t * 1e3)
    rows = []
    for R in RING_SIZES:
        row = {"ring_size": R, "records_folded": R}
        for k in ("rollback", "read", "materialise"):
            t = summarize(k, samples[(R, k)])
            row.update({f"{k}_ms": t.median_s, f"{k}_q1_ms": t.q1_s, f"{k}_q3_ms": t.q3_s})
        rows.append(row)
    return rows, cond


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = HybridLM(PRESETS["demo"])
    with one_thread():
        rates = {R: materialisation_rate(model, R, 4 * R) for R in RING_SIZES}
        ring_rows, cond = ring_timings(model, args.repeats)
        commit_rows, commit_cond = commit_times(model, 3, args.repeats, accepted=[0, 3])
    fit = fit_linear([r["records_folded"] for r in ring_rows if r["ring_size"] in FIT_ON],
                     [r["materialise_ms"] for r in ring_rows if r["ring_size"] in FIT_ON])
    held_out = ring_rows[-1]
    predicted_64 = fit.a_s + fit.b_s * held_out["records_folded"]
    written = {f"demo fp32, ring {R}": {"decode step (T=1)": bytes_written(model.cfg, 1, 4, 4, rates[R]),
                                        "verify (T=4)": bytes_written(model.cfg, 4, 4, 4, rates[R])}
               for R in RING_SIZES}
    k3 = PRESETS["kimi-k3"]
    predicted_k3 = {f"kimi-k3 bf16 records / fp32 state, ring {R} (predicted)":
                    {"decode step (T=1)": bytes_written(k3, 1, 2, 4, 1 / R)} for R in (16, 64)}
    result = {"conditions": cond._asdict(), "commit_conditions": commit_cond._asdict(),
              "machine": platform.processor() or platform.machine(),
              "materialisations_per_decode_token_measured": rates, "bytes_written": written,
              "bytes_written_k3_predicted": predicted_k3, "ring_timings_ms": ring_rows,
              "materialise_fit_ms": {"fitted_on_ring_sizes": FIT_ON, "a_ms": fit.a_s, "b_ms_per_record": fit.b_s,
                                     "r2": fit.r2, "predicted_ring_64_ms": predicted_64,
                                     "measured_ring_64_ms": held_out["materialise_ms"]},
              "commit_ms_fresh_verify_n3": commit_rows}
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1, default=str))
    print(cond.stamp())
    print("materialisations per decode token (measured):", {R: round(v, 4) for R, v in rates.items()})
    for label, d in {**written, **predicted_k3}.items():
        for step, by in d.items():
            print(f"{label:55s} {step:18s}", "  ".join(f"{k}: {v:,.0f} B" for k, v in by.items()))
    print("ring  rollback ms [q1,q3]      read ms [q1,q3]         materialise ms [q1,q3]")
    for r in ring_rows:
        print(f"{r['ring_size']:4d}  " + "  ".join(
            f"{r[k + '_ms']:.4f} [{r[k + '_q1_ms']:.4f},{r[k + '_q3_ms']:.4f}]" for k in ("rollback", "read", "materialise")))
    print(f"materialise (fitted on {FIT_ON}): {fit.a_s:.4f} ms + {fit.b_s:.5f} ms/record, r2 {fit.r2:.3f}; "
          f"ring 64 predicted {predicted_64:.3f} ms, measured {held_out['materialise_ms']:.3f} ms")
    for r in commit_rows:
        print(f"commit after fresh verify (n=3), accepted {r['accepted']}: {r['strategy']:18s} "
              f"{r['commit_ms']:.3f} ms [{r['q1_ms']:.3f}, {r['q3_ms']:.3f}]")


if __name__ == "__main__":
    main()
