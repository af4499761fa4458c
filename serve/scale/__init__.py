"""Scale layer: roofline cost of the real Kimi models (Kimi-Linear-48B-A3B, Kimi K3, their all-MLA
counterfactuals) on datacenter GPUs, checked against the Kimi Linear tech report's curves.

Pure arithmetic (no torch tensors, no Streamlit). Units: seconds, bytes, FLOP.

Concept -> file -> main type -> test:
- GPU presets (A100, H100, H200, B200), ... hardware.py .... ``Hardware``, ``GPUS`` ........... test_model_shape.py
  NVLink in a node, InfiniBand beyond
- model sizes per layer kind, presets ...... model_shape.py . ``ModelShape``, ``preset`` ..... test_model_shape.py
- Hugging Face config.json -> ModelShape .... hf_config.py ... ``from_hf_config`` ............ test_hf_config.py
- prefill / decode / checkpoint restore .... roofline.py .... ``prefill_time``, ``decode_time``,
  ``checkpoint_restore_time``, ``StepCost`` ............................................... test_roofline.py
- the report's published points ............ published.py ... ``PublishedCurve``, ``CURVES`` . test_validation.py
- model vs report: the prefill fit (Kimi .. validation.py .. ``fit_prefill``, ``prefill_points``,
  Linear's points, once at ``FIT_SETUP``,   ``prefill_ratios``, ``decode_ratios`` ............ test_validation.py
  carried to other setups; MLA's held out;
  ratios MLA / Kimi Linear)
- largest batch after the weights, TPOT / . capacity.py .... ``max_batch``, ``largest_batch_decode``,
  throughput at it (the report's Fig. 1b) ``weight_bytes`` .................................. test_capacity.py
- production prefix-cache policies ......... policies/ ...... ``PrefixPolicy``, ``replay`` ... test_policies.py
  (ours, SGLang no_buffer / extra_buffer, vLLM mamba_cache_mode none / align / all; see its table)

Tests live in ``tests/serve/scale/``.
"""
