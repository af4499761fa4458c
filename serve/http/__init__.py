"""OpenAI-compatible HTTP server over the engine, with Prometheus metrics (``python -m serve.http``).

Concept → file → main type:
- model and engine construction (the one place) .. model.py ..... ``load_model``, ``EngineSpec``, ``build_engine``,
  ``PoolCapacity``, ``SpeculativeConfig``
- request / response schema, checks, UTF-8 ...... protocol.py .. ``CompletionRequest``, ``ChatRequest``,
  ``RequestError``, ``TextDecoder``
- the engine's thread (join / leave, admission) .. loop.py ...... ``EngineLoop``, ``Stream``, ``Tokens``, ``QueueFull``
- Prometheus metrics (vLLM / SGLang names) ....... metrics.py ... ``ServerMetrics``
- routes, SSE, disconnects, error statuses ....... app.py ....... ``create_app``
- read deadlines, keep-alive, connection cap ..... door.py ...... ``DoorLimits``, ``DeadlineProtocol``
- command line ................................... __main__.py .. ``main``
- serve an app from a background thread ........... background.py  ``serve_in_thread``
- per-step and per-request timeline log ........... step_trace.py  ``StepTrace``, ``read_step_trace``

Tests: ``tests/serve/http/test_server_openai.py`` (the ``openai`` client: completion, chat, streaming, errors),
``tests/serve/http/test_server_load.py`` (64+ concurrent streams, random cancels, outputs vs batch-1 runs,
slots and pages back to baseline), ``tests/serve/http/test_cli_state_write.py`` (``--state-write`` /
``--ring-size``: reach the engine, argparse errors, ReplaySSM serves the slot write's bytes),
``tests/serve/http/test_main.py`` (the command line: help, bad values exit 2, the startup line, door options,
``--docs``), ``tests/serve/http/test_server_failures.py`` (one request cannot take the server down: the 1e-38
request, a failing row is a 500 while the others are served, an engine failure exits non-zero),
``tests/serve/http/test_door.py`` (slow-loris clients dropped within the deadlines, normal ones not),
``tests/serve/http/test_engine_spec.py`` (the engine and default pool a spec builds),
``tests/serve/http/test_cli_speculative_chunked.py`` (``--speculative-config`` / ``--chunked-prefill-size``: reach
the engine, argparse errors, the plain server's bytes), ``tests/serve/http/test_server_logprobs.py`` (completions'
``logprobs``: the log-softmax of the sampled logits, streamed alike, 400s).
"""
