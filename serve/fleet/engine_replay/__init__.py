"""Replays of the real engine on a clock, and the fleet simulator's prediction of the same replays.

Concept → file → main type → test (``tests/serve/fleet/test_engine_replay.py``):
- the two clocks (strict: thread CPU time; wall) .. clock.py ..... ``CpuClock``, ``WallClock``
- the replayed requests (Mooncake, scaled) ....... workload.py .. ``ReplayRequest``, ``mooncake_requests``
- the driver: engine step by step on a clock ..... driver.py .... ``replay``, ``build_replay_engine``, ``StepRecord``
- the metrics' definitions ....................... metrics.py ... ``replay_metrics``, ``RequestTimes``
- step-time terms fitted on logged steps ......... fit.py ....... ``fit_terms``, ``service_model``
- the simulator's prediction of a replay ......... predict.py ... ``predict``

``python -m bench.sim_vs_engine`` runs calibrate -> replay -> score with these.
"""
