"""The serving engine, laid out as nano-vllm's ``nanovllm/engine/``: requests through a :class:`HybridLM` with
every cache in a :class:`serve.memory.pool.PagePool`, continuously batched.

Concept → file → main type → test:
- the engine: ``submit`` / ``step`` (schedule -> run -> postprocess) / ``abort`` / ``result``, fault isolation
  ......................................... engine.py ...... ``ServeEngine``, ``EngineFailure``
  → ``tests/serve/test_engine.py``, ``test_engine_batch.py``, ``test_engine_faults.py``, ``test_engine_property.py``
- the one way to build an engine: a frozen spec of every setting, a fresh pool (+ prefix cache) and the engine
  ......................................... build.py ....... ``EngineArgs``, ``build_engine``
  → ``tests/serve/test_engine.py``, ``tests/serve/http/test_engine_spec.py``
- the memory of requests: ask at the head of the queue (``match``: the hit that fits, else none; ``can_admit`` ->
  ``Fit``) then act (``admit``: the hit's pins, its state
  slot, one run of consecutive pages per group under multi_page, k + 1 slots with snapshot speculation),
  ``reject``, ``publish`` blocks and checkpoints, ``release`` (the one path; ``preempt`` goes through it)
  ......................................... request_memory.py  ``RequestMemory``, ``Fit``
  → ``tests/serve/test_request_memory.py``, ``tests/serve/test_engine_property.py``
- the postprocess stage of a step (non-finite rows, checkpoints inside prefill chunks, commit, publish, append,
  finish) ................................. postprocess.py . ``Postprocessor``
  → ``tests/serve/test_engine_batch.py``, ``tests/serve/test_engine_spec.py``
- the requests and their waiting / running queues, each step's rows (admission FCFS through the memory, decode
  first, grid-safe prefill chunks, finish, abort, preemption by recompute)
  ......................................... scheduler.py ... ``Scheduler``, ``SchedulerConfig``, ``Schedule``
  → ``tests/serve/test_scheduler_policy.py``, ``tests/serve/test_engine_batch.py``
- one step's batch as data and its packed forward (decode rows padded to buckets with slot -1, prefill rows,
  verify rows; states read and written in place by slot, a verify row's per-token states into the k + 1 slots)
  ......................................... model_runner.py  ``ModelRunner``, ``Row``, ``StepBatch``
  → ``tests/serve/test_model_runner_buckets.py``, ``tests/serve/test_model_runner_slots.py``,
  ``tests/serve/test_model_runner_in_place.py``
- a request: prompt ids, record (token ranges, pages needed), its cache through its pages, its result
  ......................................... request.py ..... ``Request``, ``RequestResult``, ``RequestStatus``,
  ``prompt_ids`` → ``tests/serve/test_engine.py``
- per-request sampling (temperature, top-p, top-k, seed; one generator per request)
  ......................................... sampling.py .... ``SamplingParams``, ``sample_token``
  → ``tests/serve/test_sampling.py``

State write of a decode step (``state_write``): "slot" writes the request's whole KDA state back to its pages
every step; "replay_ssm" (vllm#47572) appends a ``(k, u, g)`` record per KDA layer to the request's ring and
writes the state every ``ring_size`` steps or when a checkpoint is published at that step
(:mod:`serve.memory.replay_state_write`); the ring is released with the request's pages.

16-bit states (``state_dtype`` bf16 / fp16): a request's state is rounded wherever it is written, so its output
depends on where that happens. Bitwise facts that still hold with the same state dtype and settings: a request
in any batch == its batch-1 run (its prefill chunks do not depend on its neighbours: the scheduler never cuts a
chunk to fit the token budget, :class:`serve.engine.scheduler.SchedulerConfig` ``exact_state``); a preempted
request == its uninterrupted run (when its recompute restarts cold); the engine == the same engine with
``rows_per_forward=1``; a cache-on cold run == the cache-off run under ``state_write="slot"``. Under "replay_ssm"
the cache-on run also materialises (rounds) the state at the decode step that publishes its final checkpoint
(vllm#55688: a published state must be in pages), which restarts the ring's period: it == the cache-off run up
to that step's token, and after it == the model rounded there too (``test_engine_state_dtype.py``), within the
rounding a 16-bit state already carries.
Facts that hold only in fp32: a warm run from a hit at b == the cold run (the restored checkpoint is rounded at
b; it equals the cache-off run whose prefill is split at b); a chunked prefill == the unchunked one;
``replay_ssm`` == ``slot`` (ReplaySSM rounds at materialisation only, every ``ring_size`` steps, so fewer times).
"""
from serve.engine.build import EngineArgs, build_engine
from serve.engine.engine import STATE_WRITES, EngineFailure, ServeEngine
from serve.engine.request import RequestResult, RequestStatus
from serve.engine.request_memory import Fit, RequestMemory
from serve.engine.sampling import SamplingParams
from serve.engine.scheduler import DONE, Scheduler, SchedulerConfig

__all__ = ["DONE", "STATE_WRITES", "EngineArgs", "EngineFailure", "Fit", "RequestMemory", "RequestResult",
           "RequestStatus", "SamplingParams", "Scheduler", "SchedulerConfig", "ServeEngine", "build_engine"]
