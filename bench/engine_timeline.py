"""Where a request's time goes in the real server, from its ``--step-trace`` (:mod:`serve.http.step_trace`) and
the client's own timestamps (:func:`bench.serve_http.one_request`), for ``bench/sim_vs_engine.py``.

Per request (client send -> first chunk received = the client's TTFT):

    ingress   = server arrival - client send          (HTTP parse, pydantic checks, hand-off to the engine thread)
    feed wait = handed to the engine - server arrival (waiting for the step in flight to end)
    engine    = first token pushed - handed to the engine (queueing inside the engine, its prefill step)
    egress    = first chunk received - first token pushed (event loop wake-up, SSE encode, socket, client parse)

Per step: ``step`` = ``engine.step()`` wall time and the engine thread's CPU time in it, next to the service
model's prediction for the SAME batch composition (decode rows, their context, prefill rows with their cached
start); wall / CPU above 1 is time the engine thread waited for a core (other processes) or for the GIL (the
server's event loop thread); ``after`` = the engine thread's
work between one step's end and the next step's start when the engine still had requests after the step
(handing tokens to the streams, draining commands, gauges; the loop sleeps only without requests), which :func:`fit_server_terms` fits per output row.
All times in ms. Every fit here is least squares with numpy; the callers keep fitted, predicted and measured apart.
"""
from __future__ import annotations

import numpy as np

from serve.fleet.sim.service_model import ServiceModel, attention_pairs


def in_window(steps: list[dict], requests: list[dict], t0: float, t1: float = float("inf")):
    """The step and request records of a :class:`serve.http.step_trace.StepTrace` that began in ``[t0, t1)``
    (perf_counter seconds): one phase of a run (calibration traffic, replay)."""
    return ([s for s in steps if t0 <= s["t0"] < t1], [r for r in requests if t0 <= r["arrival_t"] < t1])


def output_rows(step: dict) -> int:
    """Rows of a step that emit a token: its decode rows and its prefill rows (the engine runs a prompt's prefill
    in one row, so each prefill row ends with the prompt's first token)."""
    return step["decode_rows"] + len(step["prefill"])


def predicted_step_ms(svc: ServiceModel, step: dict) -> float:
    """``svc``'s time for the step's exact composition (ms): the mixed step of its prefill rows ``(new, cached)``
    and its decode rows at their mean context, or the decode step alone."""
    b, prefill = step["decode_rows"], [(n, start) for n, start in step["prefill"]]
    ctx = step["decode_context"] / b if b else 0.0
    if prefill:
        return svc.mixed_step_ms(prefill, b, ctx) if b else svc.prefill_batch_ms(prefill)
    return svc.decode_step_ms(b, ctx)


def step_table(svc: ServiceModel, steps: list[dict]) -> list[dict]:
    """One row per step that ran a forward: its composition, measured wall and CPU ms, ``svc``'s predicted ms,
    and the engine thread's busy time after it (``after_ms``; None when it idled or for the last step)."""
    out = []
    for i, s in enumerate(steps):
        if not (s["decode_rows"] or s["prefill"]):
            continue
        nxt = steps[i + 1] if i + 1 < len(steps) else None
        busy = nxt is not None and (s["running"] or s["waiting"] or s["queued"])     # the loop did not idle
        out.append(dict(kind="mixed" if s["prefill"] and s["decode_rows"] else "prefill" if s["prefill"] else "decode",
                        decode_rows=s["decode_rows"], prefill_tokens=sum(n for n, _ in s["prefill"]),
                        pairs=sum(attention_pairs(n, c) for n, c in s["prefill"]), output_rows=output_rows(s),
                        measured_ms=(s["t1"] - s["t0"]) * 1e3, cpu_ms=s["cpu_s"] * 1e3,
                        others_cpu_ms=s.get("others_cpu_s", 0.0) * 1e3,
                        predicted_ms=predicted_step_ms(svc, s),
                        after_ms=(nxt["t0"] - s["t1"]) * 1e3 if busy else None))
    return out


def fit_server_terms(table: list[dict]) -> dict:
    """The server's own terms, fitted on the step table of its calibration traffic:

    - ``cpu_slowdown``: median of the step's CPU time / the prediction (``svc`` fitted to the CPU time of the
      same steps timed alone): the engine's own work inside the server against alone;
    - ``wall_per_cpu``: total wall / total CPU time of the steps (waiting for a core or the GIL);
    - ``after_fixed_ms`` + ``per_output_row_ms`` x rows: least squares of ``after_ms`` (busy steps only) on each
      step's output rows, both clipped at 0.

    Raises ValueError when the table has no busy step with rows (too little traffic to fit)."""
    busy = [r for r in table if r["after_ms"] is not None]
    if len(busy) < 2 or not table:
        raise ValueError(f"fit_server_terms needs >= 2 busy steps, got {len(busy)} of {len(table)}")
    a = np.array([[1.0, r["output_rows"]] for r in busy])
    (fixed, per_row), *_ = np.linalg.lstsq(a, np.array([r["after_ms"] for r in busy]), rcond=None)
    slowdown = float(np.median([r["cpu_ms"] / r["predicted_ms"] for r in table]))
    return dict(cpu_slowdown=slowdown, wall_per_cpu=wall_per_cpu(table), after_fixed_ms=max(0.0, float(fixed)), per_output_row_ms=max(0.0, float(per_row)),
                steps=len(table), busy_steps=len(busy))


def wall_per_cpu(table: list[dict]) -> float:
    """Total wall time / total engine-thread CPU time of the steps of a :func:`step_table`."""
    return sum(r["measured_ms"] for r in table) / max(1e-9, sum(r["cpu_ms"] for r in table))


def match_requests(client: list[dict], server: list[dict]) -> list[tuple[dict, dict]]:
    """Pair each successful client record with its server record: the earliest not yet taken server arrival
    at or after the client's send with the same prompt length (arrivals reach the server in send order up to
    ties). Raises ValueError when a client request has no server record."""
    free = sorted((r for r in server if r["first_t"] is not None), key=lambda r: r["arrival_t"])
    pairs = []
    for c in sorted((c for c in client if c["ok"]), key=lambda c: c["send_t"]):
        hit = next((r for r in free if r["arrival_t"] >= c["send_t"] and r["prompt_tokens"] == c["input_tokens"]),
                   None)
        if hit is None:
            raise ValueError(f"no server record for the client request sent at {c['send_t']:.3f} s "
                             f"({c['input_tokens']} prompt tokens)")
        free.remove(hit)
        pairs.append((c, hit))
    return pairs


def request_parts(pairs: list[tuple[dict, dict]]) -> dict[str, list[float]]:
    """Per request, ms: ``ingress``, ``feed_wait``, ``engine``, ``egress`` (module docstring; they sum to
    ``ttft``), ``egress_last`` (last chunk received - last token pushed) and ``hit_tokens``."""
    out = {k: [] for k in ("ingress", "feed_wait", "engine", "egress", "ttft", "egress_last", "hit_tokens")}
    for c, r in pairs:
        out["ingress"].append((r["arrival_t"] - c["send_t"]) * 1e3)
        out["feed_wait"].append((r["feed_t"] - r["arrival_t"]) * 1e3)
        out["engine"].append((r["first_t"] - r["feed_t"]) * 1e3)
        out["egress"].append((c["chunk_t"][0] - r["first_t"]) * 1e3)
        out["ttft"].append((c["chunk_t"][0] - c["send_t"]) * 1e3)
        out["egress_last"].append((c["chunk_t"][-1] - r["last_t"]) * 1e3)
        out["hit_tokens"].append(float(r["hit_tokens"] or 0))
    return out


def summary(values) -> dict:
    """``{"p50", "mean", "p99", "n"}`` of a list of numbers (NaN when empty)."""
    v = np.asarray(values, dtype=float)
    if not len(v):
        return {"p50": float("nan"), "mean": float("nan"), "p99": float("nan"), "n": 0}
    return {"p50": float(np.percentile(v, 50)), "mean": float(v.mean()), "p99": float(np.percentile(v, 99)),
            "n": int(len(v))}
