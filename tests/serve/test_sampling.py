"""Per-request sampling (serve/engine/sampling.py): the top-p nucleus by hand, draws reproducible per seed, the sampler
total over everything the request schema admits (hypothesis), and in the engine a sampled request's tokens equal its
batch-1 run's whatever its neighbours (and after a preemption)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from serve.engine.request import RequestStatus
from serve.engine.sampling import MIN_TEMPERATURE, SEED_MAX, SEED_MIN, SamplingParams, sample_token
from serve.http.model import EngineSpec, build_engine, load_model
from serve.http.protocol import CompletionRequest, RequestError, check_request


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


# the edges of what the schema admits: subnormals, the smallest positive double and fp32, 1 - eps, the range ends
TINY = [5e-324, 1e-320, 1e-45, 1.4e-45, 1e-38, MIN_TEMPERATURE, 1e-300, 1e-46]
temperatures = st.one_of(st.floats(0.0, 2.0), st.sampled_from(TINY + [0.0, 2.0, 2.0 - 2**-52, 1.0 - 2**-53]),
                         st.integers(0, 2), st.floats(allow_nan=False, allow_infinity=False))
top_ps = st.one_of(st.floats(0.0, 1.0, exclude_min=True), st.sampled_from(TINY + [1.0, 1.0 - 2**-53]),
                   st.just(1), st.floats(allow_nan=False, allow_infinity=False))
top_ks = st.one_of(st.integers(-1, 300), st.integers(301, 2**70), st.integers(-2**70, -2))
seeds = st.one_of(st.integers(SEED_MIN, SEED_MAX), st.sampled_from([SEED_MIN, SEED_MAX, 0]), st.integers())
logit_rows = st.one_of(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=300),  # any finite fp32
    st.lists(st.floats(-30, 30, width=32), min_size=1, max_size=300),         # a model's range
    st.integers(1, 300).map(lambda n: [0.5] * n))                              # all tied


@given(temperature=temperatures, top_p=top_ps, top_k=top_ks, seed=seeds, logits=logit_rows)
@example(temperature=1e-38, top_p=1.0, top_k=0, seed=1, logits=[0.0, 3.0, 2.9, -1.0])      # the server-killing request
@example(temperature=5e-324, top_p=1.0, top_k=0, seed=1, logits=[1.0, 2.0])
@example(temperature=1.0, top_p=1e-300, top_k=0, seed=1, logits=[1.0, 2.0, 0.5])
@example(temperature=1.0, top_p=1e-46, top_k=0, seed=1, logits=[1.0, 2.0, 0.5])
@example(temperature=2.0, top_p=1.0 - 2**-53, top_k=2**70, seed=SEED_MIN, logits=[-3e38, 3e38, 0.0])
def test_sampler_is_total_over_what_the_schema_admits(temperature, top_p, top_k, seed, logits):
    """Whatever the request schema accepts (``check_request`` does not raise) gives a token: a kept one (inside top-k,
    an argmax at the greedy limit); whatever it does not accept is a 400 naming the field. Temperatures at or below
    ~1e-38 and top_p at or below ~1e-46 used to pass the schema and then raise in the sampler, killing the engine."""
    body = {"model": "m", "prompt": "x", "max_tokens": 1, "temperature": temperature, "top_p": top_p,
            "top_k": top_k, "seed": seed}
    try:
        params = check_request(CompletionRequest.model_validate(body), "m", 8).sampling
    except RequestError as err:
        assert err.status == 400 and err.param in ("temperature", "top_p", "top_k", "seed"), err.body()
        return
    row = torch.tensor(logits, dtype=torch.float32)                                       # [V]
    draw = [sample_token(row, params.seeded(), params.seeded().generator()) for _ in range(2)]
    assert 0 <= draw[0] < row.numel()
    if params.seed is not None:
        assert draw[0] == draw[1]                                                          # reproducible per seed
    if 0 < params.top_k < row.numel():
        assert row[draw[0]] >= row.topk(params.top_k).values[-1]
    if params.temperature <= MIN_TEMPERATURE and row.abs().max() >= 1e-30:
        assert row[draw[0]] == row.max()


def test_poison_temperature_request_finishes_beside_a_normal_one():
    """A request at temperature 1e-38 raised in the sampler at its first token, was left in PREFILL with no token
    and every later step raised: now it finishes (its greedy limit) and so does its neighbour."""
    model = load_model("demo")
    engine = build_engine(EngineSpec("demo", max_num_seqs=4), model)
    normal = engine.submit(list(b"hello"), 4)
    poison = engine.submit(list(b"x"), 4, sampling=SamplingParams(temperature=1e-38, seed=1))
    engine.run_until_idle()
    engine.check_integrity()
    assert engine.result(normal).status is engine.result(poison).status is RequestStatus.FINISHED
    assert engine.result(poison).output_tokens == engine.generate(list(b"x"), 4).output_tokens   # greedy limit
