"""The pages: one thin file per tab (``NN_name.py``: widgets → one lab call → figures) and their helper modules.

``app.py`` builds ``st.navigation`` from ``registry.py``, each ``st.Page`` with its stated ``url_path``. The
folder is not named ``pages/``: a folder of that name beside the entry file turns on Streamlit's legacy
auto-discovered navigation. Pages import ours only through ``lab.*`` and these helpers (``tests/test_layers.py``).

==========================================  ==============  ====================================  ==============================
concept                                     file            main function                         test (tests/app/)
==========================================  ==============  ====================================  ==============================
the tabs, their sections and URL paths      registry.py     ``HOME``, ``TABS``, ``SECTIONS``      test_registry_order.py
a page's URL parameters as data             params.py       ``Int``, ``Float``, ``Choice``,       test_params.py
(parse / check / format)                                    ``Range``, ``Multi``, ``Toggle``,
                                                            ``Text``
widgets drawn from the declaration, URL     links.py        ``declare``, ``PageLinks``,           test_links.py,
whitelist, link and state checks                            ``keep_page_links``                   test_query_params.py,
                                                                                                  test_session_state.py
charts + CSV download, tables               charts.py       ``show_chart``, ``show_table``        test_log_ticks.py, test_tables.py
a lab call: bad input as st.error           errors.py       ``engine_call``                       test_pages.py
measured stamp, re-measure, heavy on click  measurement.py  ``measured_stamp``,                   test_measurements_w2.py,
                                                            ``remeasure_button``,                 test_heavy_extras.py
                                                            ``requested``, ``run_on_request``
real-scale replica widgets (pages 11-15)    replica.py      ``replica_params``,                   test_fleet_labels.py
                                                            ``real_replica``
drafter selector, acceptance per position   acceptance.py   ``drafter_params``,                   test_drafter_pages.py
(pages 01, 02, 04)                                          ``drafter_selector``,
                                                            ``acceptance_params``,
                                                            ``acceptance_section``
cached models and uploads                   caching.py      ``built_by_loaded_code``,             test_model_cache.py,
                                                            ``upload_parts``                      test_uploads.py
==========================================  ==============  ====================================  ==============================
"""
