"""``StepTrace``: a JSON-lines log of every engine step and every request's timeline, written by the engine
thread of :class:`serve.http.loop.EngineLoop` (``python -m serve.http --step-trace PATH``).

It is what lets the fleet simulator be checked step by step against the server (as Vidur and vLLM's
``--collect-detailed-traces`` split a request's latency into scheduling, model and output-processing time):
the same batch composition's step time predicted vs measured, the engine thread's own work between steps,
and the HTTP path before and after the engine. All times are ``time.perf_counter()`` seconds, which on Linux
is ``CLOCK_MONOTONIC``, one clock for every process of the machine: a client in another process can
subtract its own ``perf_counter`` times from these.

Records (one JSON object a line, ``"kind"`` first):

- ``step``: ``loop_t`` (the loop iteration began: commands drained, queued requests fed), ``t0`` / ``t1``
  (``engine.step()`` began / returned), ``cpu_s`` (CPU time the engine thread itself used in the step,
  ``time.thread_time()``: wall - cpu is time it waited for a core or for the GIL), ``others_cpu_s`` (CPU time
  the process's other threads used meanwhile: the HTTP event loop, which holds the GIL while it runs Python),
  ``emit_t`` (every new token handed to its stream), ``decode_rows``
  (running requests decoding one token), ``pad_rows`` (slot -1 rows up to the decode bucket),
  ``decode_context`` (sum over decode rows of the tokens in their cache), ``prefill`` (``[tokens, start]``
  per prefill row), ``running`` / ``waiting`` (the engine's lists after the step), ``queued`` (requests in front of the
  engine). A step that only admitted or rejected has no rows.
- ``request``: ``rid``, ``arrival_t`` (the handler queued it), ``feed_t`` (handed to the engine), ``first_t``
  / ``last_t`` (its first / last token pushed to its stream), ``end_t``, ``prompt_tokens``,
  ``hit_tokens``, ``output_tokens``, ``status``.
"""
from __future__ import annotations

import json
from pathlib import Path


class StepTrace:
    """Append-only JSON-lines file at ``path`` (created or truncated). Line-buffered, so a server stopped
    by a signal leaves whole lines. Engine thread only. Raises OSError if ``path`` cannot be opened."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = open(self.path, "w", buffering=1, encoding="utf-8")     # noqa: SIM115 - closed by close()

    def step(self, loop_t: float, t0: float, t1: float, emit_t: float, cpu_s: float, others_cpu_s: float, batch,
             running: int, waiting: int, queued: int) -> None:
        """One ``engine.step()``; ``batch`` is the :class:`serve.engine.model_runner.StepBatch` it ran (None: no forward)."""
        decode = pads = context = 0
        prefill = []
        for row in (batch.rows if batch is not None else ()):
            if row.req is None:
                pads += 1
            elif row.decode or row.verify:
                decode += 1
                context += row.start
            else:
                prefill.append([len(row.tokens), row.start])
        self._write({"kind": "step", "loop_t": loop_t, "t0": t0, "t1": t1, "emit_t": emit_t, "cpu_s": cpu_s, "others_cpu_s": others_cpu_s,
                     "decode_rows": decode,
                     "pad_rows": pads, "decode_context": context, "prefill": prefill, "running": running, "waiting": waiting,
                     "queued": queued})

    def request(self, stream, res, end_t: float) -> None:
        """A request's end: its :class:`serve.http.loop.Stream` and :class:`serve.engine.request.RequestResult` (None:
        it never reached the engine)."""
        self._write({"kind": "request", "rid": stream.rid, "arrival_t": stream.arrival_t, "feed_t": stream.feed_t,
                     "first_t": stream.first_t, "last_t": stream.last_t, "end_t": end_t,
                     "prompt_tokens": len(stream.prompt), "hit_tokens": None if res is None else res.hit_tokens,
                     "output_tokens": stream.sent, "status": "aborted" if res is None else res.status.value})

    def _write(self, obj: dict) -> None:
        self._f.write(json.dumps(obj) + "\n")

    def close(self) -> None:
        self._f.close()


def read_step_trace(path: str | Path) -> tuple[list[dict], list[dict]]:
    """``(steps, requests)``: the records of a :class:`StepTrace` file, in order. Raises ValueError naming the
    line for a line that is not a JSON object with a known ``kind``."""
    steps, requests = [], []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{i}: not JSON ({err})") from None
        kind = obj.get("kind") if isinstance(obj, dict) else None
        if kind not in ("step", "request"):
            raise ValueError(f"{path}:{i}: a record of kind 'step' or 'request' expected, got {kind!r}")
        (steps if kind == "step" else requests).append(obj)
    return steps, requests
