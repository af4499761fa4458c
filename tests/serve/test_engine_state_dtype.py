"""``ServeEngine(state_dtype=...)``: KDA recurrent states stored in bf16 / fp16 (vLLM's ``mamba_ssm_cache_dtype``),
compute in fp32. The engine equals the model run with its state rounded wherever the engine writes it; the
pages hold the stored dtype; gather / scatter round-trip as ``.to(dtype).float()``; a warm run equals the
cache-off run split at its hit; slots grow by the stored-byte ratio; the HTTP flag reaches the engine; bad
dtypes raise ValueError naming ``state_dtype``. (Batch == batch-1 under bf16: ``test_engine_batch.py``.)"""
from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from kda_core.config import PRESETS, ModelConfig
from kda_core.layer import KDACache
from kda_core.model import HybridCache
from serve.config import ServeConfig
from serve.engine import ServeEngine
from serve.engine.request import RequestStatus
from serve.http.__main__ import engine_spec, parse_args
from serve.http.app import create_app
from serve.http.model import EngineSpec, build_engine
from serve.memory.layout import CacheLayout
from serve.memory.pages import read_state, write_state
from serve.memory.pool import PageKind, PagePool
from serve.prefix.cache import PrefixCache
from tests.serve.prefix.helpers import tiny_model, tokens

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]


def engine(state_dtype, num_pages: int = 64, policy: str = "unified", cache: bool = False, **kw) -> ServeEngine:
    """An engine on a poisoned pool (never-written pages read NaN), blocks and checkpoints of 16 tokens;
    ``state_dtype`` None leaves every default (the fp32 engine as it was)."""
    model = tiny_model()
    config = ServeConfig(16, 16, page_policy=policy, **({} if state_dtype is None else {"state_dtype": state_dtype}))
    pool = PagePool(num_pages, config.page_bytes(model.cfg), poison=True)
    return ServeEngine(model, pool, PrefixCache(pool, config, cfg=model.cfg) if cache else None,
                       config=config, **kw)


def rounded(cache: HybridCache, dtype, kda_layers) -> HybridCache:
    """``cache`` with every KDA recurrent state rounded to nearest into ``dtype`` and back (conv kept)."""
    layers = list(cache.layers)
    for i in kda_layers:
        layers[i] = KDACache(layers[i].recurrent.to(dtype).float(), layers[i].conv)
    return HybridCache(tuple(layers), cache.num_tokens)


def oracle(prompt, new: int, dtype, period: int = 1, also_at: tuple = ()):
    """The independent reference: the model straight (prefill, then one decode step per token), its
    recurrent state rounded after the prefill, after every decode step ``period`` steps after the last rounding,
    and after the decode steps in ``also_at`` (1-based; a ReplaySSM flush forced by a publish, which restarts
    the period). Returns (tokens, logits ``[new, 256]``)."""
    model = tiny_model()
    logits, cache = model.prefill(torch.tensor([list(prompt)]))
    cache, rows = rounded(cache, dtype, model.cfg.kda_layers), [logits[0, -1]]
    out, last = [int(rows[0].argmax())], 0
    for k in range(1, new):
        step, cache = model.decode_step(out[-1], cache)
        if k - last == period or k in also_at:
            cache, last = rounded(cache, dtype, model.cfg.kda_layers), k
        rows.append(step[0])
        out.append(int(step[0].argmax()))
    return tuple(out), torch.stack(rows)


@pytest.mark.parametrize("rows_per_forward", [None, 1], ids=["one-forward", "one-row-per-forward"])
@pytest.mark.parametrize("state_dtype", DTYPES)
def test_engine_equals_the_model_with_its_state_rounded_at_every_write(state_dtype, rows_per_forward):
    """Tokens and logits bitwise the oracle: fp32 (the default) is the model straight, unchanged; bf16 / fp16
    round the state after the prefill and after every decode step, exactly as the oracle does."""
    prompts = [tokens(1, 40), tokens(2, 75)]
    if state_dtype == torch.float32:
        eng = engine(None, rows_per_forward=rows_per_forward)                            # every default
    else:                                                              # the engine's keyword on a default config
        model, config = tiny_model(), ServeConfig(16, 16, page_policy="unified")
        pool = PagePool(64, config.page_bytes(model.cfg), poison=True)
        eng = ServeEngine(model, pool, None, config=config, rows_per_forward=rows_per_forward,
                          state_dtype=state_dtype)
        assert eng.config.state_dtype == eng.layout.state_dtype == state_dtype
    rids = [eng.submit(p, 8, record_logits=True) for p in prompts]
    eng.run_until_idle()
    for rid, p in zip(rids, prompts):
        res, (want_tokens, want_logits) = eng.result(rid), oracle(p, 8, state_dtype)
        assert res.output_tokens == want_tokens and torch.equal(res.logits, want_logits)
    if state_dtype == torch.float32:
        assert eng.config.state_dtype == torch.float32 and eng.layout.is_fp32
    else:      # the rounding is load-bearing: the fp32 model differs
        assert not torch.equal(eng.result(rids[1]).logits, oracle(prompts[1], 8, torch.float32)[1])


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_state_pages_hold_the_stored_dtype(state_dtype):
    """After a prefill, the arena bytes of the request's pages (a state spanning several KV-block pages) are,
    per layer, the model's recurrent state rounded to nearest into the stored dtype, then its fp32 conv
    window; the layout counts exactly those bytes."""
    eng = engine(state_dtype, policy="multi_page")
    prompt = tokens(3, 50)
    rid = eng.submit(prompt, 4)
    eng.step()                                                     # admit + prefill, state committed
    req, lay = eng.requests[rid], eng.layout
    assert req.status is RequestStatus.DECODE and lay.group_pages(0) > 1
    _, cache = tiny_model().prefill(torch.tensor([prompt]))
    words = eng.runner._flat_arena()[list(req.state_pages[0])].reshape(-1)      # [state pages * E] fp32 words
    w_rec, w_conv = lay.state_words()
    for j, i in enumerate(lay.groups[0]):
        rec = words[j * (w_rec + w_conv): j * (w_rec + w_conv) + w_rec].view(state_dtype)
        conv = words[j * (w_rec + w_conv) + w_rec: (j + 1) * (w_rec + w_conv)]
        assert torch.equal(rec, cache.layers[i].recurrent.to(state_dtype).reshape(-1))
        assert torch.equal(conv, cache.layers[i].conv.reshape(-1))
    cfg = lay.cfg
    elem = torch.finfo(state_dtype).bits // 8
    assert lay.state_bytes == cfg.num_kda_layers * (cfg.num_heads * cfg.head_k_dim * cfg.head_v_dim * elem
                                                    + cfg.conv_dim * (cfg.conv_kernel - 1) * 4)


@pytest.mark.parametrize("policy,groups", [("unified", 1), ("multi_page", 2)])
@pytest.mark.parametrize("state_dtype", DTYPES[1:])
def test_gather_scatter_round_trip_is_the_rounding(state_dtype, policy, groups):
    """scatter then gather (the batch path) and write_state then read_state (the checkpoint path) give
    ``rec.to(dtype).float()`` and the conv window exactly; an unscattered slot stays NaN; scatter_conv
    (the ReplaySSM decode write) leaves the stored recurrent state untouched."""
    model = tiny_model()
    config = ServeConfig(16, 16, groups, policy, state_dtype)
    pool = PagePool(64, config.page_bytes(model.cfg), poison=True)
    eng = ServeEngine(model, pool, None, config=config)
    lay, run = eng.layout, eng.runner
    slots = []
    for s in range(3):
        it = iter(pool.alloc(PageKind.KDA_STATE, lay.state_pages, f"r{s}"))
        slots.append([tuple(next(it) for _ in range(lay.group_pages(g))) for g in range(groups)])
    gen = torch.Generator().manual_seed(0)
    dense = {i: (torch.randn(3, *run._rec_shape, generator=gen), torch.randn(3, *run._conv_shape, generator=gen))
             for i in model.cfg.kda_layers}
    run.scatter_states(slots, dense, [0, 2])
    back = run.gather_states(slots)
    for i, (rec, conv) in dense.items():
        for s in (0, 2):
            assert torch.equal(back[i][0][s], rec[s].to(state_dtype).float()) and torch.equal(back[i][1][s], conv[s])
        assert back[i][0][1].isnan().all() and back[i][1][1].isnan().all()
        assert not torch.equal(back[i][0][0], rec[0])                  # rounding happened
    new_conv = {i: (rec, conv + 1) for i, (rec, conv) in dense.items()}
    run.scatter_conv(slots, new_conv, [0])
    again = run.gather_states(slots)
    for i, (_, conv) in dense.items():
        assert torch.equal(again[i][0][0], back[i][0][0]) and torch.equal(again[i][1][0], conv[0] + 1)
    caches = {i: KDACache(rec[2:3], conv[2:3]) for i, (rec, conv) in dense.items()}
    write_state(lay, pool, slots[1], caches)
    for i, c in read_state(lay, pool, slots[1]).items():
        assert torch.equal(c.recurrent, dense[i][0][2:3].to(state_dtype).float()) and torch.equal(c.conv, dense[i][1][2:3])


def test_warm_run_equals_the_cache_off_run_split_at_its_hit():
    """bf16 with a prefix cache: the checkpoint at 64 holds the state rounded there, so a warm request from
    it equals bitwise the cache-off run whose prefill is split at 64 (rounded at the chunk end), not the
    unsplit run; its checkpoint pages hold the rounded state of the first 64 tokens."""
    base = tokens(7, 64)
    first, second = base + tokens(8, 30), base + tokens(9, 40)          # both under 128: chunks [0, 64), [64, L)
    eng = engine(torch.bfloat16, num_pages=96, cache=True)
    eng.generate(first, 2)
    warm = eng.generate(second, 6, record_logits=True)
    assert warm.hit_tokens == 64
    split = engine(torch.bfloat16, max_prefill_chunk=64).generate(second, 6, record_logits=True)
    whole = engine(torch.bfloat16).generate(second, 6, record_logits=True)
    assert warm.output_tokens == split.output_tokens and torch.equal(warm.logits, split.logits)
    assert not torch.equal(warm.logits, whole.logits)
    hit = eng.cache.lookup(base + [0])                                  # the checkpoint at 64
    assert hit.num_tokens == 64
    _, cache = tiny_model().prefill(torch.tensor([base]))
    stored = read_state(eng.layout, eng.pool, hit.checkpoint_pages)
    for i, c in stored.items():
        assert torch.equal(c.recurrent, cache.layers[i].recurrent.to(torch.bfloat16).float())


@pytest.mark.parametrize("ring_size", [1, 3])
def test_replay_ssm_rounds_at_each_materialisation(ring_size):
    """bf16 with ``state_write="replay_ssm"``: the state is rounded after the prefill and when the ring
    materialises (every ``ring_size``-th decode step), so the output is the oracle rounding with that
    period (ring_size 1: the slot write); a decode step writes the stored bytes (2 per recurrent element)."""
    prompts = [tokens(11, 30), tokens(12, 45)]
    eng = engine(torch.bfloat16, state_write="replay_ssm", ring_size=ring_size)
    rids = [eng.submit(p, 8, record_logits=True) for p in prompts]
    while eng.step():
        eng.check_integrity()
    for rid, p in zip(rids, prompts):
        want_tokens, want_logits = oracle(p, 8, torch.bfloat16, period=ring_size)
        assert eng.result(rid).output_tokens == want_tokens and torch.equal(eng.result(rid).logits, want_logits)
    cfg = eng.model.cfg
    per_write = cfg.num_kda_layers * cfg.num_heads * cfg.head_k_dim * cfg.head_v_dim * 2
    assert eng.runner.decode_bytes["state"] == eng.replay.num_materialisations * per_write


def test_bf16_nearly_doubles_the_state_slots():
    """Pages are sized by the stored bytes: the recurrent bytes halve exactly, so a pool holds state slots
    in the ratio of the bytes (x1.87 for Kimi-Linear's shape, where the fp32 conv windows are 7% of a state;
    x2 in the limit of no conv). The engine admits exactly the requests its real page counts allow."""
    cfg = PRESETS["kimi-linear-48b-a3b"]
    f32, b16 = (ServeConfig(16, 64, state_dtype=d).layout(cfg) for d in (torch.float32, torch.bfloat16))
    assert f32.state_bytes - b16.state_bytes == cfg.num_kda_layers * cfg.num_heads * cfg.head_k_dim * cfg.head_v_dim * 2
    ratio = (100_000 // b16.state_pages) / (100_000 // f32.state_pages)
    assert 1.85 <= ratio <= 2.0, ratio
    running = {}
    for dt in (torch.float32, torch.bfloat16):
        eng = engine(dt, num_pages=40, policy="multi_page")
        for s in range(12):
            eng.submit(tokens(20 + s, 10), 4)
        eng.step()                                                      # admission fills the pool
        need = sum(eng.requests[eng.running[0]].pages_needed(eng.layout))
        assert len(eng.running) == 40 // need
        running[dt] = len(eng.running)
    assert running[torch.bfloat16] > running[torch.float32]


def test_http_flag_reaches_the_engine(capsys):
    """``python -m serve.http --state-dtype bf16`` builds an engine whose layout stores bf16 states (and
    ``/v1/models`` says so); the default is fp32; an unknown name is an argparse error naming the flag."""
    model = tiny_model()
    for argv, want in (([], torch.float32), (["--state-dtype", "bf16"], torch.bfloat16),
                       (["--state-dtype", "fp16"], torch.float16)):
        spec = engine_spec(parse_args(["--preset", "demo-tiny", "--max-model-len", "64", *argv]))
        eng = build_engine(spec, model)
        assert eng.config.state_dtype == eng.layout.state_dtype == eng.cache.layout.state_dtype == want
    with TestClient(create_app(eng, "kda-demo-tiny", 64, 4, 4)) as client:
        assert client.get("/v1/models").json()["data"][0]["state_dtype"] == "fp16"
    with pytest.raises(SystemExit):
        parse_args(["--state-dtype", "fp8"])
    assert "--state-dtype" in capsys.readouterr().err


def test_bad_state_dtype_raises_value_error_naming_it():
    model = tiny_model()
    config = ServeConfig(16, 16)
    pool = PagePool(16, config.page_bytes(model.cfg))
    for bad in (torch.float64, torch.float8_e4m3fn, "bf16", None.__class__):
        with pytest.raises(ValueError, match="state_dtype"):
            ServeEngine(model, pool, state_dtype=bad)
        with pytest.raises(ValueError, match="state_dtype"):
            ServeConfig(state_dtype=bad)
    with pytest.raises(ValueError, match="state_dtype"):
        EngineSpec(state_dtype="fp8")
    with pytest.raises(ValueError, match="state_dtype .* differs from the prefix cache's"):
        ServeEngine(model, pool, PrefixCache(pool, config, cfg=model.cfg), state_dtype=torch.bfloat16)
    odd = ModelConfig(name="odd", num_layers=2, mla_layers=(1,), hidden_size=16, num_heads=1, head_k_dim=3,
                      head_v_dim=3, kv_lora_rank=8, qk_rope_head_dim=4)
    with pytest.raises(ValueError, match="state_dtype torch.bfloat16 needs H K V even"):
        CacheLayout(odd, 16, 1, 4096, state_dtype=torch.bfloat16).check_engine_dtypes()


def test_fp16_overflow_aborts_the_request_with_its_reason():
    """A state beyond fp16's 65,504 is stored as inf; the next forward that reads it aborts that request (reason
    names the non-finite state), never emitting a token from it, and its neighbour finishes untouched."""
    eng = engine(torch.float16)
    bad, good = eng.submit(tokens(30, 40), 6), eng.submit(tokens(31, 40), 6, record_logits=True)
    eng.step()                                                          # both prefilled, both decoding
    req = eng.requests[bad]
    caches = read_state(eng.layout, eng.pool, req.state_pages)
    write_state(eng.layout, eng.pool, req.state_pages,
                {i: KDACache(c.recurrent + 1e5, c.conv) for i, c in caches.items()})
    assert read_state(eng.layout, eng.pool, req.state_pages)[eng.model.cfg.kda_layers[0]].recurrent.isinf().all()
    eng.run_until_idle()
    res = eng.result(bad)
    assert res.status is RequestStatus.ABORTED and "non-finite" in res.reason.lower() and len(res.output_tokens) == 1
    ok = eng.result(good)
    want_tokens, want_logits = oracle(tokens(31, 40), 6, torch.float16)
    assert ok.output_tokens == want_tokens and torch.equal(ok.logits, want_logits)
    eng.check_integrity()


def cold_runs(state_write: str) -> tuple:
    """One request of 11 prompt and 10 output tokens, bf16, ring of 3, the server default page policy: its result
    cold on a cache-on engine and on a cache-off engine built the same way, and the cache-on engine."""
    def run(cache: bool):
        eng = engine(torch.bfloat16, policy="multi_page", cache=cache, state_write=state_write, ring_size=3)
        return eng.generate(tokens(1, 11), 10, record_logits=True), eng
    (on, eng), (off, _) = run(True), run(False)
    assert on.hit_tokens == 0
    return on, off, eng


def test_cache_on_cold_run_equals_the_cache_off_run_bf16():
    """What the package docstring states for 16-bit states: under the slot write a cache-on cold run is bitwise
    the cache-off run; under ``state_write="replay_ssm"`` it is so up to the decode step that publishes its final
    checkpoint (at 16 tokens: decode step 16 - 11 = 5), which materialises (rounds) the state and restarts the
    ring's period (vllm#55688), so the run is bitwise the model rounded every 3rd step AND at step 5 (the cache-off
    run: every 3rd step only); the logits differ from the first token decoded from that state on."""
    on, off, _ = cold_runs("slot")
    assert on.output_tokens == off.output_tokens and torch.equal(on.logits, off.logits)
    on, off, eng = cold_runs("replay_ssm")
    step = ServeConfig(16, 16).final_checkpoint(11, 20) - 11
    assert step == 5 and on.checkpoints_written == 1 and eng.replay.num_publish_materialisations == 1
    assert (on.output_tokens, off.output_tokens) == (oracle(tokens(1, 11), 10, torch.bfloat16, 3, (step,))[0],
                                                     oracle(tokens(1, 11), 10, torch.bfloat16, 3)[0])
    assert torch.equal(on.logits, oracle(tokens(1, 11), 10, torch.bfloat16, 3, (step,))[1])
    assert torch.equal(off.logits, oracle(tokens(1, 11), 10, torch.bfloat16, 3)[1])
    assert torch.equal(on.logits[: step + 1], off.logits[: step + 1]) and not torch.equal(on.logits, off.logits)


def test_replay_ssm_publish_rounding_is_within_the_bf16_rounding():
    """The extra rounding at the publish is bounded by the one bf16 states already carry: the cache-on cold run
    under ``replay_ssm`` is no farther from the cache-off run than the cache-off run is from the fp32 model (max
    absolute logit difference over the run), and emits the same tokens here."""
    on, off, _ = cold_runs("replay_ssm")
    fp32 = oracle(tokens(1, 11), 10, torch.float32)[1]
    extra, bf16 = (on.logits - off.logits).abs().max(), (off.logits - fp32).abs().max()
    assert 0 < extra <= bf16, (float(extra), float(bf16))
    assert on.output_tokens == off.output_tokens
