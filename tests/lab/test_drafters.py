"""lab.drafters: per-position acceptance accounting (unconditional and conditional) on a hand-made case, the
repetition rate, held-out prompts, and a small end-to-end measurement whose outputs equal plain decoding."""
import math
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from lab.drafters import (
    BENCH_SIZE,
    DRAFTER_LABELS,
    STEP_COLUMNS,
    acceptance_by_position,
    bench_drafters,
    heldout_prompts,
    measure_drafters,
    repetition_rate,
)
from tests.serve.spec_decode.helpers import perturbed_copy, tiny_model


def _steps(pairs, budget=4):
    return pd.DataFrame([("d", "code", 0, j, budget if b is None else b, n, a, a + 1)
                         for j, (n, a, b) in enumerate(pairs)], columns=STEP_COLUMNS)


def test_acceptance_by_position_is_unconditional_with_a_conditional_column():
    # (drafted, accepted, budget): a step without drafts and a short-budget step are not drafts at n = 4;
    # a 2-token draft (a short prompt-lookup match) counts as positions 3 and 4 not accepted
    steps = _steps([(4, 4, None), (4, 2, None), (4, 0, None), (0, 0, None), (2, 2, None), (4, 1, None),
                    (2, 2, 2)])
    pos = acceptance_by_position(steps, 4)
    assert pos.drafts.tolist() == [5] * 4
    assert pos.accepted.tolist() == [4, 3, 1, 1]
    assert pos.rate.tolist() == pytest.approx([0.8, 0.6, 0.2, 0.2])                # accepted_i / drafts
    assert pos.conditional_rate.tolist() == pytest.approx([4 / 5, 3 / 4, 1 / 3, 1.0])   # accepted_i / accepted_i-1


def test_acceptance_by_position_empty_group_and_validation():
    pos = acceptance_by_position(_steps([(0, 0, None)]), 2)
    assert pos.drafts.tolist() == [0, 0] and all(math.isnan(r) for r in pos.rate)
    with pytest.raises(ValueError, match="num_draft"):
        acceptance_by_position(_steps([(1, 1, None)]), 0)
    with pytest.raises(ValueError, match="missing columns"):
        acceptance_by_position(pd.DataFrame({"drafter": ["d"]}), 2)


def test_repetition_rate():
    assert repetition_rate([1, 2, 3], [1, 2, 3, 1, 2, 3], n=3) == 1.0             # a loop: every 3-gram seen
    assert repetition_rate([9], [1, 2, 3, 4, 5], n=2) == 0.0
    assert repetition_rate([1, 2], [7, 1, 2, 8], n=2) == pytest.approx(1 / 3)       # (7,1) (1,2)* (2,8)
    assert math.isnan(repetition_rate([1], [2], n=2))
    with pytest.raises(ValueError, match="n must"):
        repetition_rate([1], [2], n=0)


def test_heldout_prompts_come_from_heldout_files_and_end_a_line():
    code = heldout_prompts("code", 2, 96)
    assert len(code) == 2 and all(0 < len(p) <= 96 for p in code) and code[0] != code[1]
    assert all(p[-1] == 10 for p in code)                                          # "\n": the continuation starts a line
    with pytest.raises(ValueError, match="kind"):
        heldout_prompts("poetry", 1, 96)
    with pytest.raises(ValueError, match="num_prompts"):
        heldout_prompts("prose", 10_000, 96)


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    return tiny_model()


def test_measure_drafters_end_to_end(target):
    run = measure_drafters(target, target, ("n-gram", "draft model", "noisy oracle"), ("code",), num_prompts=1,
                           prompt_bytes=64, new_tokens=14, num_draft=3, corrupt_prob=0.0)
    assert run.summary.matches_plain.all()
    pos = run.positions.set_index("drafter")
    # the target as its own draft model, and an uncorrupted oracle, are accepted at every position
    assert pos.loc["draft model"].rate.tolist() == [1.0] * 3
    assert pos.loc["noisy oracle"].rate.tolist() == [1.0] * 3
    s = run.summary.set_index("drafter")
    assert (s.bytes_per_verify - s.mean_accepted).tolist() == pytest.approx([1.0] * 3)
    assert s.loc["draft model", "bytes_per_verify"] > s.loc["n-gram", "bytes_per_verify"] - 1e-9
    assert run.conditions["num_draft"] == 3 and set(run.steps.kind) == {"code"}


def test_measure_drafters_partial_draft_rates_fall_with_position(target):
    run = measure_drafters(target, perturbed_copy(target, 0.5), ("draft model",), ("prose",), num_prompts=1,
                           prompt_bytes=64, new_tokens=20, num_draft=4)
    rates = run.positions.rate.tolist()
    assert run.summary.matches_plain.all() and rates == sorted(rates, reverse=True) and rates[-1] < 1.0
    with pytest.raises(ValueError, match="drafter"):
        measure_drafters(target, None, ("medusa",))
    with pytest.raises(ValueError, match="draft must be"):
        measure_drafters(target, None, ("draft model",), ("code",), num_prompts=1, prompt_bytes=64, new_tokens=4)


def test_readme_drafter_table_and_claim_are_the_shipped_bench():
    """Regression (the README said "the draft model beats prompt lookup on both kinds" beside a table it did not
    check): every row of the drafter table in ``bench/README.md``, and the per-kind comparison in the sentence after
    it, equal ``bench/results/drafters.json`` (rounded as printed)."""
    readme = (Path(__file__).resolve().parents[2] / "bench" / "README.md").read_text()
    shipped = bench_drafters()
    pos, summ = shipped.positions.set_index(["drafter", "kind"]), shipped.summary.set_index(["drafter", "kind"])
    rows = re.findall(r"^\| ([^|]+) \| (code|prose) \| ([^|]+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| (\d+)% \|$", readme, re.M)
    assert len(rows) == 6, rows
    names = {v: k for k, v in DRAFTER_LABELS.items()}
    for name, kind, rates, drafts, mean_acc, per_verify, rep in rows:
        key = (names[name], kind)
        assert [f"{r:.0%}" for r in pos.loc[key].rate] == rates.split(" → "), key
        assert int(drafts) == pos.loc[key].drafts.iloc[0], key
        s = summ.loc[key]
        assert (mean_acc, per_verify, int(rep)) == (f"{s.mean_accepted:.2f}", f"{s.bytes_per_verify:.2f}",
                                                     round(100 * s.repetition_rate)), key
    prose = " ".join(readme.split())                                      # lines joined: a sentence may wrap
    claim = re.search(r"accepts more drafts per verify than prompt lookup on both kinds \(code ([\d.]+) vs ([\d.]+), "
                      r"prose ([\d.]+) vs ([\d.]+)\)", prose)
    acc = summ.mean_accepted
    for i, kind in enumerate(("code", "prose")):
        d, ng = acc[("draft model", kind)], acc[("n-gram", kind)]
        assert d > ng and claim.group(1 + 2 * i, 2 + 2 * i) == (f"{d:.2f}", f"{ng:.2f}"), kind
    c = shipped.conditions
    assert (c["prompts_per_kind"], c["prompt_bytes_max"], c["new_bytes_per_prompt"]) == tuple(BENCH_SIZE)
    assert (f"{c['prompts_per_kind']} held-out prompts per kind (≤ {c['prompt_bytes_max']} bytes" in prose
            and f"{c['new_bytes_per_prompt']} bytes generated after each, n = {c['num_draft']} drafts" in prose)
