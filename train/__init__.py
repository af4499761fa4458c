"""Training the demo model (kda-demo) and its draft model (kda-draft): corpus, loop, checkpoints, export (CPU or
CUDA; CI never trains).

=====================  ======================  ==================================  ==================================
concept                file                    type / entry point                  test
=====================  ======================  ==================================  ==================================
corpus + manifest      ``corpus.py``           ``documents``, ``Document``,        ``tests/train/test_corpus.py``
                                               ``build_manifest``, ``split_of``
batches, eval windows  ``batches.py``          ``BatchSampler``, ``eval_windows``  ``tests/train/test_loop.py``
held-out quality       ``evaluate.py``         ``evaluate`` -> ``Quality``         ``tests/train/test_loop.py``
trained models. shapes ``model_config.py``     ``model_config(name)``              ``tests/train/test_weights.py``
training loop          ``loop.py``             ``train``, ``TrainArgs``, ``lr_at`` ``tests/train/test_loop.py``
checkpoint + resume    ``checkpoint.py``       ``save``, ``load``                  ``tests/train/test_loop.py``
CLI                    ``__main__.py``         ``python -m train --out DIR``       (the shipped run)
export + CI record     ``export.py``           ``python -m train.export``          ``tests/train/test_export.py``,
                                                                                   ``tests/train/test_weights.py``
Home's held-out        ``prompts.py``          ``python -m train.prompts``,        ``tests/train/test_prompts.py``
prompts                                        ``reads_as_code``, ``load_prompts``
=====================  ======================  ==================================  ==================================

The weights format itself (``model.safetensors`` + ``config.json``, ``HybridLM.from_pretrained``) lives in
``kda_core/pretrained.py`` (tested in ``tests/kda_core/test_pretrained.py``); autograd through
``kda_core.chunk.kda_chunk`` is checked against the recurrent reference in ``tests/kda_core/test_chunk_grad.py``.
"""
