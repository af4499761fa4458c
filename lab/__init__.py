"""The experiment layer: one module per page topic, imported only by ``app_pages/`` and ``bench/``.

Each page makes ONE (cached) call into its module, which runs the real ``kda_core`` / ``serve`` code and
returns plain data (pandas frames, frozen dataclasses, NamedTuples) for all of the page's charts. A lab
module never imports Streamlit, a page or ``bench/``; ``serve`` never imports ``lab`` (``tests/test_layers.py`` pins it).
The shipped models come from :mod:`lab.models` only.
Progress is reported through a callback argument, never through module-global state.

======================  =======================  ========================  ==========  ==================================
concept (page topic)    file                     main function             page        test
======================  =======================  ========================  ==========  ==================================
cold vs warm prefix     lab/prefix.py            home                      00 home     tests/lab/test_prefix_pages.py
trained model, prompts  lab/trained.py           model_card, home_prompts  00 home     tests/lab/test_trained.py
rollback bytes          lab/rollback.py          measure_layer_bytes       01          tests/serve/spec_decode/test_rollback.py
ReplaySSM state write   lab/state_write.py       state_write_sweep         01          tests/lab/test_state_write.py
verify and replay       lab/verify.py            run_verify_lab            02          tests/lab/test_verify.py
state vs KV cache       lab/state_vs_kv.py       state_vs_kv               03          tests/lab/test_state_vs_kv.py
raw-input ring          lab/ring.py              ring_view, commit_timing  04          tests/lab/test_ring.py
drafter acceptance      lab/drafters.py          measure_drafters          01, 02, 04  tests/lab/test_drafters.py
page pool workload      lab/pool.py              simulate                  05          tests/lab/test_pool.py
pool timing             lab/pool_timing.py       latency_histogram         05, 06      tests/lab/test_pool_timing.py
MLA paging              lab/mla_paging.py        page_table_demo           06          tests/lab/test_mla_paging.py
prefix anatomy          lab/prefix_anatomy.py    anatomy_view              07          tests/lab/test_prefix_pages.py
prefix hit              lab/prefix.py            prefix_hit                08          tests/lab/test_prefix_pages.py
forward cost fit        lab/forward_cost.py      forward_fit               00, 08      tests/lab/test_forward_cost.py
prefix miss + replays   lab/prefix_miss.py       prefix_miss               09          tests/lab/test_prefix_miss.py
real scale              lab/real_scale.py        roofline_view,            15          tests/lab/test_real_scale.py
                                                 policy_view
state precision         lab/state_precision.py   precision_run,            17          tests/lab/test_state_precision.py
                                                 field_claims
state capacity, range   lab/state_capacity.py    capacity_table,           17          tests/lab/test_state_capacity.py
                                                 low_decay_probe
16-bit engine states    lab/state_dtype.py       engine_agreement,         17          tests/lab/test_state_dtype.py
                                                 slot_table
conformance suite       lab/conformance.py       invariants, live_run,     18          tests/lab/test_conformance.py
                                                 recorded_llama_cpp
peers, recorded         lab/peers.py             recorded_peers            16          tests/lab/test_peers.py
KCP context parallel    lab/kcp.py               kcp_experiment            10          tests/lab/test_kcp.py
fleet hashing           lab/fleet_hashing.py     fleet_hashing             11          tests/lab/test_fleet_pages.py
fleet scaling           lab/fleet_scaling.py     fleet_scaling             12          tests/lab/test_fleet_pages.py
fleet budgets           lab/budgets.py           budget_page               13          tests/lab/test_fleet.py
fleet simulation        lab/fleet_simulation.py  fleet_simulation          14          tests/lab/test_fleet_pages.py
simulator vs engine     lab/sim_vs_engine.py     sim_vs_engine_record      14          tests/lab/test_sim_vs_engine.py
fleet building blocks   lab/fleet.py             page_trace, routing_load  11-14       tests/lab/test_fleet.py
shipped models          lab/models.py            demo_model, draft_model   (all)       tests/serve/test_runnable.py
one torch thread        lab/threads.py           one_thread                (all)       (used by every measured run)
shipped bench results   lab/shipped.py           read_shipped              01-04,      tests/lab/test_shipped.py
                                                                           17, 18
======================  =======================  ========================  ==========  ==================================

A page whose view includes a live timing makes that timing a second cached call (03-style "Re-measure" clears
only it, and the other charts are not recomputed); Home and 08 time cold vs warm TTFT, 04 its commits and 05 its
alloc / free calls only on request, and 09 and 15 run their trace replays behind a button, for the hosted
first-render budget.
"""
