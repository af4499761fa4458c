"""ReplaySSM: checkpoint + ring of (k, u, g) records; a ring wrap, a rollback across a materialisation and an
abort mid-ring each commit caches bitwise equal to plain decoding (fp32 records, demo-tiny)."""
import pytest
import torch

from kda_core.kda import kda_recurrent
from kda_core.model import cache_equal
from serve.spec_decode.replay_ssm import ReplaySSM, replay_records
from serve.spec_decode.verify import verify, verify_and_replay
from tests.serve.spec_decode.helpers import greedy_continuation, model, one_thread, start

pytestmark = pytest.mark.usefixtures(one_thread.__name__)
__all__ = ["model", "start"]  # shared fixtures


def _drafts(target: list[int], num_accepted: int, n: int) -> list[int]:
    """n drafts: the first num_accepted are the greedy target, the rest wrong."""
    return [t if j < num_accepted else (t + 1) % 256 for j, t in enumerate(target[:n])]


def _step(model, state, strategy, n, a):
    """One verify of n drafts accepting a; asserts the commit equals plain decoding. Returns the result."""
    target, ref = greedy_continuation(model, state, n)
    res = verify_and_replay(model, state, _drafts(target, a, n), strategy)
    strategy.check_integrity()
    assert res.num_accepted == a and list(res.emitted_tokens) == target[: a + 1]
    assert cache_equal(res.state.cache, ref[a])
    return res


def test_replay_records_equal_the_recurrence():
    """Records (k, u, g) taken from a kda_recurrent run replay to its final state bitwise."""
    from kda_core.kda import kda_step_with_correction
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 6, 2, 8, 5
    q, k = torch.randn(B, T, H, K, generator=gen), torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v, g = torch.randn(B, T, H, V, generator=gen), -torch.rand(B, T, H, K, generator=gen)
    beta, s0 = torch.rand(B, T, H, generator=gen), torch.randn(B, H, K, V, generator=gen)
    _, final, states = kda_recurrent(q, k, v, g, beta, s0, output_states=True)
    prev = [s0] + [states[:, t] for t in range(T - 1)]
    u = torch.stack([kda_step_with_correction(q[:, t].contiguous(), k[:, t].contiguous(), v[:, t].contiguous(),
                                              g[:, t].contiguous(), beta[:, t].contiguous(), prev[t])[2]
                     for t in range(T)], dim=1)
    assert torch.equal(replay_records(s0, k, u, g), final)
    assert torch.equal(replay_records(s0, k[:, :3], u[:, :3], g[:, :3]), states[:, 2])
    assert replay_records(s0, k[:, :0], u[:, :0], g[:, :0]) is s0


def test_decode_step_writes_one_record_not_a_state(model, start):
    """n = 0 (plain decode): the cursor moves by one record; nothing is materialised until the ring is full."""
    strat, state = ReplaySSM(ring_size=4, window=1), start
    for step in range(9):
        res = _step(model, state, strat, 0, 0)
        state = res.state
        assert strat.commit_end == step + 1 and strat.tail == strat.commit_end
        assert res.forced_commit == (step >= 4 and step % 4 == 0)      # ring of 4: fold before steps 4 and 8
    assert strat.num_materialisations == 2 and strat.head == 8


def test_ring_wrap_many_steps(model, start):
    """A ring of 7 records over 12 steps of mixed accepts: counters pass the ring size several times."""
    strat, state = ReplaySSM(ring_size=7, window=4), start
    for n, a in [(3, 3), (3, 1), (2, 0), (3, 2), (1, 1), (3, 3), (3, 0), (2, 2), (3, 1), (0, 0), (3, 3), (2, 1)]:
        state = _step(model, state, strat, n, a).state
    assert strat.commit_end > 2 * strat.ring_size and strat.num_materialisations >= 3
    assert strat.commit_end - strat.head <= strat.ring_size


def test_rollback_across_a_materialisation(model, start):
    """The verify that forces the fold (ring full) is then mostly rejected: the rollback is a cursor move
    past a checkpoint that was just materialised, and the state is still exact."""
    strat, state = ReplaySSM(ring_size=6, window=4), start
    state = _step(model, state, strat, 3, 3).state                       # 4 records committed, 2 free
    before = strat._checkpoint_position
    res = _step(model, state, strat, 3, 0)                                # needs 4 > 2 free: fold first
    assert res.forced_commit and strat.num_materialisations == 1
    assert strat._checkpoint_position == before + 4 and strat.head == 4 and strat.commit_end == 5
    state = _step(model, res.state, strat, 3, 2).state                    # replay reads past the new checkpoint
    assert strat.commit_end == 8


def test_abort_mid_ring_keeps_records_and_state(model, start):
    """A verify recorded mid-ring then discarded (a preemption): counters return, the committed records are
    untouched, and the retry commits exactly."""
    strat, state = ReplaySSM(ring_size=8, window=4), start
    state = _step(model, state, strat, 2, 1).state                        # 2 committed records
    committed = {f: t[:2].clone() for f, t in strat._ring.items()}
    strat.record(model, state.cache, verify(model, state, [1, 2, 3]))
    assert strat.tail == 6
    strat.discard()
    strat.check_integrity()
    assert strat.tail == strat.commit_end == 2
    assert all(torch.equal(strat._ring[f][:2], c) for f, c in committed.items())
    _step(model, state, strat, 3, 1)


def test_bad_input_named(model, start):
    with pytest.raises(ValueError, match="ring_size"):
        ReplaySSM(0, 1)
    with pytest.raises(ValueError, match="window"):
        ReplaySSM(4, 5)
    strat = ReplaySSM(4, 2)
    with pytest.raises(ValueError, match="window of 2"):
        verify_and_replay(model, start, [1, 2], strat)
    res = verify_and_replay(model, start, [1], strat)
    with pytest.raises(ValueError, match="committed up to"):
        verify_and_replay(model, start, [1], strat)                       # stale caches, not the last commit
    assert strat.commit_end == 1 + res.num_accepted
