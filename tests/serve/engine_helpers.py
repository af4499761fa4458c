"""Shared set-up for the tests of speculative decoding inside the engine: oracle speculation, an engine
with speculation + prefix cache, and the check that every stored checkpoint is the model's state after
exactly its ``written_at`` tokens."""
from __future__ import annotations

import torch

from serve.config import ServeConfig
from serve.engine import EngineArgs, ServeEngine, build_engine
from serve.memory.kinds import POISON_BYTE
from serve.memory.pages import read_state
from serve.prefix.index import block_keys
from serve.spec_decode.draft import NoisyOracleProposer
from serve.spec_decode.verify import Speculation
from tests.serve.prefix.helpers import tiny_model
from tests.serve.spec_decode.helpers import STRATEGY_NAMES as STRATEGIES  # test id -> strategy name

# A checkpoint comes from chunked prefill states, verify + rollback commits and decode steps; the
# reference is one chunked prefill of the same tokens. fp32 paths differ by ~1e-6 here, while the
# states after n - 1, n and n + 1 tokens differ by ~1: "equal" within this, "exactly n" in effect.
STATE_ATOL = 1e-5


def oracle_speculation(references: dict, strategy: str, corrupt_prob: float, num_draft_tokens: int,
                       seed: int = 1) -> Speculation:
    """Noisy-oracle drafts: ``references`` maps a prompt (tuple) to its greedy continuation; each draft
    token is corrupted with probability ``corrupt_prob`` (0: every draft accepted, 1: none)."""
    return Speculation.named(lambda p: NoisyOracleProposer(p, list(references[tuple(p)]), corrupt_prob, seed),
                             STRATEGIES[strategy], num_draft_tokens, capacity=24)


def spec_engine(speculation: Speculation, block_size: int = 16, interval: int | None = None,
                num_pages: int = 64, prefix_cache: bool = True) -> ServeEngine:
    """An engine with ``speculation`` and (unless ``prefix_cache`` is False) a prefix cache (one group,
    checkpoint every ``interval`` tokens, default one block) on a poisoned pool (a never-written page
    reads as NaN)."""
    config = ServeConfig(block_size, interval or block_size, page_policy="unified")
    return build_engine(EngineArgs(tiny_model(), num_pages, config, prefix_cache=prefix_cache, poison=True,
                                   speculation=speculation))


def kda_state_after(seq, n: int) -> dict:
    """The model's KDA caches (by layer) after exactly the first ``n`` tokens of ``seq`` (one prefill)."""
    model = tiny_model()
    _, cache = model.prefill(torch.tensor([list(seq[:n])]))
    return {i: cache.layers[i] for i in model.cfg.kda_layers}


def state_error(stored: dict, ref: dict) -> float:
    """max |stored - ref| over every KDA layer's recurrent state and conv window."""
    return max(max(float((stored[i].recurrent - ref[i].recurrent).abs().max()),
                   float((stored[i].conv - ref[i].conv).abs().max())) for i in ref)


def check_checkpoints(engine: ServeEngine, sequences, checked: set) -> int:
    """Assert every complete stored checkpoint not in ``checked`` holds the model's state after exactly
    its ``written_at`` tokens of the sequence its block key names (found among ``sequences``, token
    lists). Adds ``(key, pages)`` of what it checked to ``checked`` (a checkpoint evicted and published
    again is checked again); returns how many it checked."""
    cache, N = engine.cache, engine.layout.block_size
    prefix_of = {}
    for seq in sequences:
        for i, key in enumerate(block_keys(seq, N)):
            prefix_of[key] = seq[: (i + 1) * N]
    done = 0
    for key, node in cache.index.nodes.items():
        entry = (key, tuple(c.payload for _, c in sorted(node.ckpts.items())))
        if len(node.ckpts) < cache.num_groups or entry in checked:
            continue
        written = {c.written_at for c in node.ckpts.values()}
        assert written == {node.depth * N}, f"checkpoint at {node.depth * N} written at {sorted(written)}"
        assert key in prefix_of, f"checkpoint at {node.depth * N} belongs to no known sequence"
        stored = read_state(engine.layout, engine.pool, [node.ckpts[g].payload for g in range(cache.num_groups)])
        err = state_error(stored, kda_state_after(prefix_of[key], node.depth * N))
        assert err <= STATE_ATOL, f"checkpoint at {node.depth * N}: max |state - model state| = {err}"
        checked.add(entry)
        done += 1
    return done


def poison_state(engine: ServeEngine, rid: int) -> None:
    """Fill a running request's state pages (recurrent + conv) with 0xFF bytes: NaN in fp32."""
    pages = [p for grp in engine.requests[rid].state_pages for p in grp]
    engine.pool.arena.index_fill_(0, torch.tensor(pages), POISON_BYTE)


def step_until(engine: ServeEngine, rid: int, status) -> None:
    """Step (checking integrity after each step) until request ``rid`` reaches ``status``."""
    while engine.requests[rid].status is not status:
        assert engine.step()
        engine.check_integrity()
