"""``lab.state_dtype``: the engine's 16-bit stored states on the trained model (page 17 "In the engine")."""
from __future__ import annotations

import pandas as pd
import pytest
import torch

from lab.models import demo_model
from lab.state_dtype import divergence_text, engine_agreement, heldout_prompts, serve_greedy, shipped_run, slot_table
from serve.config import ServeConfig


def test_engine_agreement_compares_each_dtype_with_the_fp32_engine():
    """Two held-out prompts, 6 tokens: one row per (prompt, dtype); the 16-bit logits drift from fp32's
    (the states are really rounded) but little; the summary's agreement is the fraction reaching each length."""
    run = engine_agreement(2, 6)
    per = run.per_prompt
    assert len(per) == 4 and set(per.state_dtype) == {"bf16", "fp16"}
    assert per.prompt_tokens.between(256, 1200).all() and per.first_divergence.between(0, 6).all()
    assert ((per.max_logit_diff > 0) & (per.max_logit_diff < 1)).all()
    assert per[per.state_dtype == "bf16"].max_logit_diff.max() > per[per.state_dtype == "fp16"].max_logit_diff.max()
    assert list(run.summary.length.unique()) == [1, 6]
    for _, row in run.summary.iterrows():
        g = per[per.state_dtype == row.state_dtype]
        assert row.agreement == (g.first_divergence >= row.length).mean()


def test_slot_table_uses_the_stored_bytes_on_one_pool():
    slots = slot_table(max_model_len=256, max_num_seqs=4)
    for _, g in slots.groupby("model"):
        g = g.set_index("state_dtype")
        assert g.num_pages.nunique() == 1                               # the same pool for every dtype
        assert (g.requests == g.num_pages // (g.state_pages + 16)).all()
        assert g.state_bytes["bf16"] == g.state_bytes["fp16"] < g.state_bytes["fp32"]
    demo = slots[slots.model == "demo"].set_index("state_dtype")
    assert demo.state_bytes["bf16"] == ServeConfig(state_dtype=torch.bfloat16).layout(
        demo_model().cfg).state_bytes
    kimi = slots[slots.model == "kimi-linear-48b-a3b"].set_index("state_dtype")
    assert 1.85 <= kimi.state_slots_vs_fp32["bf16"] <= 2.0


def test_bad_inputs_raise_value_error_naming_them():
    with pytest.raises(ValueError, match="num_prompts"):
        heldout_prompts(0)
    with pytest.raises(ValueError, match="num_prompts must be at most"):
        heldout_prompts(10_000)
    with pytest.raises(ValueError, match="state_dtypes"):
        engine_agreement(1, 2, state_dtypes=("fp32",))
    with pytest.raises(ValueError, match="state_dtype"):
        serve_greedy([[1, 2, 3]], 2, "fp8")


def test_shipped_run_loads_when_present(tmp_path):
    assert shipped_run(tmp_path / "none.json") is None
    run = shipped_run()
    if run is not None:
        assert {"bf16", "fp16"} <= set(run.summary.state_dtype) and run.meta["conditions"]["torch_threads"] == 1


def test_divergence_text_applies_to_each_rows_length():
    """A first divergence at token 33 is not one within 1 or 16 generated tokens, and a median at the run's cap
    (256: no divergence in most prompts) is not a token count: both read "none within n" there."""
    summary = pd.DataFrame(dict(state_dtype="bf16", length=[1, 16, 64, 256], agreement=[1.0, 1.0, 0.98, 0.94],
                                median_first_divergence=[256.0] * 4, min_first_divergence=[33] * 4))
    text = divergence_text(summary)
    assert list(text.min_first_divergence) == ["none within 1", "none within 16", "33", "33"]
    assert list(text.median_first_divergence) == ["none within 1", "none within 16", "none within 64",
                                                  "none within 256"]
    assert summary.min_first_divergence.tolist() == [33] * 4               # the input is left as it was
