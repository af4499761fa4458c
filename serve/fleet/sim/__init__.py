"""The discrete-event fleet simulation (simpy): class buckets → router → replicas, with step-time models.

Concept → file → main type → test (``tests/serve/fleet/``):
- simulation inputs / outputs ........... types.py ......... ``FleetConfig``, ``FleetRequest``, ``FleetSimResult``,
  ``FleetRequestResult``, ``fresh_block_requests`` (the one bounded builder of unshared block ids)
- service-time model, calibration ....... service_model.py . ``ServiceModel`` → ``test_fleet_simulation.py``,
  ``test_service_model_scaling.py``
- service times from the roofline ....... roofline_service.py ``RooflineService`` → ``test_fleet_policy_cache.py``
- one replica (simpy process) ........... replica.py ....... ``Replica``, ``Job`` → ``test_fleet_sim_policy.py``
- the fleet (buckets, router, scale events) simulation.py .. ``simulate``, ``FleetSim`` → ``test_fleet_simulation.py``
- step-by-step reference simulation ..... reference.py ..... ``reference_simulate`` → ``test_fleet_simulation.py``
- VTC artifact replay ................... vtc.py ........... ``replay_vtc_suite``, ``replay_on_off_less``

A replica knows its environment, its config and a ``finish(job, status)`` callback, not the fleet: ``replica.py``
does not import ``simulation.py``.
"""
