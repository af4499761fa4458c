"""CacheLayout: KDA groups, the page-size policies and the byte accounting, on every preset."""
import pytest
import torch

from kda_core.config import PRESETS, fixed_state_bytes_per_sequence, mla_kv_bytes_per_token
from serve.memory.layout import REAL_DTYPES, CacheLayout, group_layers, group_state_bytes


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("G", [1, 2, 5])
def test_groups_partition_kda_layers(name, G):
    cfg = PRESETS[name]
    G = min(G, cfg.num_kda_layers)
    groups = group_layers(cfg, G)
    assert len(groups) == G and tuple(i for g in groups for i in g) == cfg.kda_layers
    assert max(map(len, groups)) - min(map(len, groups)) <= 1
    assert sum(group_state_bytes(cfg, len(g)) for g in groups) == fixed_state_bytes_per_sequence(cfg)
    lay = CacheLayout.for_policy(cfg, 16, G, "multi_page", **REAL_DTYPES)
    assert lay.state_bytes == fixed_state_bytes_per_sequence(cfg)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("bs", [1, 16, 64])
@pytest.mark.parametrize("dtypes", [{}, REAL_DTYPES], ids=["fp32", "real"])
def test_policies(name, G, bs, dtypes):
    cfg = PRESETS[name]
    kv = bs * mla_kv_bytes_per_token(cfg, dtypes.get("kv_dtype", torch.float32))
    uni = CacheLayout.for_policy(cfg, bs, G, "unified", **dtypes)
    multi = CacheLayout.for_policy(cfg, bs, G, "multi_page", **dtypes)
    states = [uni.group_state_bytes(g) for g in range(G)]
    assert states == [group_state_bytes(cfg, len(g), dtypes.get("state_dtype", torch.float32),
                                        dtypes.get("conv_dtype", torch.float32)) for g in group_layers(cfg, G)]
    for lay in (uni, multi):                      # the block size is the caller's, never grown
        assert lay.block_size == bs and lay.kv_block_bytes == kv and lay.page_bytes % 64 == 0
        assert lay.kv_page_padding_bytes == lay.page_bytes - kv >= 0
        assert lay.state_waste_bytes == lay.state_pages * lay.page_bytes - sum(states) >= 0
    # unified: a group state is one page, the smallest 64-byte multiple holding a block and every state
    assert uni.state_pages == G and uni.page_bytes - 64 < max(kv, *states) <= uni.page_bytes
    # multi-page: the page is one block; a state spans ceil(state / page) pages
    assert multi.page_bytes - 64 < kv <= multi.page_bytes
    assert multi.state_pages == sum(-(-s // multi.page_bytes) for s in states)


def test_errors():
    cfg = PRESETS["demo"]
    with pytest.raises(ValueError, match="policy must be one of"):
        CacheLayout.page_bytes_for(cfg, 16, 1, "buddy")
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        CacheLayout.page_bytes_for(cfg, 0, 1, "multi_page")
    with pytest.raises(ValueError, match=r"num_groups must be an int in \[1, 6\]"):
        group_layers(cfg, 7)
    with pytest.raises(ValueError, match="cannot hold one KV block"):
        CacheLayout(cfg, 16, 1, 1024)
    with pytest.raises(ValueError, match="multiple of 4"):
        CacheLayout(cfg, 1, 1, 1022)
    fp32 = CacheLayout.page_bytes_for(cfg, 16, 1, "multi_page")
    assert fp32 == 2 * CacheLayout.page_bytes_for(cfg, 16, 1, "multi_page", kv_dtype=torch.bfloat16)
