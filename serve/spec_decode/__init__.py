"""Speculative decoding on the hybrid KDA/MLA model: draft, verify, accept, commit with a rollback strategy.

A KV cache drops rejected draft tokens by truncation; a KDA state has already folded them in, so the
commit must rebuild the state at exactly the last accepted token. Four strategies do that, behind one
lifecycle (``record -> commit | discard``, ``nbytes()`` checked against the formula by ``check_integrity``).

Concept → file → main type → test:
- draft proposers (prompt lookup, draft model, noisy oracle) draft.py ... ``NgramProposer``, ``DraftModelProposer``,
  ``NoisyOracleProposer``
  ... ``tests/serve/spec_decode/test_draft.py``
- rollback lifecycle, byte formulas, layer sizes .. rollback.py ........ ``RollbackStrategy``, ``LayerShape``,
  ``*_bytes_per_token`` ... ``tests/serve/spec_decode/test_rollback.py``
- snapshot (state + conv window per verify token) . snapshot.py ........ ``SnapshotRollback``
  ... ``tests/serve/spec_decode/test_verify.py``, ``test_rollback.py``
- projection replay (k, v, g, beta + conv inputs) . projection.py ...... ``ProjectionReplay``
  ... ``tests/serve/spec_decode/test_verify.py``, ``test_rollback.py``
- raw-input ring (layer inputs, checkpoint) ....... raw_input_ring.py .. ``RawInputRing``
  ... ``tests/serve/spec_decode/test_raw_input_ring.py``
- ReplaySSM (checkpoint + ring of k, u, g records) replay_ssm.py ...... ``ReplaySSM``, ``replay_records``
  ... ``tests/serve/spec_decode/test_replay_ssm.py``
- verify / accept / commit ........................ verify.py .......... ``verify``, ``greedy_accept``,
  ``verify_and_replay``, ``VerifyResult``, ``DecodeState`` ... ``tests/serve/spec_decode/test_verify.py``
- the one loop (propose -> verify_and_replay -> extend), its draft budget, one step
  ................................................. verify.py .......... ``speculate``, ``draft_budget``,
  ``speculative_step``, ``speculative_generate`` ... ``tests/serve/spec_decode/test_verify.py``,
  ``tests/serve/test_engine_spec.py``
- the one strategy factory, engine settings ....... verify.py .......... ``make_strategy``, ``STRATEGIES``,
  ``Speculation`` ... ``tests/serve/spec_decode/test_verify.py``, ``tests/serve/test_engine_spec_property.py``
- references: sequential decode, greedy decode, closed-form state
  ................................................. reference.py ....... ``sequential_decode``, ``greedy_decode``,
  ``closed_form_states`` ... ``tests/serve/spec_decode/test_verify.py``, ``test_reference.py``

ReplaySSM as the engine's plain-decode state write (no speculation: a record per step, the state every R steps) is a
policy of the state's memory: :mod:`serve.memory.replay_state_write`.

Experiments on top (pages 01, 02, 04): ``lab/rollback.py`` (``rollback_page``), ``lab/verify.py``
(``run_verify_lab``), ``lab/ring.py`` (``ring_view``, ``commit_timing``); tests ``tests/lab/test_rollback.py``,
``test_verify.py``, ``test_ring.py``; bench: ``python -m bench.decode``.
"""
