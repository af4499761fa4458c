"""Request traces: the loaders of the public traces, the seeded synthetic generator and the limits they share.

Concept → file → main type → test:
- Mooncake JSON Lines: loader, writer, synthetic generator, ideal hit ratios
  ......................................... mooncake.py ..... ``TraceRequest``, ``read_mooncake``, ``load_mooncake``,
  ``synthesize``, ``ideal_hit_ratio`` → ``tests/serve/traces/test_traces.py``, ``test_mooncake_ratios.py``
- Azure LLM inference trace 2023 (CSV, no prefix information)
  ......................................... azure.py ........ ``read_azure_csv``, ``load_azure_csv`` → ``test_traces.py``
- VTC artifact (S-LoRA latencies under FCFS / VTC)
  ......................................... vtc_artifact.py . ``VTCRun``, ``VTCRecord``, ``load_vtc_artifact``
  → ``test_traces.py``, ``test_traces_limits.py``
- limits on uploads and the checks every loader shares (``serve/traces/README.md``)
  ......................................... limits.py ....... ``TraceFormatError``, ``LoadedTrace``, ``MAX_INPUT_TOKENS``
  → ``test_traces_limits.py``, ``test_traces_fuzz.py``

The real files live in ``../shared/traces/`` (never copied into the repo). Tests are under ``tests/serve/traces/``.
"""
