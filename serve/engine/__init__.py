"""The serving engine, laid out as nano-vllm's ``nanovllm/engine/``: requests through a :class:`HybridLM` with
every cache in a :class:`serve.memory.pool.PagePool`, continuously batched.

Concept → file → main type → test:
- the engine: ``submit`` / ``step`` (schedule -> run -> postprocess) / ``abort`` / ``result``, fault isolation
  ......................................... engine.py ...... ``ServeEngine``, ``EngineFailure``, ``Fit``
  → ``tests/serve/test_engine.py``, ``test_engine_batch.py``, ``test_engine_faults.py``, ``test_engine_property.py``
- the waiting / running queues and each step's rows (admission FCFS, decode first, grid-safe prefill chunks,
  preemption by recompute) ............... scheduler.py ... ``Scheduler``, ``SchedulerConfig``, ``Schedule``
  → ``tests/serve/test_scheduler_policy.py``, ``tests/serve/test_engine_batch.py``
- one step's batch as data and its packed forward (decode rows padded to buckets with slot -1, prefill rows,
  verify rows) ............................ model_runner.py  ``ModelRunner``, ``Row``, ``StepBatch``
  → ``tests/serve/test_model_runner_buckets.py``, ``tests/serve/test_model_runner_slots.py``
- a request: prompt ids, record (token ranges, pages needed), its cache through its pages, its result
  ......................................... request.py ..... ``Request``, ``RequestResult``, ``RequestStatus``,
  ``prompt_ids`` → ``tests/serve/test_engine.py``
- per-request sampling (temperature, top-p, top-k, seed; one generator per request)
  ......................................... sampling.py .... ``SamplingParams``, ``sample_token``
  → ``tests/serve/test_sampling.py``
"""
from serve.engine.engine import DONE, STATE_WRITES, EngineFailure, Fit, ServeEngine
from serve.engine.request import RequestResult, RequestStatus
from serve.engine.sampling import SamplingParams

__all__ = ["DONE", "STATE_WRITES", "EngineFailure", "Fit", "RequestResult", "RequestStatus", "SamplingParams", "ServeEngine"]
