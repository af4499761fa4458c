"""The shared argument checks of ``serve.errors``: one rule and one message for every int and choice argument."""
import pytest

from serve.errors import check_choice, check_int
from serve.scale.hardware import hardware
from serve.scale.model_shape import preset
from serve.scale.roofline import checkpoint_restore_time, decode_time, prefill_time
from serve.spec.draft import NgramProposer


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
