"""The KDA conformance suite: the invariants a recurrent state must keep in a serving engine, checked from the
outside through the engine's OpenAI-compatible API (``python -m conformance``). A client tool: it imports nothing
of our serving code except in :mod:`conformance.ours`, which starts our server.

Concept -> file -> main type -> test:
- the command line ............................ __main__.py ...... ``main``
- the checks and engines by name .............. registry.py ...... ``CHECKS``, ``ENGINES``
- prefix hit, A -> B -> A, state-hit metrics .. checks_cache.py .. ``PREFIX_HIT``, ``CACHE_ORDER``, ``STATE_HIT_METRICS``
- speculative, chunked prefill, batch, abort .. checks_decode.py . ``SPECULATIVE_DECODING``, ``CHUNKED_PREFILL``,
  ``BATCH_INVARIANCE``, ``ABORT_RECOMPUTE``
- plan, judge, run grouped by server .......... suite.py ......... ``Check``, ``Ctx``, ``run_suite``
- one engine's flags, fields, answers ......... adapters.py ...... ``Adapter``, ``Variant``, ``LlamaCpp``, ``Vllm``, ``Sglang``
- our server as the engine under test ......... ours.py .......... ``Ours``, ``serve_in_process``
- reaching the engine per setting ............. launch.py ........ ``Attached``, ``Launched``, ``InProcess``
- the HTTP client, completions, /metrics ...... client.py ........ ``EngineClient``, ``Completion``
- two completions compared .................... compare.py ....... ``compare``, ``Diff``
- the prompts (nonce, needle, filler) ......... prompts.py ....... ``Prompts``
- results, JSON and the table ................. report.py ........ ``Report``, ``CheckResult``, ``Status``

Tests: ``tests/conformance/test_suite.py`` (our server passes every check; each check fails against our server
with a bug of its class put in), ``tests/conformance/test_cli.py`` (the command line), ``tests/conformance/test_compare.py``.
"""
