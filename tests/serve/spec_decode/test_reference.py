"""``greedy_decode``: the target's own greedy tokens and the cache after each fed token, computed once (pages 02
and 04 take their reference output and reference caches from it): equal to ``generate`` and to
``sequential_decode`` of those tokens, bitwise."""
import pytest

from kda_core.model import cache_equal
from serve.spec_decode.reference import greedy_decode, sequential_decode
from tests.serve.spec_decode.helpers import PROMPT, model, one_thread, start

pytestmark = pytest.mark.usefixtures(one_thread.__name__)
__all__ = ["model", "start"]  # shared fixtures


def test_greedy_decode_is_generate_and_sequential_decode(model, start):
    run = greedy_decode(model, start.cache, start.last_token, 9)
    generated, _ = model.generate(PROMPT.reshape(1, -1), 9)
    assert run.tokens == generated[0].tolist()
    assert [c.num_tokens for c in run.caches] == [start.cache.num_tokens + i for i in range(1, 9)]
    assert all(cache_equal(a, b) for a, b in zip(run.caches, sequential_decode(model, start.cache, run.tokens[:-1])))


def test_greedy_decode_one_token_and_bad_sizes(model, start):
    assert greedy_decode(model, start.cache, 7, 1) == ([7], [])
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_tokens"):
            greedy_decode(model, start.cache, 7, bad)
