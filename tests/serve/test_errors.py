"""The shared argument checks of ``serve.errors``: one rule and one message for every int and choice argument."""
import pytest

from serve.errors import check_choice, check_fraction, check_int, check_positive
from serve.fleet.routing.jump import jump_bucket
from serve.scale.hardware import hardware
from serve.scale.model_shape import preset
from serve.scale.roofline import checkpoint_restore_time, decode_time, prefill_time
from serve.spec_decode.draft import NgramProposer
from serve.traces.mooncake import synthesize


@pytest.mark.parametrize("val, minimum, ok", [(1, 1, True), (0, 0, True), (5, 3, True), (0, 1, False), (-1, 0, False),
                                              (True, 1, False), (False, 0, False), (1.0, 1, False), ("2", 1, False),
                                              (None, 1, False)])
def test_check_int(val, minimum, ok):
    if ok:
        assert check_int("n", val, minimum) == val
    else:
        with pytest.raises(ValueError, match=rf"^n must be an int >= {minimum}, got {val!r}$"):
            check_int("n", val, minimum)


def test_check_choice():
    assert check_choice("mode", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"^mode must be one of \('a', 'b'\), got 'c'$"):
        check_choice("mode", "c", ("a", "b"))


def test_a_bool_is_not_a_count():
    """Regression: several checks written inline took ``True`` for 1 (``isinstance(True, int)``): the roofline's
    ``batch`` / ``new_tokens`` and the n-gram drafter's ``min_ngram``."""
    shape, hw = preset("kimi-linear-48b-a3b"), hardware("H200")
    for call in (lambda: prefill_time(shape, hw, 8, True, 0),
                 lambda: prefill_time(shape, hw, 8, 16, 0, batch=True),
                 lambda: decode_time(shape, hw, 8, True, 16),
                 lambda: checkpoint_restore_time(shape, hw, 8, batch=True),
                 lambda: NgramProposer(min_ngram=True)):
        with pytest.raises(ValueError, match="must be an int >= 1, got True"):
            call()


POSITIVE = (check_positive, r"^x must be > 0, got ")
FRACTION = (check_fraction, r"^x must be in \[0, 1\], got ")


@pytest.mark.parametrize("check, message, val, ok", [
    *[(*POSITIVE, val, ok) for val, ok in [(0.5, True), (3, True), (0, False), (-1.0, False), (float("nan"), False),
                                           (True, False), (None, False), ("1", False)]],
    *[(*FRACTION, val, ok) for val, ok in [(0, True), (1, True), (0.25, True), (1.5, False), (-0.1, False),
                                           (float("nan"), False), (False, False), (None, False)]],
])
def test_check_positive_and_fraction(check, message, val, ok):
    if ok:
        assert check("x", val) == val
    else:
        with pytest.raises(ValueError, match=message):
            check("x", val)


def test_a_missing_number_is_a_value_error():
    """Regression: checks written ``if x <= 0`` / ``if x < 1`` raised TypeError (``'<=' not supported``) for None,
    which the pages do not show as a user-facing error, and a NaN duration passed ``x <= 0`` until numpy raised
    OverflowError inside the generator."""
    with pytest.raises(ValueError, match="num_requests must be an int >= 1, got None"):
        synthesize(num_requests=None)
    with pytest.raises(ValueError, match="duration_s must be > 0, got nan"):
        synthesize(num_requests=10, duration_s=float("nan"))
    with pytest.raises(ValueError, match="num_buckets must be an int >= 1, got None"):
        jump_bucket(1, None)
