"""Prefix cache for a hybrid KDA/MLA model: KV blocks plus KDA state checkpoints, one lookup rule.

Concept → file → main type → test:
- chained block keys, the index (blocks, per-group checkpoints), the lookup walk, typed LRU
  ........................................ index.py ..... ``PrefixIndex``, ``block_keys``, ``EntryKind``, ``Walk``
  ........................................ tests/serve/prefix/test_index.py, test_cache.py
- what a lookup hands out (hit, steps, checkpoint rows, counters, CheckpointError)
  ........................................ hit.py ....... ``PrefixHit``, ``LookupStep``, ``CacheStats`` . test_cache.py
- the cache on the page pool: lookup and explain from one walk, pins, atomic publish, LRU eviction
  ........................................ cache.py ..... ``PrefixCache`` ..... test_cache.py, test_index.py,
  tests/serve/test_engine.py
- reference: a list of token prefixes scanned linearly (the oracle the cache is replayed against)
  ........................................ reference.py . ``PrefixOracle`` .... test_cache.py (hypothesis)
- trace replay with byte budgets (page 09, bench, ``OursPolicy``): the same index, walk and placement
  ........................................ sim.py ....... ``replay_trace``, ``TraceReplayConfig``,
  ``TraceReplayResult``, ``replay_row`` .. test_sim.py, tests/serve/scale/test_policies.py

Block size, checkpoint interval, groups and the placement rule come from one
:class:`serve.config.ServeConfig` (``tests/serve/test_config.py``).
"""
