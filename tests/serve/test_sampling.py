"""Per-request sampling (serve/sampling.py): the top-p nucleus by hand, draws reproducible per seed, and in the
engine a sampled request's tokens equal its batch-1 run's whatever its neighbours (and after a preemption)."""
from __future__ import annotations

import math

import pytest
import torch

from serve.http.model import EngineSpec, build_engine, load_model
from serve.sampling import SamplingParams, sample_token


def test_top_p_keeps_the_smallest_nucleus_and_seeds_reproduce():
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3, 0.0 + 1e-9]))          # sorted: 1 (0.5), 2 (0.3), 0 (0.2)
    params = SamplingParams(1.0, 0.6, 3)
    draws = {sample_token(logits, params, torch.Generator().manual_seed(s)) for s in range(200)}
    assert draws == {1, 2}                                   # 0.5 < 0.6 needs token 2 too; 0.8 >= 0.6 stops there
    assert {sample_token(logits, SamplingParams(1.0, 0.5, 3), torch.Generator().manual_seed(s))
            for s in range(50)} == {1}                       # 0.5 already reaches 0.5: the top token alone
    a, b = params.generator(), params.generator()
    assert [sample_token(logits, params, a) for _ in range(20)] == [sample_token(logits, params, b) for _ in range(20)]
    assert sample_token(logits, SamplingParams(), None) == 1
    unseeded = SamplingParams(0.7).seeded()
    assert unseeded.seed is not None and SamplingParams().seeded().seed is None



def test_top_k_keeps_the_k_most_likely_then_top_p_renormalised():
    """vLLM's order (apply_top_k_top_p): top-k, then the nucleus of the renormalised remainder; 0 and -1 are off."""
    logits = torch.log(torch.tensor([0.1, 0.4, 0.3, 0.2]))                 # sorted: 1 (0.4), 2 (0.3), 3 (0.2), 0
    draws = lambda **kw: {sample_token(logits, SamplingParams(1.0, seed=0, **kw),                     # noqa: E731
                                       torch.Generator().manual_seed(s)) for s in range(300)}
    assert draws(top_k=2) == {1, 2} and draws(top_k=1) == {1}
    assert draws(top_k=0) == draws(top_k=-1) == draws(top_k=9) == {0, 1, 2, 3}
    assert draws(top_k=3, top_p=0.6) == {1, 2}       # 0.4 / 0.9 < 0.6 needs token 2; top-p alone would need it too
    assert draws(top_k=2, top_p=0.5) == {1}          # renormalised 0.4 / 0.7 = 0.57 >= 0.5: token 1 alone


@pytest.mark.parametrize("kwargs, match", [(dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan),
                         "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                         (dict(seed=2**63), "seed"), (dict(seed=-2**63 - 1), "seed"), (dict(top_k=-2), "top_k")])
def test_bad_sampling_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    with pytest.raises(TypeError, match="seed"):
        SamplingParams(0.5, seed=1.0)
    with pytest.raises(TypeError, match="top_k"):
        SamplingParams(0.5, top_k=2.0)


def test_sampled_requests_in_a_batch_equal_their_batch1_runs_and_survive_preemption():
    model = load_model("demo-tiny")
    prompts = [list(b"sample me"), list(b"a different, longer prompt"), list(b"z")]
    params = [SamplingParams(1.2, 0.9, 11), SamplingParams(0.8, 1.0, 12), SamplingParams(1.5, 0.7, 13)]
    alone = build_engine(EngineSpec("demo-tiny", prefix_cache=False, max_num_seqs=1), model)
    refs = [alone.generate(p, 10, sampling=sp).output_tokens for p, sp in zip(prompts, params)]
    engine = build_engine(EngineSpec("demo-tiny", max_num_seqs=4), model)
    rids = [engine.submit(p, 10, sampling=sp) for p, sp in zip(prompts, params)]
    for _ in range(4):
        engine.step()
    assert engine.preempt_newest() == rids[-1]                # recomputed from its seed's start
    engine.run_until_idle()
    assert [engine.result(r).output_tokens for r in rids] == refs
    greedy = alone.generate(prompts[0], 10).output_tokens
    assert refs[0] != greedy
    with pytest.raises(TypeError, match="sampling"):
        engine.submit(prompts[0], 2, sampling={"temperature": 1.0})
