"""app_pages/params.py: each kind of declared URL parameter reads, checks and writes its value, with no app.

- ``parse(format(v)) == v`` for every value a parameter can take (hypothesis), so a link the app writes opens the
  view it came from; ``check`` accepts exactly those values.
- Each malformed link value is refused with the reason the README's table gives.
- A declaration that contradicts itself (a default outside its bounds, a malformed key) fails when it is made, and
  bounds can only be narrowed within it.
"""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app_pages.params import Choice, Float, Int, Multi, Range, Text, Toggle, Unreadable

SEED = Int("p05_seed", 0, 0, 9999)
SHARE = Float("p05_long_share", 0.8, 0.0, 1.0, step=0.05)
SCALES = Choice("p17_vscale", 1.0, (1.0, 100.0, 10000.0, 30000.0))
MODEL = Choice("p09_preset", "a", ("a", "b"), format_func=str.upper)
CONTEXT = Range("p03_context", (1024, 2 ** 20), tuple(2 ** i for i in range(6, 21)))
POLICIES = Multi("p15_policies", ("ours", "vllm"), ("ours", "vllm", "sglang"))
DROP = Toggle("p07_drop", False)
PROMPT = Text("p00_first", "hi", max_chars=10)


@given(st.integers(0, 9999))
def test_int_round_trip(v):
    assert SEED.check(v) is None and SEED.parse(SEED.format(v)) == v


@given(st.floats(0.0, 1.0))
def test_float_round_trip(v):
    assert SHARE.check(v) is None and SHARE.parse(SHARE.format(v)) == v


@pytest.mark.parametrize("param", [SCALES, MODEL, CONTEXT, POLICIES, DROP, PROMPT], ids=lambda p: p.key)
def test_every_value_round_trips(param):
    """Regression: page 17's ``p17_vscale`` wrote 100.0 to the URL as ``100`` (the whole-number form of a slider)
    but read only its label ``100.0``: the app's own link of that view was ignored with a notice on reload."""
    if isinstance(param, Range):
        values = [(a, b) for i, a in enumerate(param.options) for b in param.options[i:]]
    elif isinstance(param, Multi):
        values = [[], ["ours"], ["sglang", "ours"], list(param.options)]
    elif isinstance(param, Toggle):
        values = [True, False]
    elif isinstance(param, Text):
        values = ["", "a b", "é\n😀", "x" * 10]
    else:
        values = list(param.options)
    for v in values:
        assert param.check(v) is None, v
        if v != []:                                        # an empty selection is written, and refused on reading
            assert param.parse(param.format(v)) == (tuple(v) if isinstance(param, Range) else v), v


@pytest.mark.parametrize(("param", "raw", "why"), [
    (SEED, ["1.5"], "not an integer"),
    (SEED, ["inf"], "not an integer"),
    (SEED, ["1e309"], "not an integer"),
    (SEED, ["9" * 25_000], "outside [0, 9999]"),
    (SEED, ["10000"], "outside [0, 9999]"),
    (SEED, ["1", "2"], "given 2 times"),
    (SHARE, ["nan"], "not a finite number"),
    (SHARE, ["-inf"], "not a finite number"),
    (SHARE, ["many"], "not a number"),
    (SHARE, ["1.5"], "outside [0.0, 1.0]"),
    (SCALES, ["100"], "not one of the values this widget takes now (1.0, 100.0, 10000.0, 30000.0)"),
    (MODEL, ["a"], "not one of the values this widget takes now (A, B)"),
    (CONTEXT, ["4096"], "1 value, not a range of two (give it twice)"),
    (CONTEXT, ["1024", "4096", "65536"], "3 values, not a range of two (give it twice)"),
    (CONTEXT, ["65536", "4096"], "a range whose low end comes second"),
    (CONTEXT, ["64", "100"], "not one of the values this widget takes now (64, 128, 256, 512, 1024, 2048, 4096, "
                             "8192, 16384, 32768, 65536, 131072, … (15 in all))"),
    (POLICIES, [""], "an empty selection"),
    (POLICIES, ["ours", "ours"], "a selection that names ours more than once"),
    (POLICIES, ["ours", "lru"], "not one of the values this widget takes now (ours, vllm, sglang)"),
    (DROP, ["yes"], "not true or false"),
    (PROMPT, ["x" * 11], "11 characters, over the 10-character limit"),
    (PROMPT, ["a", "b"], "given 2 times"),
])
def test_a_malformed_link_value_is_refused_saying_why(param, raw, why):
    with pytest.raises(Unreadable) as exc:
        param.parse(raw)
    assert str(exc.value) == why


def test_a_reversed_range_is_not_a_value():
    """Regression: ``?p03_context=65536&p03_context=4096`` was applied as the range (65536, 4096) with no notice,
    and page 03 showed "ValueError: context_range must be (lo, hi) with 1 <= lo <= hi"."""
    assert CONTEXT.check((65536, 4096)) == "a range whose low end comes second"
    assert CONTEXT.check((4096, 4096)) is None


@pytest.mark.parametrize(("param", "value", "why"), [
    (SEED, True, "a bool, not a int"),
    (SEED, 1.0, "a float, not a int"),
    (SEED, -1, "outside [0, 9999]"),
    (SHARE, 1, "a int, not a float"),
    (SHARE, math.nan, "NaN"),
    (SCALES, 2.0, "not one of the options"),
    (SCALES, 100, "a int, not a float"),
    (CONTEXT, 4096, "a int, not a range of two values"),
    (POLICIES, "ours", "a str, not a list"),
    (POLICIES, ["lru"], "not a subset of the options"),
    (DROP, 1, "a int, not a bool"),
    (PROMPT, None, "a NoneType, not a str"),
])
def test_a_stored_value_the_parameter_cannot_take_says_why(param, value, why):
    assert param.check(value) == why


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Int("p05_seed", 10_000, 0, 9999), "p05_seed: the default 10000 is outside [0, 9999]"),
    (lambda: Int("p05_seed", 0, 9, 1), "p05_seed: min_value 9 > max_value 1"),
    (lambda: Float("p05_share", 1, 0.0, 1.0), "p05_share: the default 1 is a int, not a float"),
    (lambda: Choice("p05_x", "c", ("a", "b")), "p05_x: the default 'c' is not one of the options"),
    (lambda: Choice("p05_x", "a", ()), "p05_x: no options"),
    (lambda: Multi("p05_x", ("c",), ("a", "b")), "p05_x: the default ('c',) is not a subset of the options"),
    (lambda: Toggle("seed", False), "'seed': a URL key is p<NN>_<name>"),
    (lambda: SEED.narrowed(max_value=10_000), "p05_seed: max_value 10000 is outside the declared [0, 9999]"),
    (lambda: MODEL.narrowed(options=["c"]), "p09_preset: options ['c'] are not among the declared ones"),
])
def test_a_declaration_that_contradicts_itself_fails_when_made(make, message):
    with pytest.raises(ValueError) as exc:
        make()
    assert message in str(exc.value)


def test_narrowed_bounds_move_the_default_inside_them():
    """A bound another widget lowers (page 04's window under the ring capacity) moves the default to the bound; a
    narrower set of options (the GPUs a model fits on) keeps the declared default if offered, else its first."""
    assert SEED.narrowed(max_value=5).default == 0 and Int("p04_window", 6, 1, 16).narrowed(max_value=4).default == 4
    assert Int("p04_window", 6, 1, 16).narrowed(max_value=4).follow(16) == 4
    gpu = Choice("p15_gpu", "H200", ("A100", "H100", "H200", "B200"))
    assert gpu.narrowed(options=["H100", "H200"]).default == "H200"
    assert gpu.narrowed(options=["B200", "A100"]).default == "B200"
    assert gpu.narrowed(options=["B200", "A100"], default="A100").default == "A100"
    with pytest.raises(TypeError):
        DROP.narrowed(default=True)
