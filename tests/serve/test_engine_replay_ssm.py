"""``ServeEngine(state_write="replay_ssm")``: ReplaySSM as the decode-time state write (vllm#47572). Every
request's tokens and logits are bitwise those of the slot-write engine across ring wraps, aborts and
preemptions mid-ring, prefix-cache hits and checkpoint publishes; the engine's integrity (rings included)
holds after every step; a decode step writes the bytes the formula predicts."""
from __future__ import annotations

import functools

import pytest
import torch

from serve.config import ServeConfig
from serve.engine import EngineArgs, ServeEngine, build_engine
from serve.engine.request import RequestStatus
from serve.memory.replay_state_write import decode_write_bytes
from tests.serve.engine_helpers import check_checkpoints, oracle_speculation
from tests.serve.prefix.helpers import tiny_model, tokens


def engine(state_write: str, ring_size: int = 16, cache: bool = False, block: int = 16, num_pages: int = 96,
           page_policy: str = "unified", num_groups: int = 1, **kw) -> ServeEngine:
    """An engine on a poisoned pool (never-written pages read NaN), optionally with a prefix cache; "unified"
    pages hold a whole state each, "multi_page" pages one KV block (a state then spans several pages)."""
    config = ServeConfig(block, block, num_groups=num_groups, page_policy=page_policy)
    return build_engine(EngineArgs(tiny_model(), num_pages, config, prefix_cache=cache, poison=True,
                                   state_write=state_write, ring_size=ring_size, **kw))


def drive(eng: ServeEngine, arrivals, abort_at=None, preempt_at=None) -> dict:
    """Submit ``(step, prompt, new)`` arrivals at their steps; at step ``abort_at`` abort the oldest running
    request, at ``preempt_at`` preempt the newest; step to idle with
    ``check_integrity`` after each step. Returns {rid: result} and records what the ring held when cut."""
    pending, rids, step = sorted(arrivals, key=lambda a: a[0]), [], 0
    drive.cut = {}
    while pending or eng.waiting or eng.running:
        while pending and pending[0][0] <= step:
            _, prompt, new = pending.pop(0)
            rids.append(eng.submit(prompt, new, record_logits=True))
        if step == abort_at and eng.running:
            rid = eng.running[0]
            drive.cut["abort"] = eng.replay.records(rid) if eng.replay else None
            eng.abort(rid)
        if step == preempt_at and eng.running:
            drive.cut["preempt"] = eng.replay.records(eng.running[-1]) if eng.replay else None
            eng.preempt_newest()
        eng.step()
        eng.check_integrity()
        step += 1
        assert step < 2000
    return {rid: eng.result(rid) for rid in rids}


def assert_bitwise(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        g, w = got[rid], want[rid]
        assert (g.status, g.output_tokens) == (w.status, w.output_tokens), f"request {rid}"
        assert (g.logits is None) == (w.logits is None) and (w.logits is None or torch.equal(g.logits, w.logits)), \
            f"request {rid}: logits differ from the slot write"


# staggered arrivals, different prompt lengths: rows of one step hold different numbers of records
ARRIVALS = [(0, tokens(1, 23), 30), (0, tokens(2, 40), 21), (3, tokens(3, 9), 26), (7, tokens(4, 70), 17),
            (11, tokens(5, 33), 25)]


@functools.cache
def slot_reference(policy: str, groups: int) -> dict:
    """The slot-write engine's results on :data:`ARRIVALS` with the same abort and preemption (run once per
    layout and shared by the ring sizes)."""
    return drive(engine("slot", page_policy=policy, num_groups=groups, num_pages=400), ARRIVALS, abort_at=14,
                 preempt_at=19)


@pytest.mark.parametrize("ring_size, policy", [pytest.param(1, "unified", id="R1"), pytest.param(3, "unified", id="R3"),
                                               pytest.param(8, "unified", id="R8"),
                                               pytest.param(5, "multi_page", id="R5-2-groups-over-pages"),
                                               pytest.param(64, "unified", id="R64-never-full")])
def test_replay_ssm_bitwise_with_abort_and_preemption_mid_ring(ring_size, policy):
    groups = 2 if policy == "multi_page" else 1
    want = slot_reference(policy, groups)
    eng = engine("replay_ssm", ring_size, page_policy=policy, num_groups=groups, num_pages=400)
    got = drive(eng, ARRIVALS, abort_at=14, preempt_at=19)
    assert_bitwise(got, want)
    assert sum(r.status is RequestStatus.ABORTED for r in got.values()) == 1
    if policy == "multi_page":
        assert eng.layout.num_groups == 2 and all(eng.layout.group_pages(g) > 1 for g in range(2)), \
            "each group's state should span several pages"
    if ring_size > 2:                                   # cut mid-ring: records were pending, then dropped
        assert drive.cut["abort"] > 0 and drive.cut["preempt"] > 0, drive.cut
    if 1 < ring_size < 30:                              # the ring wrapped (materialised) many times
        assert eng.replay.num_materialisations >= 10
    assert not eng.replay._of and eng.replay.capacity < 2 * len(ARRIVALS)   # all freed; grown by doubling
    eng.check_integrity()


def test_replay_ssm_bitwise_with_prefix_hits_and_checkpoint_publishes():
    """A decode publish (the final checkpoint at b_end) materialises mid-ring; a later request hits that
    checkpoint and decodes from it; stored checkpoints are the model's states after exactly their tokens."""
    first = [(0, tokens(7, 37), 30), (0, tokens(8, 20), 45), (2, tokens(9, 50), 20)]   # each publishes at 64

    def run(state_write):
        eng = engine(state_write, ring_size=40, cache=True, num_pages=128)
        res = drive(eng, first)
        seqs = [list(p) + list(res[rid].output_tokens) for rid, (_, p, _) in zip(sorted(res), first)]
        second = [(0, seqs[0][:66] + tokens(10, 3), 20), (0, seqs[1][:65] + [7], 19), (1, seqs[2][:64] + [3], 22)]
        res2 = drive(eng, second)
        check_checkpoints(eng, seqs + [p + list(res2[rid].output_tokens) for rid, (_, p, _) in
                                       zip(sorted(res2), second)], set())
        return eng, {**res, **res2}

    eng_slot, want = run("slot")
    eng, got = run("replay_ssm")
    assert_bitwise(got, want)
    assert eng.replay.num_publish_materialisations >= 3, "publishes did not force a materialisation mid-ring"
    assert [r.hit_tokens for r in got.values()][3:] == [64, 64, 64], "no hit on a decode-published checkpoint"
    assert [r.hit_tokens for r in got.values()] == [r.hit_tokens for r in want.values()]


def test_replay_ssm_decode_write_bytes():
    """Decode-only steps: the slot write writes state + conv per row per step, ReplaySSM a record + conv and
    the state on one step in R; both as :func:`decode_write_bytes` predicts."""
    R, B, steps = 4, 3, 8
    cfg = tiny_model().cfg
    for state_write, ring in (("slot", None), ("replay_ssm", R)):
        eng = engine(state_write, R)
        for i in range(B):
            eng.submit(tokens(20 + i, 10), steps + 2)
        eng.step()                                         # the prefills (one token out each)
        before = dict(eng.runner.decode_bytes)
        for _ in range(steps):
            eng.step()
        per_step = {k: (eng.runner.decode_bytes[k] - before[k]) / (B * steps) for k in before}
        assert per_step == pytest.approx(decode_write_bytes(cfg, ring)), state_write
    assert per_step["state"] < decode_write_bytes(cfg, None)["state"]


def test_replay_ssm_bad_input():
    with pytest.raises(ValueError, match="state_write"):
        engine("replay")
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="ring_size"):
            engine("replay_ssm", bad)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="rows_per_forward"):
            engine("replay_ssm", rows_per_forward=bad)
    spec = oracle_speculation({}, "snapshot", 0.0, 2)
    with pytest.raises(ValueError, match="ReplaySSM"):
        engine("replay_ssm", speculation=spec)
    with pytest.raises(ValueError, match="ring_size"):
        decode_write_bytes(tiny_model().cfg, 0)
