"""Fleet layer: routing requests to replicas, scaling and budgets, and a discrete-event simulation of a fleet.

Sub-package → concept → main types (each sub-package's docstring has its concept → file → type table):
- ``routing/`` . hashes, the routers and their registry, per-replica caches, routing-only replay
  ................ ``make_router``, ``ROUTERS``, ``Router``, ``PrefixScoreRouter``, ``PolicyReplicaCache``, ``replay_routing``
- ``scaling/`` . keys moved by a scale event, token buckets and priority classes, FCFS / VTC schedulers
  ................ ``keys_moved``, ``TokenBucket``, ``PriorityClass``, ``FCFSScheduler``, ``VTCScheduler``
- ``sim/`` ..... the simpy simulation, its replicas, step-time models, the step-by-step reference, VTC replay
  ................ ``simulate``, ``FleetConfig``, ``Replica``, ``ServiceModel``, ``RooflineService``, ``replay_vtc_suite``
- ``engine_replay/`` the real engine replayed on a strict (thread CPU time) or wall clock, and the simulator's
  ................ prediction of the same replay: ``replay``, ``CpuClock``, ``fit_terms``, ``predict``

Imports go one way: ``sim`` → ``scaling`` → ``routing`` (the layer test pins it). The pages' experiments on this
layer live in ``lab/fleet*.py`` and ``lab/budgets.py``. Tests: ``tests/serve/fleet/`` (``test_fleet_routers.py``,
``test_fleet_simulation.py``, ``test_fleet_policy_cache.py``, ``test_replay_policy_cache.py``,
``test_replay_refresh.py``, ``test_service_model_scaling.py``, ``test_fleet_sim_policy.py``); lab: ``tests/lab/test_fleet.py``, ``test_budgets.py``; bench: ``python -m bench.fleet``.
"""
