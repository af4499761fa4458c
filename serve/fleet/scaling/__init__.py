"""Scaling and budgets: what a scale event moves, who may enter (token buckets) and in which order (schedulers).

Concept → file → main type → test (``tests/serve/fleet/``):
- keys moved by adding / removing a replica  keys_moved.py . ``keys_moved``, ``scaling_table`` → ``test_fleet_routers.py``
- token buckets, priority classes ........ budgets.py ..... ``TokenBucket``, ``PriorityClass`` → ``test_fleet_simulation.py``
- FCFS / VTC schedulers .................. scheduler.py ... ``FCFSScheduler``, ``VTCScheduler``, ``SCHEDULERS``
  → ``test_fleet_simulation.py``

Imports ``routing`` only (``keys_moved`` builds routers).
"""
