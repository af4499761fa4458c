"""Fault isolation in ``ServeEngine``: a failure planted in one request's row of a mixed batch (prefill rows beside
decode rows, or beside verify rows with speculation), while the step builds, runs or post-processes it, aborts
that request with the error as its reason and releases everything it held; the step goes on, and every other
request's tokens and logits are bitwise its run alone. A model that fails on its own stops the engine
(:class:`serve.engine.EngineFailure`)."""
from __future__ import annotations

import pytest
import torch

from serve.config import ServeConfig
from serve.engine import EngineArgs, EngineFailure, ServeEngine, build_engine
from serve.engine.request import RequestStatus
from tests.serve.engine_helpers import STRATEGIES, oracle_speculation
from tests.serve.prefix.helpers import tiny_model, tokens

PROMPTS = {"d1": tokens(301, 10), "d2": tokens(302, 13), "p": tokens(303, 70)}   # two decoders, one long prefill
NEW = 8


def make(refs: dict | None = None, rows_per_forward: int | None = None) -> ServeEngine:
    """A cache-on engine on a poisoned pool, prefill chunks of 16 tokens; ``refs`` (prompt -> greedy tokens):
    speculation with oracle drafts (every decode row a verify row)."""
    spec = None if refs is None else oracle_speculation(refs, next(iter(STRATEGIES)), 0.3, 3)
    return build_engine(EngineArgs(tiny_model(), 128, ServeConfig(16, 16, page_policy="unified"), prefix_cache=True,
                                   poison=True, max_prefill_chunk=16, speculation=spec, max_num_seqs=4,
                                   rows_per_forward=rows_per_forward))


def plant(monkeypatch, eng: ServeEngine, phase: str, rid: int) -> None:
    """Make request ``rid``'s row raise "planted" while the step builds, runs or post-processes it."""
    def boom():
        raise RuntimeError(f"planted failure in the {phase} of request {rid}")

    if phase == "build":
        real_row = eng._row
        monkeypatch.setattr(eng, "_row", lambda req, *a: boom() if req.rid == rid else real_row(req, *a))
    elif phase == "run":
        real_run = eng.runner.run
        monkeypatch.setattr(eng.runner, "run", lambda batch: boom() if any(
            r.req is not None and r.req.rid == rid for r in batch.rows) else real_run(batch))
    else:
        for name in ("decode", "prefill", "verify"):
            real = getattr(eng.postprocess, name)
            monkeypatch.setattr(eng.postprocess, name,
                                lambda req, *a, _real=real: boom() if req.rid == rid else _real(req, *a))


@pytest.mark.parametrize("phase", ["build", "run", "postprocess"])
@pytest.mark.parametrize("mode, target", [("plain", "d1"), ("plain", "p"), ("spec", "d1"), ("spec", "p")],
                         ids=["decode-row", "prefill-beside-decode", "verify-row", "prefill-beside-verify"])
def test_a_failing_row_aborts_its_request_and_the_others_are_bitwise_alone(monkeypatch, mode, target, phase):
    refs = None
    if mode == "spec":
        refs = {tuple(p): make().generate(p, NEW).output_tokens for p in PROMPTS.values()}
    alone = {name: make(refs).generate(p, NEW, record_logits=True) for name, p in PROMPTS.items()}
    eng = make(refs)
    rids = {name: eng.submit(PROMPTS[name], NEW, record_logits=True) for name in ("d1", "d2")}
    eng.step()                                                     # d1, d2 prefilled: both decode from here
    rids["p"] = eng.submit(PROMPTS["p"], NEW, record_logits=True)
    plant(monkeypatch, eng, phase, rids[target])
    assert eng.step()                                              # the mixed step: no exception escapes
    batch_kinds = {"decode" if r.decode else "verify" if r.verify else "prefill"
                   for r in (eng.last_batch.rows if eng.last_batch else []) if r.req is not None}
    mixed = {"prefill", "verify" if mode == "spec" else "decode"}          # what the step scheduled
    assert batch_kinds == (mixed - {"prefill"} if target == "p" and phase != "postprocess" else mixed), batch_kinds
    bad = eng.requests[rids[target]]
    assert bad.status is RequestStatus.ABORTED and f"planted failure in the {phase}" in bad.reason, bad.reason
    where = "building its row" if phase == "build" else "prefill of tokens [0, 16)" if target == "p" else "decode of"
    assert bad.reason.startswith(where), bad.reason
    assert all(bad.rid not in eng.pool.holders(p) for p in range(eng.pool.num_pages)), "the aborted request holds pages"
    eng.check_integrity()
    while eng.step():
        eng.check_integrity()
    for name, rid in rids.items():
        if name == target:
            continue
        res = eng.result(rid)
        assert res.status is RequestStatus.FINISHED, (name, res.reason)
        assert res.output_tokens == alone[name].output_tokens, f"{name}: tokens differ from its run alone"
        assert torch.equal(res.logits, alone[name].logits), f"{name}: logits differ from its run alone"
    eng.cache.clear()
    assert eng.pool.num_free == eng.pool.num_pages, "pages leaked"


def test_one_row_per_forward_isolates_a_failing_request_too(monkeypatch):
    alone = make(rows_per_forward=1).generate(PROMPTS["d2"], NEW, record_logits=True)
    eng = make(rows_per_forward=1)
    bad, good = (eng.submit(PROMPTS[n], NEW, record_logits=True) for n in ("d1", "d2"))
    real = eng.postprocess.decode
    monkeypatch.setattr(eng.postprocess, "decode", lambda req, *args: (_ for _ in ()).throw(ValueError("planted"))
                        if req.rid == bad else real(req, *args))
    while eng.step():
        eng.check_integrity()
    assert eng.result(bad).status is RequestStatus.ABORTED and "ValueError: planted" in eng.result(bad).reason
    assert eng.result(good).output_tokens == alone.output_tokens
    assert torch.equal(eng.result(good).logits, alone.logits)


@pytest.mark.parametrize("rows_per_forward", [None, 1], ids=["one-forward", "one-row-per-forward"])
def test_a_model_that_fails_on_its_own_stops_the_engine(monkeypatch, rows_per_forward):
    """Not any one request's failure: the model's MLP raises for every input, so the one-token probe fails
    too and step() raises EngineFailure (the server then exits for a supervisor to restart it)."""
    eng = make(rows_per_forward=rows_per_forward)
    eng.submit(PROMPTS["d1"], NEW)
    eng.step()
    assert eng.model_runs()

    def broken(i, x):
        raise RuntimeError("the model's weights are gone")

    monkeypatch.setattr(eng.model, "feed_forward", broken)
    assert not eng.model_runs()
    with pytest.raises(EngineFailure, match="one-token probe.*the model's weights are gone"):
        eng.step()


def test_a_step_whose_every_row_failed_to_build_runs_no_forward(monkeypatch, caplog):
    """When every row of a step fails while it is built (its request aborted), the step runs no forward: no empty
    batch is built and no warning claims that "a batch of 0 rows raised" (an empty batch cannot be built)."""
    eng = make()
    rid = eng.submit(PROMPTS["d1"], NEW)
    plant(monkeypatch, eng, "build", rid)
    runs = []
    real_run = eng.runner.run
    monkeypatch.setattr(eng.runner, "run", lambda batch: runs.append(batch) or real_run(batch))
    with caplog.at_level("WARNING", logger="serve.engine"):
        assert eng.step()
    assert eng.result(rid).status is RequestStatus.ABORTED and "planted" in eng.result(rid).reason
    assert runs == [] and not any("batch of 0 rows" in r.getMessage() for r in caplog.records), caplog.text
    eng.check_integrity()
    assert eng.pool.num_free == eng.pool.num_pages
