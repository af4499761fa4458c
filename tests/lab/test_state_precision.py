"""lab.state_precision: fp32 storage is bitwise today's decode (tokens and logits), the other formats drift
measurably, acceptance counting, capacity at the real models' bytes, bad input."""
import math

import pytest
import torch

from kda_core.model import cache_equal
from lab.models import demo_model
from lab.state_capacity import capacity_table
from lab.state_precision import (
    _store_all,
    accepted_per_verify,
    field_claims,
    heldout_documents,
    precision_run,
)

DOC = "secrets.py"             # a short held-out code file
N, G = 12, 4                   # teacher-forced tokens, free-running tokens


@pytest.fixture(scope="module")
def run():
    return precision_run(DOC, N, G, draft_len=2)


def test_fp32_storage_is_bitwise_todays_decode(run):
    """Tokens and logits of the fp32-stored row equal a plain decode_step loop (no storage) bitwise."""
    model = demo_model("demo")
    tokens = torch.tensor(list(heldout_documents()[DOC][:N]))
    cache = model.empty_cache(1)
    for t in tokens:
        logits, cache = model.decode_step(t.reshape(1), cache)
    out = []
    for _ in range(G):
        tok = logits.argmax(-1)
        out.append(int(tok))
        logits, cache = model.decode_step(tok, cache)
    assert run.fp32_bitwise
    assert run.continuations["fp32"] == bytes(out).decode("utf-8", errors="replace")
    fp32 = run.curves[run.curves.format == "fp32"]
    assert (fp32.state_rel_err == 0).all() and (fp32.logit_max_abs == 0).all() and fp32.agree.all()
    # and the store itself: an fp32 round trip leaves every cache bit as it was
    before = model.decode_step(tokens[:1], model.empty_cache(1))[1]
    after = _store_all(before, model.kda_layers, ("fp32",), [None], [None])
    assert cache_equal(before, after)


def test_other_formats_drift(run):
    s = run.summary.set_index("format")
    assert s.loc["bf16", "final_state_rel_err"] > 0 and s.loc["int8", "max_logit_drift"] > 0
    assert s.loc["fp32", "first_divergence"] == G and s.loc["fp32", "accepted_per_verify"] == 2
    assert s.loc["bf16", "capacity_vs_fp32"] == 2
    assert list(run.curves.position.unique()) == list(range(1, N + 1))
    assert math.isnan(run.curves.top1.iloc[-1])       # the last position has no next byte in the run


def test_page_choices_are_held_out_and_long_enough():
    """Every file page 17 offers holds the longest run its slider offers (no error at any setting)."""
    from lab.state_precision import PAGE_DOCUMENTS, PAGE_TOKENS, documents_at_least
    assert set(PAGE_DOCUMENTS) <= set(documents_at_least(max(PAGE_TOKENS)))


def test_accepted_per_verify():
    assert accepted_per_verify([True] * 6, 4) == 4
    assert accepted_per_verify([True, False, True, True], 2) == (1 + 0 + 2) / 3
    assert math.isnan(accepted_per_verify([True], 2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(document="nope.py"), "document"),
    (dict(formats=("int8", "fp32")), "fp32"),
    (dict(formats=("fp32", "fp7")), "fp7"),
    (dict(document=DOC, num_tokens=10 ** 6), "num_tokens"),
    (dict(continue_tokens=2, draft_len=4), "draft_len"),
])
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        precision_run(**{"num_tokens": 4, "continue_tokens": 2, "draft_len": 1, **kwargs})


def test_field_claims(run):
    cap = capacity_table(4096)
    claims = field_claims(run.summary, cap)
    assert list(claims.source) == ["vllm#55196", "vllm#52962", "vllm#54146"]
    assert claims.verdict.iloc[2] == "ruled out on our model"             # the trained model's |S| is O(1)
    # the rule itself, on a made-up summary: int8 falls 10 points, error feedback and fp8 + SR stay level
    fake = run.summary.copy()
    fake["top1"] = fake.format.map({"int8_head": 0.4, "int8": 0.4}).fillna(0.5)
    assert list(field_claims(fake, cap).verdict[:2]) == ["reproduced", "reproduced"]
    fake["top1"] = fake.format.map({"int8_ef": 0.4, "fp8_e4m3_sr": 0.3}).fillna(0.5)
    assert list(field_claims(fake, cap).verdict[:2]) == ["collapse not reproduced", "not reproduced"]
    with pytest.raises(ValueError, match="int8_ef"):
        field_claims(run.summary[run.summary.format != "int8_ef"], cap)


def test_bench_run_reads_the_shipped_file_and_checks_its_weights(tmp_path, run):
    import hashlib
    import json

    from lab.state_precision import MODEL_PATH, bench_run
    assert bench_run(tmp_path / "none.json") is None
    sha = hashlib.sha256((MODEL_PATH / "model.safetensors").read_bytes()).hexdigest()
    d = dict(document=DOC, num_tokens=N, continue_tokens=G, draft_len=2, fp32_bitwise=True, conditions={},
             summary=run.summary.to_dict(orient="records"), curves=run.curves.to_dict(orient="records"),
             low_decay=[], weights_sha256=sha)
    (tmp_path / "r.json").write_text(json.dumps(d))
    got = bench_run(tmp_path / "r.json")
    assert got.meta["weights_match"] and len(got.summary) == len(run.summary)
    (tmp_path / "r.json").write_text(json.dumps({**d, "weights_sha256": "0" * 64}))
    assert not bench_run(tmp_path / "r.json").meta["weights_match"]
