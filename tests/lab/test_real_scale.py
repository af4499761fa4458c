"""lab.real_scale: page 15's roofline view against the published points and the policy view's bytes, hits and TTFT."""
from __future__ import annotations

import pytest
import torch

from lab.fleet import page_trace
from lab.real_scale import (
    BUDGET_FRACTIONS,
    DEFAULT_POLICIES,
    RealReplica,
    fitted_prefill_s,
    free_bytes,
    policy_title,
    policy_view,
    roofline_view,
    weight_bytes,
)
from serve.scale.capacity import largest_batch_decode
from serve.scale.hardware import hardware
from serve.scale.model_shape import preset
from serve.scale.policies import CACHE_POLICIES, make_policy, replay
from serve.scale.published import CONTEXTS, PREFILL_FIG7A, TPOT_FIG7B
from serve.scale.roofline import checkpoint_restore_time, prefill_time
from serve.scale.validation import RATIO_TOLERANCE, PrefillFit, decode_ratios, fit_prefill, prefill_ratios

torch.set_num_threads(1)
KIMI = "kimi-linear-48b-a3b"
K = 1024


def test_roofline_view_matches_validation_at_the_pinned_setup():
    """At H100 x TP8 the view's prefill ratios are validation's (same fit), within +-25 % of Fig. 7a at 512K
    and 1M with the MLA points held out; the all-MLA curve is slower from 64K on; the published frame is the report's data."""
    view = roofline_view(RealReplica(KIMI, "H100", 8))
    ours = view.ratios[view.ratios.quantity == "prefill (Fig. 7a)"].set_index("context_tokens")
    for row in prefill_ratios():
        assert ours.loc[row.context, "model"] == pytest.approx(row.model, rel=1e-12)
        assert ours.loc[row.context, "published"] == row.published
    for c in (512 * K, 1024 * K):
        assert abs(ours.loc[c, "rel_error"]) <= RATIO_TOLERANCE
    held = view.validated[(view.validated.quantity == "prefill (Fig. 7a)") & (view.validated.context_tokens >= 512 * K)]
    assert (held.role == "held out").all() and (held.rel_error.abs() <= RATIO_TOLERANCE).all()
    wide = view.curves.pivot(index="context_tokens", columns="model")
    assert (wide.loc[64 * K:, ("prefill_s", "all MLA")] > wide.loc[64 * K:, ("prefill_s", "Kimi Linear")]).all()
    assert (wide.loc[64 * K:, ("tpot_ms", "all MLA")] > wide.loc[64 * K:, ("tpot_ms", "Kimi Linear")]).all()
    pub = view.published.set_index(["model", "context_tokens"])
    assert pub.loc[("all MLA", 1024 * K), "prefill_s"] == PREFILL_FIG7A.mla[CONTEXTS.index(1024 * K)]
    assert pub.loc[("Kimi Linear", 4 * K), "tpot_ms"] == TPOT_FIG7B.kimi_linear[0]
    assert view.fit == fit_prefill() and view.fit_setup == view.setup == "H100 x TP8" and not view.predicted_only


def test_validation_is_at_the_setup_the_user_chose():
    """At H200 x TP8 (the page's default) every validated row is that setup's, TPOT included: its error there is
    +60 % or more from 64K on and the view reports it (the old view switched TPOT to H100 x TP1 silently)."""
    view = roofline_view(RealReplica(KIMI, "H200", 8))
    assert set(view.validated.setup) == {"H200 x TP8"} and view.setup == "H200 x TP8"
    tpot = view.validated[view.validated.quantity == "TPOT, batch 1 (Fig. 7b)"].set_index("context_tokens")
    for row in decode_ratios(hw=hardware("H200"), tp=8):
        assert tpot.loc[row.context, "model"] == pytest.approx(row.model, rel=1e-12)
        assert (tpot.loc[row.context, "role"] == "predicted") and (row.context < 64 * K or row.rel_error > 0.6)
    errors = view.errors.set_index("group").max_abs_error
    assert errors["TPOT, batch 1 (Fig. 7b) ratio"] == pytest.approx(max(abs(r.rel_error) for r in
                                                                        decode_ratios(hw=hardware("H200"), tp=8)))
    points = view.prefill_points
    assert errors["prefill points held out (all MLA)"] == pytest.approx(
        points[points.role == "held out"].rel_error.abs().max())
    assert set(points[points.role == "held out"].curve) == {"all MLA"}


def test_largest_batch_beside_fig1b():
    """The view's batch frame is serve.scale.capacity's; the Fig. 1b rows compare MLA / Kimi Linear time per token
    at the largest batches with the report's 6.3x at 1M, and come out near 27 / 7 instead."""
    view = roofline_view(RealReplica(KIMI, "H200", 8))
    row = view.batch.set_index(["model", "context_tokens"]).loc[("Kimi Linear", 1024 * K)]
    d = largest_batch_decode(preset(KIMI), hardware("H200"), 8, 1024 * K)
    assert row.batch == d.batch and row.tpot_ms == pytest.approx(1e3 * d.tpot_s)
    fig1b = view.validated[view.validated.quantity == "time per token, largest batch (Fig. 1b)"]
    at_1m = fig1b.set_index("context_tokens").loc[1024 * K]
    assert at_1m.published == pytest.approx(6.25, abs=0.01) and 3.0 < at_1m.model < 27 / 7 * 1.05


@pytest.mark.parametrize("gpu, tp", [("A100", 2), ("H100", 2), ("H200", 1)])
def test_throughput_compares_where_both_fit_when_mla_cannot_hold_1m(gpu, tp):
    """Where the all-MLA model cannot hold one 1M-token sequence, the Fig. 1b comparison says so (``unfit``) and is
    taken at the largest report context both hold, with a finite ratio: never a NaN ratio at 1M."""
    tc = roofline_view(RealReplica(KIMI, gpu, tp)).throughput
    kl, hw = preset(KIMI), hardware(gpu)
    assert largest_batch_decode(kl.all_mla(), hw, tp, 1024 * K).batch == 0
    assert tc.unfit == ("all MLA",) and tc.largest_context == 1024 * K
    assert tc.context_tokens == 512 * K and largest_batch_decode(kl.all_mla(), hw, tp, 512 * K).batch > 0
    a, m = (largest_batch_decode(s, hw, tp, 512 * K).time_per_token_s for s in (kl, kl.all_mla()))
    assert tc.model == pytest.approx(m / a) and 1 < tc.model < 27 / 7 * 1.05
    full = roofline_view(RealReplica(KIMI, "H200", 8)).throughput
    assert full.unfit == () and full.context_tokens == 1024 * K and full.published == pytest.approx(6.25, abs=0.01)


@pytest.fixture(scope="module")
def report_setup_view():
    return roofline_view(RealReplica(KIMI, "H100", 8))


@pytest.mark.parametrize("gpu, tp", [("A100", 2), ("H200", 8), ("B200", 8)])
def test_one_prefill_fit_whatever_the_setup(gpu, tp, report_setup_view):
    """The view's prefill fit is the service times' (fit_prefill: the report's setup, H100 x TP8), never a refit on
    the chosen GPU (that gave alpha 0.07 on A100 x TP2, 0.93 on H200 x TP8, 2.13 on B200 x TP8): the fitted-vs-
    held-out check is the same frame on every setup, and the chosen setup's curves are that fit carried, labelled
    predicted-only, with every prefill ratio there a prediction."""
    view, fit = roofline_view(RealReplica(KIMI, gpu, tp)), fit_prefill()
    assert view.fit == fit and view.fit_setup == "H100 x TP8" and view.predicted_only
    assert view.prefill_points.equals(report_setup_view.prefill_points)
    assert set(view.prefill_points.setup) == {"H100 x TP8"}
    shape, hw = preset(KIMI), hardware(gpu)
    kl = view.curves[view.curves.model == "Kimi Linear"]
    for c, y in zip(kl.context_tokens, kl.prefill_s):
        assert y == pytest.approx(fitted_prefill_s(shape, hw, tp, fit, int(c)), rel=1e-12)
    assert f"On {gpu} x TP{tp} the fitted curves are predictions" in view.fit_note and "nothing refitted" in view.fit_note
    prefill = view.validated[view.validated.quantity == "prefill (Fig. 7a)"]
    assert (prefill.role == "predicted").all() and set(prefill.setup) == {f"{gpu} x TP{tp}"}
    assert view.fit_caveat == report_setup_view.fit_caveat


def test_fit_below_the_physical_roofline_is_flagged(report_setup_view):
    """A fitted scale below 1 makes the fitted prefill faster than the physical roofline (a lower bound on time):
    the view says so, naming the scale and the setup it was fitted on; a fit with both scales >= 1 has no caveat."""
    view = report_setup_view
    assert view.fit.alpha < 1 and "α (attention) = 0.94 < 1 on H100 x TP8" in view.fit_caveat
    assert "faster than the physical roofline" in view.fit_caveat and "lower bound" in view.fit_caveat
    held = view.validated[view.validated.quantity == "prefill (Fig. 7a)"]
    assert (held.role == "held out").all()
    from lab.real_scale import _fit_caveat
    assert _fit_caveat(PrefillFit(1.0, 2.0), "x") == ""
    assert "β (every other kind) = 0.50" in _fit_caveat(PrefillFit(1.5, 0.5), "x")


def test_k3_view_says_its_fit_is_borrowed():
    """K3 has no published points: the view says its fitted curve reuses Kimi-Linear-48B-A3B's alpha, beta."""
    note = roofline_view(RealReplica("kimi-k3", "H200", 16)).fit_note
    assert "Kimi-Linear-48B-A3B" in note and "Kimi K3" in note and "unchecked" in note
    assert "Kimi K3" not in roofline_view(RealReplica(KIMI, "H200", 8)).fit_note


@pytest.mark.parametrize("args, kwargs, match", [
    ((KIMI, "H200", 8), {"contexts": []}, "contexts"),
    ((KIMI, "H200", 8), {"contexts": [True]}, "contexts"),
    ((KIMI, "H200", 8), {"contexts": [4096.0]}, "contexts"),
    ((KIMI, "H200", 8), {"contexts": 4096}, "contexts"),
    (("kimi-k3", "H100", 1), {}, "do not fit"),
    ((KIMI, "H200", True), {}, "tp"),
], ids=["empty", "true", "float", "int", "k3-h100x1", "tp-true"])
def test_roofline_view_bad_input(args, kwargs, match):
    """A bad contexts list is the view's error; a replica that cannot exist is refused when it is built."""
    with pytest.raises(ValueError, match=match):
        roofline_view(RealReplica(*args), **kwargs)


def test_fitted_prefill_is_the_roofline_at_unit_scales():
    shape, hw = preset(KIMI), hardware("H200")
    for new, cached in ((1, 0), (4096, 0), (513, 8192)):
        assert fitted_prefill_s(shape, hw, 8, PrefillFit(1.0, 1.0), new, cached) == pytest.approx(
            prefill_time(shape, hw, 8, new, cached).total_s, rel=1e-12)
    attn = prefill_time(shape, hw, 8, 4096).kind("mla").time_s
    assert fitted_prefill_s(shape, hw, 8, PrefillFit(2.0, 1.0), 4096) == pytest.approx(
        prefill_time(shape, hw, 8, 4096).total_s + attn, rel=1e-12)


def test_weights_and_free_bytes():
    """Kimi-Linear-48B-A3B in bf16 is ~98 GB (49.1 B parameters); K3's ~1.56 TB does not fit 8 x H200."""
    assert weight_bytes(preset(KIMI)) == pytest.approx(2 * preset(KIMI).total_params)
    assert free_bytes(KIMI, hardware("H200"), 8) == pytest.approx(8 * 141e9 - 2 * preset(KIMI).total_params)
    assert free_bytes("kimi-k3", hardware("H200"), 8) < 0 < free_bytes("kimi-k3", hardware("H200"), 16)


@pytest.fixture(scope="module")
def small_view():
    calls = []
    view = policy_view(RealReplica(KIMI, "H200", 8), 300, budgets_gb=[5.0, 50.0], intervals=(1024, 4096),
                       progress=lambda done, total: calls.append((done, total)))
    return view, calls


def test_policy_view_bounds(small_view):
    """Every policy: hit <= block ideal, each byte kind <= the budget, TTFT between the all-hit floor and the
    cold mean, one progress call per replay ending at total."""
    view, calls = small_view
    b = view.budgets
    assert len(b) == 2 * len(DEFAULT_POLICIES) and len(view.intervals) == 2 * 2
    assert calls[-1] == (len(b) + len(view.intervals),) * 2 and [d for d, _ in calls] == list(range(1, len(calls) + 1))
    for frame in (b, view.intervals):
        assert (frame.token_hit_ratio <= view.ideal_hit_ratio + 1e-12).all()
        for kind in ("kv_gb", "state_gb", "running_gb"):
            assert (frame[kind] <= frame.budget_gb).all(), kind
        assert (frame.mean_ttft_s <= view.cold_ttft_s + 1e-12).all()
        assert ((frame.prefill_saved >= -1e-12) & (frame.prefill_saved < 1)).all()
    assert (b.token_hit_ratio > 0).any() and view.ideal_hit_ratio > 0


def test_bytes_by_kind_at_the_peak_stay_within_the_budget():
    """The page stacks kv_gb + state_gb + running_gb in one bar under the budget line: they are the bytes held
    when the total peaked, so the bar never passes the budget (each kind's own peak, reached at different
    times, did: ours 52.8 GB of 50 on this trace). Each kind's own peak is kept beside it."""
    view = policy_view(RealReplica(KIMI, "H200", 8), 300, policies=CACHE_POLICIES, budgets_gb=[1.0, 5.0, 50.0], intervals=(1024,))
    for frame in (view.budgets, view.intervals):
        held = frame.kv_gb + frame.state_gb + frame.running_gb
        assert (held <= frame.budget_gb * (1 + 1e-12)).all(), frame[["policy", "budget_gb", "kv_gb", "state_gb"]]
        assert (frame.peak_kv_gb >= frame.kv_gb).all() and (frame.peak_state_gb >= frame.state_gb).all()
    assert ((view.budgets.peak_kv_gb + view.budgets.peak_state_gb + view.budgets.running_gb)
            > view.budgets.budget_gb).any()                   # the per-kind peaks would have passed it


def test_vllm_all_is_an_opt_in_counterfactual():
    """vLLM serves Kimi models in align (KimiLinearForCausalLM does not declare SupportsMambaPrefixCaching):
    "vllm all" is out of the default sweep and titled as a counterfactual."""
    assert "vllm all" in CACHE_POLICIES and "vllm all" not in DEFAULT_POLICIES
    assert "counterfactual" in policy_title("vllm all")
    assert make_policy("vllm all", KIMI, 8).counterfactual and not make_policy("vllm align", KIMI, 8).counterfactual


def test_policy_view_takes_empty_prompts():
    """A Mooncake upload may hold input_length 0 (no hash ids): it hits nothing and its first output token
    still costs one prefill step (as the fleet simulator's replicas charge it)."""
    line = b'{"timestamp":0,"input_length":0,"output_length":10,"hash_ids":[]}\n'
    view = policy_view(RealReplica(KIMI, "H200", 8), 100, upload=line * 3, budgets_gb=[5.0], intervals=(1024,))
    one_token = fitted_prefill_s(preset(KIMI), hardware("H200"), 8, fit_prefill(), 1, 0)
    assert (view.budgets.token_hit_ratio == 0).all() and view.total_tokens == 0
    assert view.cold_ttft_s == pytest.approx(one_token, rel=1e-12) and one_token > 0


def test_policy_view_ttft_is_the_roofline_of_each_hit(small_view):
    """Recompute one row's mean TTFT from a fresh replay's per-request hits, straight from the roofline:
    prefill of L - hit after hit (fitted), plus a checkpoint restore on a hit."""
    view, _ = small_view
    requests = page_trace(None, 300).requests
    shape, hw = preset(KIMI), hardware("H200")
    fit = fit_prefill()          # the report's setup's factors, carried to H200 (as the policy view does)
    res = replay(requests, make_policy("ours", KIMI, 8), 50e9)
    ttft = [fitted_prefill_s(shape, hw, 8, fit, r.input_length - int(h), int(h))
            + (checkpoint_restore_time(shape, hw, 8) if h else 0.0)
            for r, h in zip(requests, res.request_hit_tokens)]
    row = view.budgets[(view.budgets.policy == "ours") & (view.budgets.budget_gb == 50.0)].iloc[0]
    assert res.hit_tokens > 0
    assert row.mean_ttft_s == pytest.approx(sum(ttft) / len(ttft), rel=1e-12)
    assert row.token_hit_ratio == res.token_hit_ratio


def test_default_budgets_are_fractions_of_the_free_hbm():
    view = policy_view(RealReplica(KIMI, "H200", 8), 100, policies=("vllm none",), intervals=())
    free = free_bytes(KIMI, hardware("H200"), 8) / 1e9
    assert view.budgets.budget_gb.tolist() == pytest.approx([free * f for f in BUDGET_FRACTIONS])
    assert (view.budgets.token_hit_ratio == 0).all()               # vLLM none: no prefix caching
    assert view.free_gb == pytest.approx(free)


def test_bad_input():
    with pytest.raises(ValueError, match="do not fit"):
        policy_view(RealReplica("kimi-k3", "H200", 8), 100)
    with pytest.raises(ValueError, match="policies"):
        policy_view(RealReplica(KIMI, "H200", 8), 100, policies=("lru",))
    with pytest.raises(ValueError, match="budgets_gb"):
        policy_view(RealReplica(KIMI, "H200", 8), 100, budgets_gb=[0.0])
    for bad in (["5"], [float("nan")], [float("inf")], [True]):
        with pytest.raises(ValueError, match="budgets_gb"):
            policy_view(RealReplica(KIMI, "H200", 8), 100, budgets_gb=bad)
    for bad in ((), [], "ours"):                      # was a KeyError (no rows), or one policy per letter
        with pytest.raises(ValueError, match="policies"):
            policy_view(RealReplica(KIMI, "H200", 8), 100, policies=bad, budgets_gb=[5.0])
    for bad in ([0], [-512], [1024.0], [True]):       # [0] replayed 2,048 under a row labelled 0
        with pytest.raises(ValueError, match="intervals"):
            policy_view(RealReplica(KIMI, "H200", 8), 100, budgets_gb=[5.0], intervals=bad)
    with pytest.raises(ValueError, match="tp"):
        roofline_view(RealReplica(KIMI, "H200", 3))
    with pytest.raises(ValueError, match="model"):
        roofline_view(RealReplica("gpt", "H200", 8))
    with pytest.raises(ValueError, match="gpu"):
        roofline_view(RealReplica(KIMI, "V100", 8))
    with pytest.raises(ValueError, match="policy"):
        make_policy("lru", KIMI, 8)


def test_choice_picks_the_lowest_mean_ttft_per_budget_and_interval():
    """Hand-made sweep: at 10 GB vllm all is fastest, at 20 GB ours; of ours' intervals 1024 is fastest."""
    import pandas as pd

    from lab.real_scale import choose
    budgets = pd.DataFrame({"policy": ["ours", "vllm all", "ours", "vllm all"], "budget_gb": [10.0, 10.0, 20.0, 20.0],
                            "mean_ttft_s": [0.5, 0.4, 0.2, 0.3], "token_hit_ratio": [0.1, 0.2, 0.4, 0.3]})
    intervals = pd.DataFrame({"policy": ["ours"] * 3, "budget_gb": [15.0] * 3, "interval_tokens": [512, 1024, 2048],
                              "mean_ttft_s": [0.3, 0.25, 0.28], "token_hit_ratio": [0.3, 0.35, 0.32]})
    got = choose(budgets, intervals)
    assert got.policy.tolist() == ["vllm all", "ours", "ours"]
    assert got.budget_gb.tolist() == [10.0, 20.0, 15.0]
    assert got.interval_tokens.iloc[2] == 1024 and got.interval_tokens.iloc[:2].isna().all()
    assert got.mean_ttft_s.tolist() == [0.4, 0.2, 0.25]


def test_policy_view_choice_is_consistent_with_its_sweep():
    view = policy_view(RealReplica("kimi-linear-48b-a3b", "H200", 8), 300, policies=("ours", "vllm align"),
                       intervals=(1024, 4096))
    by_budget = view.choice[view.choice.interval_tokens.isna()]
    for r in by_budget.itertuples():
        assert r.mean_ttft_s == view.budgets[view.budgets.budget_gb == r.budget_gb].mean_ttft_s.min()
    by_interval = view.choice[view.choice.interval_tokens.notna()]
    assert by_interval.policy.tolist() == ["ours"]
    assert by_interval.mean_ttft_s.iloc[0] == view.intervals[view.intervals.policy == "ours"].mean_ttft_s.min()


def test_choice_calls_a_tie_within_one_percent_and_flags_a_still_falling_interval():
    """108.1 ms against 108.2 ms is no winner: the other policy within 1 % is listed as tied (fastest first), one
    5 % slower is not. An interval that is best because it is the largest swept, with the curve still falling, is
    flagged; one with a minimum inside the sweep is not."""
    import pandas as pd

    from lab.real_scale import choose
    budgets = pd.DataFrame({"policy": ["ours", "vllm align", "sglang no_buffer"], "budget_gb": [129.0] * 3,
                            "mean_ttft_s": [0.1082, 0.1081, 0.1135], "token_hit_ratio": [0.2, 0.19, 0.1]})
    intervals = pd.DataFrame({"policy": ["ours"] * 3 + ["sglang extra_buffer"] * 3, "budget_gb": [129.0] * 6,
                              "interval_tokens": [2048, 4096, 8192] * 2,
                              "mean_ttft_s": [0.102, 0.101, 0.100, 0.107, 0.106, 0.108],
                              "token_hit_ratio": [0.2] * 6})
    got = choose(budgets, intervals)
    assert got.policy.iloc[0] == "vllm align" and got.tied.iloc[0] == (("ours", 0.1082),)
    assert got.still_falls.tolist() == [False, True, False]
    assert got.interval_tokens.iloc[1:].tolist() == [8192, 4096]
    apart = choose(budgets.assign(mean_ttft_s=[0.2, 0.1, 0.3]), intervals.iloc[:0])
    assert apart.tied.iloc[0] == () and len(apart) == 1
