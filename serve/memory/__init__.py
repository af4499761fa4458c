"""Memory layer: one pool of equal-size pages and one layout of a request's hybrid cache in it.

Concept → file → main type → test:
- page kinds, pool errors, stats ........ kinds.py ....... ``PageKind``, ``PoolExhausted``, ``NoFreeRun``, ``PageError``,
  ``PoolStats``
  → ``tests/serve/memory/test_pool.py``
- the page pool (uint8 arena, ref counts, holders, copy-on-write, typed views, poison, integrity; single pages and
  runs of consecutive pages for a multi-page state slot)
  ......................................... pool.py ........ ``PagePool`` → ``test_pool.py``, ``test_pool_stateful.py``
- the free page ids (a min-heap: single pages from the low end; a byte map: the highest run of n free ids, one
  ``rfind``) .............................. free_pages.py .. ``FreePages`` → ``test_pool.py``, ``test_pool_stateful.py``
- THE cache layout + page-size policy (KV blocks, KDA groups, "unified" / "multi_page", waste; the stored dtypes
  the engine reads and writes: fp32 latents and conv windows, an fp32 / bf16 / fp16 recurrent state)
  ......................................... layout.py ...... ``CacheLayout``, ``group_layers``, ``group_state_bytes``,
  ``ENGINE_STATE_DTYPES``
  → ``test_layout.py``
- reading / writing a request's state and KV over page lists (the engine's and the prefix cache's path; a 16-bit
  state rounded to nearest on write, upcast on read)
  ......................................... pages.py ....... ``read_state``, ``write_state``, ``stored_words``,
  ``zero_state``, ``copy_state``, ``read_kv``, ``write_kv``, ``slot_views`` (every page as the first page of a state
  slot's run: strided views of the arena the engine reads and writes in place) → ``test_pages.py`` (decode from the pool is bitwise
  equal), ``tests/serve/test_engine_state_dtype.py`` (16-bit round trip), ``tests/serve/test_model_runner_in_place.py``
- a request's page table with prefix sharing and copy-on-write (page 06), on layout.py + pages.py
  ......................................... paged_mla.py ... ``PagedMLACache`` → ``test_paged_mla.py``, ``test_pool_stateful.py``
- a KDA state slot's storage format (fp32, bf16, fp16, fp8 e4m3 +- stochastic rounding, int8 per head / per head row,
  int8 + error feedback): store to bytes, load to fp32, bytes per slot (page 17)
  ......................................... state_precision.py .. ``store``, ``load``, ``round_trip``, ``FORMATS``,
  ``StoredState`` → ``test_state_precision.py``
- the decode-time state write of ReplaySSM (``ServeEngine(state_write="replay_ssm")``: a ``(k, u, g)`` record per
  decode step in a per-request ring, the state written every ``ring_size`` steps or at a checkpoint publish; bytes
  per decode step against the slot write)
  ......................................... replay_state_write.py .. ``ReplayStateWrite``, ``decode_write_bytes``
  → ``test_replay_state_write.py``, ``tests/serve/test_engine_replay_ssm.py``
- what vLLM's hybrid allocator picks, beside our policy (page 05, fleet capacity policies)
  ......................................... vllm_block.py .. ``vllm_block_pick``, ``vllm_vs_ours`` → ``test_vllm_block_pick.py``

Byte formulas live in :mod:`kda_core.config` (``kda_state_elems_per_layer`` and the ``*_bytes_per_*``
functions); this package only multiplies them out. Tests are under ``tests/serve/memory/``; the page 05/06
experiments are ``lab/pool.py``, ``lab/pool_timing.py`` and ``lab/mla_paging.py`` (``tests/lab/``).
"""
