"""The suite's parts that need no engine: two completions compared (exact and vLLM's close rule), Prometheus text
parsed, each engine's completion format read, the prompts (a run's nonce, the needle prompts)."""
from __future__ import annotations

import pytest

from conformance.adapters import BASE, NO_CACHE, SPECULATIVE, LlamaCpp, Sglang, Vllm, chunked, parse_openai
from conformance.client import Completion, parse_metrics
from conformance.compare import compare
from conformance.ours import Ours
from conformance.prompts import Prompts


def c(tokens, lps, top=None, error=None):
    return Completion(tuple(tokens), tuple(lps), top, "", None, error)


def test_exact_match_and_the_first_difference():
    a = c([1, 2, 3], [-0.1, -0.2, -0.3])
    assert compare(a, c([1, 2, 3], [-0.1, -0.2, -0.3005])).match
    d = compare(a, c([1, 2, 3], [-0.1, -0.2, -0.35]), atol=1e-3)
    assert not d.match and d.first_diff is None and d.max_dlogprob == pytest.approx(0.05) and "atol" in d.reason
    d = compare(a, c([1, 9, 3], [-0.1, -0.2, -0.3]))
    assert not d.match and d.first_diff == 1 and d.tokens == (2, 9) and d.max_dlogprob == 0.0
    d = compare(a, c([1, 2], [-0.1, -0.2]))
    assert not d.match and d.first_diff == 2 and "lengths differ" in d.reason


def test_close_rule_accepts_a_tie_flip_only_when_each_token_is_in_the_others_top():
    a = c([1, 2], [-0.1, -0.69], ({1: -0.1}, {2: -0.69, 5: -0.70}))
    b = c([1, 5], [-0.1, -0.69], ({1: -0.1}, {5: -0.69, 2: -0.70}))
    assert compare(a, b, "close").match and not compare(a, b, "exact").match
    far = c([1, 7], [-0.1, -0.1], ({1: -0.1}, {7: -0.1, 8: -3.0}))
    assert not compare(a, far, "close").match


def test_a_failed_request_never_matches_and_texts_are_compared_without_tokens():
    assert not compare(Completion.failed("HTTP 500"), Completion.failed("HTTP 500")).match
    assert compare(Completion(None, None, None, "abc"), Completion(None, None, None, "abc")).match
    d = compare(Completion(None, None, None, "abc"), Completion(None, None, None, "abd"))
    assert not d.match and d.first_diff == 2
    with pytest.raises(ValueError, match="rule must be one of"):
        compare(Completion.failed("x"), Completion.failed("x"), "fuzzy")


def test_parse_metrics_sums_series_and_keeps_labelled_ones():
    text = ('# HELP x y\n# TYPE vllm:prefix_cache_hits_total counter\n'
            'vllm:prefix_cache_hits_total{model_name="m"} 64.0\n'
            'kda:pool_pages{model_name="m",kind="free"} 10\nkda:pool_pages{model_name="m",kind="mla_kv"} 3\n'
            'llamacpp:requests_processing 0\n')
    m = parse_metrics(text)
    assert m["vllm:prefix_cache_hits_total"] == 64 and m["kda:pool_pages"] == 13
    assert m['kda:pool_pages{kind="free"}'] == 10 and m["llamacpp:requests_processing"] == 0


def test_each_engines_completion_format():
    body = {"choices": [{"text": "hi", "logprobs": {"tokens": ["token_id:104", "token_id:105"],
                                                     "token_logprobs": [-0.5, -0.25],
                                                     "top_logprobs": [{"token_id:104": -0.5}, {"token_id:105": -0.25}]}}],
            "usage": {"prompt_tokens_details": {"cached_tokens": 32}}}
    got = parse_openai(body)
    assert got.tokens == (104, 105) and got.logprobs == (-0.5, -0.25) and got.top[1] == {105: -0.25}
    assert got.cached_tokens == 32
    llama = {"choices": [{"text": "hi", "logprobs": {"content": [
        {"id": 104, "token": "h", "logprob": -0.5, "top_logprobs": [{"id": 104, "logprob": -0.5}]}]}}]}
    got = LlamaCpp().parse_completion(llama)
    assert got.tokens == (104,) and got.top == ({104: -0.5},) and got.cached_tokens is None


def test_each_engines_settings():
    ours, llama, vllm, sglang = Ours(), LlamaCpp(), Vllm(), Sglang()
    assert ours.variant_args(NO_CACHE) == ["--no-prefix-cache"] and ours.variant_fields(NO_CACHE) is None
    assert ours.variant_args(chunked(64)) == ["--chunked-prefill-size", "64"]
    assert "--speculative-config" in ours.variant_args(SPECULATIVE)
    assert llama.variant_fields(NO_CACHE)() == {"cache_prompt": False}
    assert llama.variant_args(chunked(32)) == ["-b", "32", "-ub", "32"]
    salts = vllm.variant_fields(NO_CACHE)(), vllm.variant_fields(NO_CACHE)()
    assert salts[0]["cache_salt"] != salts[1]["cache_salt"]                 # every request a cold prefill
    assert sglang.variant_args(NO_CACHE) == ["--disable-radix-cache"] and sglang.variant_fields(NO_CACHE) is None
    assert all(a.variant_args(BASE) == [] for a in (ours, llama, vllm, sglang))
    assert ours.grid(None) == (16, 64) and ours.grid(["--block-size", "32", "--checkpoint-interval=128"]) == (32, 128)
    assert sglang.grid(["--page-size", "64", "--mamba-track-interval", "256"]) == (64, 256)


def test_prompts_are_seeded_and_the_needles_alike():
    a, b = Prompts(1, lambda t: list(t.encode())), Prompts(1, lambda t: list(t.encode()))
    assert a.nonce == b.nonce and a.plain("x", 50) == b.plain("x", 50) and len(a.plain("x", 50)) == 50
    assert Prompts(2, lambda t: list(t.encode())).nonce != a.nonce
    n0, n1 = a.needle("n", 200, 0), a.needle("n", 200, 1)
    assert len(n0) == len(n1) == 200 and n0 != n1
    differ = [i for i, (x, y) in enumerate(zip(n0, n1)) if x != y]
    assert max(differ) < a.needle_span("n")                                 # only the first line differs
    assert len(a.repetitive("r", 90)) == 90


def test_listed_tokens_that_agree_do_not_hide_a_different_text():
    """llama.cpp lists no logprob for a token that ends inside a UTF-8 sequence: two runs can list the same tokens
    and still differ at an unlisted one; the texts decide."""
    a = Completion((104, 105), (-0.5, -0.2), None, "hi\u00e9")
    assert compare(a, a._replace(text="hi\u00e8")).reason.startswith("the 2 listed tokens agree but the texts differ")


def test_an_unmet_premise_makes_the_check_not_applicable():
    from conformance.report import CheckResult, Part, Status

    compared = Part("A again", Status.PASS, "6 tokens equal", {"positions_compared": 6, "max_abs_dlogprob": 0.0})
    hits = Part("hits", Status.NA, "not applicable: nothing was served from the cache", premise=True)
    result = CheckResult("x", "t", "i", "b", (), [hits, compared])
    assert result.status is Status.NA and result.summary.startswith("not applicable: nothing was served")
    result.parts[0] = Part("hits", Status.PASS, "cached tokens: 64", premise=True)
    assert result.status is Status.PASS and result.summary == "cached tokens: 64; 6 tokens equal"
    result.parts.append(Part("B", Status.FAIL, "token 2 differs: 5 vs 6"))
    assert result.status is Status.FAIL and result.summary == "token 2 differs: 5 vs 6"


def test_a_logprob_llama_cpp_did_not_compute_is_not_reported():
    """llama-server sends logprob 0 with no alternatives for a token of a speculative step (its TODO): read as
    not reported, so those positions are compared on tokens only."""
    body = {"choices": [{"text": "ab", "logprobs": {"content": [
        {"id": 97, "logprob": -0.5, "top_logprobs": [{"id": 97, "logprob": -0.5}]},
        {"id": 98, "logprob": 0.0, "top_logprobs": []}]}}]}
    spec = LlamaCpp().parse_completion(body)
    assert spec.logprobs == (-0.5, None) and spec.top == ({97: -0.5}, None)
    plain = spec._replace(logprobs=(-0.5, -0.7))
    d = compare(plain, spec)
    assert d.match and d.unreported == 1 and "1 without logprobs" in d.summary()
