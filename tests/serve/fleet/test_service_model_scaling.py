"""``ServiceModel.scaled(prefill_x, decode_x)``, term by term: every prefill time term is ``prefill_x`` times
shorter (the per-token rate, the fixed step cost, per row, per attention pair, off the chunk grid), every
decode time term ``decode_x`` times shorter (base, per row, per context token), the server's own per-output-row
work unchanged, the limits kept unless given. Each term is pinned by its own contribution to a step's time (the
model with the term minus the model without it), so a term that ``scaled`` forgets fails on its own; and every
field of the dataclass is classified here, so a new term cannot be added without saying how it scales."""
from __future__ import annotations

from dataclasses import fields, replace

import pytest

from serve.fleet.sim.service_model import ServiceModel

PX, DX = 2.5, 4.0
PREFILL_TERMS = ("prefill_overhead_ms", "prefill_per_row_ms", "prefill_per_token_pair_ms",
                 "prefill_off_grid_per_token_ms", "prefill_per_checkpoint_ms")
DECODE_TERMS = ("decode_step_base_ms", "decode_step_per_seq_ms", "decode_per_context_token_ms")
SERVER_TERMS = ("per_output_row_ms",)          # the server's own CPU work per emitted token: not the replica's
RATES = ("prefill_tokens_per_s",)
KEPT = ("max_batch_requests", "kv_capacity_tokens", "max_prefill_tokens_per_step", "mixed_steps", "decode_buckets",
        "prefill_grid_tokens", "checkpoint_interval_tokens")

BASE = ServiceModel(prefill_tokens_per_s=800.0, decode_step_base_ms=12.0, decode_step_per_seq_ms=0.7,
                    prefill_overhead_ms=9.0, max_batch_requests=48, kv_capacity_tokens=20_000,
                    max_prefill_tokens_per_step=4096, source="hand", mixed_steps=True,
                    decode_per_context_token_ms=0.003, decode_buckets=(1, 2, 4, 8), prefill_per_token_pair_ms=2e-5,
                    per_output_row_ms=0.4, prefill_per_row_ms=1.5, prefill_off_grid_per_token_ms=0.02,
                    prefill_grid_tokens=64, prefill_per_checkpoint_ms=0.8)
PARTS = [(100, 0), (37, 48), (300, 128)]        # (new, cached) prompts; 48 is off the 64-token grid
DECODE = (5, 700)                               # 5 rows (padded to 8) of mean context 700


def step_times(svc: ServiceModel) -> dict:
    return {"prefill": svc.prefill_batch_ms(PARTS), "decode": svc.decode_step_ms(*DECODE),
            "mixed": svc.mixed_step_ms(PARTS, *DECODE)}


def test_every_field_is_classified():
    named = PREFILL_TERMS + DECODE_TERMS + SERVER_TERMS + RATES + KEPT + ("source",)
    assert sorted(f.name for f in fields(ServiceModel)) == sorted(named), \
        "a ServiceModel field is not classified: say here (and in scaled) how it scales"


@pytest.mark.parametrize("term", PREFILL_TERMS + DECODE_TERMS + SERVER_TERMS)
def test_each_time_term_is_scaled_by_its_phase(term):
    """The term's share of each step's time (with it minus without it) shrinks by prefill_x for a prefill term,
    decode_x for a decode term, and stays for the server's term; the base decode term is compared alone (it
    cannot be 0)."""
    without = replace(BASE, **{term: 1e-3 if term == "decode_step_base_ms" else 0.0})
    factor = PX if term in PREFILL_TERMS else DX if term in DECODE_TERMS else 1.0
    share = {k: step_times(BASE)[k] - step_times(without)[k] for k in ("prefill", "decode", "mixed")}
    fast, fast_without = BASE.scaled(PX, DX), without.scaled(PX, DX)
    fast_share = {k: step_times(fast)[k] - step_times(fast_without)[k] for k in share}
    assert any(share.values()), f"{term} changes no step time: the test does not exercise it"
    for k in share:
        assert fast_share[k] == pytest.approx(share[k] / factor, rel=1e-9, abs=1e-12), \
            f"{term}: its share of the {k} step went {share[k]:.6g} -> {fast_share[k]:.6g} ms, not / {factor}"
    assert getattr(fast, term) == pytest.approx(getattr(BASE, term) / factor)


def test_prefill_rate_and_whole_steps():
    """The per-token rate is prefill_x times higher; with the server's term at 0 a whole prefill step is prefill_x
    times shorter and a whole decode step decode_x times shorter."""
    fast = BASE.scaled(PX, DX)
    assert fast.prefill_tokens_per_s == pytest.approx(BASE.prefill_tokens_per_s * PX)
    assert fast.prefill_ms(1000) == pytest.approx(BASE.prefill_ms(1000) / PX)
    no_server = replace(BASE, per_output_row_ms=0.0)
    times, fast_times = step_times(no_server), step_times(no_server.scaled(PX, DX))
    assert fast_times["prefill"] == pytest.approx(times["prefill"] / PX)
    assert fast_times["decode"] == pytest.approx(times["decode"] / DX)
    assert fast_times["mixed"] == pytest.approx(times["prefill"] / PX + (times["decode"] - BASE.decode_step_base_ms) / DX)


def test_limits_kept_unless_given():
    fast = BASE.scaled(PX, DX)
    for name in KEPT:
        assert getattr(fast, name) == getattr(BASE, name), name
    given = BASE.scaled(PX, DX, kv_capacity_tokens=99_000, max_batch_requests=7)
    assert (given.kv_capacity_tokens, given.max_batch_requests) == (99_000, 7)
    assert "assumed speed-up" in fast.source and fast.source.startswith("hand")
    with pytest.raises(ValueError, match="speed-up factors"):
        BASE.scaled(0, 1)
