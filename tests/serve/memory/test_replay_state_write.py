"""``ReplayStateWrite`` against an obviously-correct oracle: per request, a checkpoint and a list of records,
replayed one row at a time with ``kda_core.kda._step``'s decay and rank-1 write. Random operation sequences
(steps over random subsets of requests in random order, materialisations, releases, new requests reusing
freed rings) must read back bitwise the oracle's states, with ``check_integrity`` after every operation."""
from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kda_core import decode
from kda_core.config import PRESETS
from serve.memory.replay_state_write import ReplayStateWrite

CFG = PRESETS["demo-tiny"]                     # 3 KDA layers, H = 2, K = 16, V = 12
H, K, V = CFG.num_heads, CFG.head_k_dim, CFG.head_v_dim


def oracle_replay(state: torch.Tensor, records: list) -> torch.Tensor:
    """One request's state ``[H, K, V]`` after its records, one at a time in ``_step``'s op order."""
    S = state.unsqueeze(0)
    for k, u, g in records:
        S = S * decode.decay(CFG, g.unsqueeze(0)).unsqueeze(-1)            # exp(g) as the decode step computes it
        S = S + k.unsqueeze(0).unsqueeze(-1) * u.unsqueeze(0).unsqueeze(-2)
    return S[0]


@settings(max_examples=25, deadline=None)
@given(ring_size=st.integers(1, 6), seed=st.integers(0, 2**16), num_ops=st.integers(1, 30))
def test_replay_state_write_against_oracle(ring_size, seed, num_ops):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rings = ReplayStateWrite(CFG, ring_size)
    checkpoint, records, next_rid = {}, {}, 0          # the oracle: rid -> {layer: [H, K, V]}, rid -> [{layer: rec}]
    for _ in range(num_ops):
        op = rng.random()
        if op < 0.25 or not checkpoint:                # a new request (its pages hold a fresh state)
            checkpoint[next_rid] = {i: torch.randn(H, K, V, generator=gen) for i in CFG.kda_layers}
            records[next_rid] = []
            next_rid += 1
        elif op < 0.4:                                 # abort / finish / preempt: the ring goes
            rid = rng.choice(sorted(checkpoint))
            rings.release(rid)
            del checkpoint[rid], records[rid]
        else:                                          # a decode step over a random subset, random row order
            rids = rng.sample(sorted(checkpoint), rng.randint(1, len(checkpoint)))
            states = {i: torch.stack([checkpoint[r][i] for r in rids]) for i in CFG.kda_layers}
            rings.read(rids, states)
            for j, r in enumerate(rids):
                for i in CFG.kda_layers:
                    want = oracle_replay(checkpoint[r][i], [rec[i] for rec in records[r]])
                    assert torch.equal(states[i][j], want), f"request {r} layer {i}: read != oracle"
            new = {r: {i: (torch.randn(H, K, generator=gen), torch.randn(H, V, generator=gen),
                           -torch.rand(H, K, generator=gen)) for i in CFG.kda_layers} for r in rids}
            mat = [rings.must_materialise(r) or rng.random() < 0.1 for r in rids]
            batch = {i: tuple(torch.stack([new[r][i][f] for r in rids]) for f in range(3)) for i in CFG.kda_layers}
            rings.commit(rids, batch, mat, [False] * len(rids))
            for r, m in zip(rids, mat):
                if m:                                  # the step's state goes to the pages; the ring empties
                    checkpoint[r] = {i: oracle_replay(checkpoint[r][i], [rec[i] for rec in records[r]] + [new[r][i]])
                                     for i in CFG.kda_layers}
                    records[r] = []
                else:
                    records[r].append(new[r])
        rings.check_integrity(checkpoint)
        assert all(rings.records(r) == len(records[r]) < ring_size for r in checkpoint)
