"""Block and token ideals of the two public Mooncake traces, beside the paper's Table 2 "cache ratio".

The paper (FAST'25, Table 2) reports 40 % / 66 % without a formula; our block ideal counts hash ids of
a request's leading run already seen / all hash ids. The values below are recomputed from the files.
"""
import pytest

from lab.fleet import MOONCAKE_TABLE2_CACHE_RATIO
from serve.traces.mooncake import ideal_hit_ratio, load_mooncake


@pytest.mark.parametrize("name, hit, total, block_ratio, paper", [
    pytest.param("conversation", 105710, 288500, 0.3664, 0.40, id="conversation"),
    pytest.param("synthetic", 77953, 121877, 0.6396, 0.66, id="synthetic"),
])
def test_block_ideal_vs_paper(traces_dir, name, hit, total, block_ratio, paper):
    ideal = ideal_hit_ratio(load_mooncake(traces_dir / f"mooncake_{name}_trace.jsonl"))
    assert (ideal.hit_blocks, ideal.total_blocks) == (hit, total)
    assert ideal.block_hit_ratio == pytest.approx(block_ratio, abs=5e-5)
    assert MOONCAKE_TABLE2_CACHE_RATIO[name] == paper
    assert ideal.block_hit_ratio < paper          # the paper's figure counts something larger
