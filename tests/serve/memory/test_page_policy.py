"""Page-size policies: unified page size vs multi-page state, on the real presets."""
import pytest
import torch

from kda_core.config import PRESETS, fixed_state_bytes_per_sequence, mla_kv_bytes_per_token
from serve.memory.page_policy import compare_policies, group_state_bytes, kda_groups, page_layout


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("G", [1, 2, 5])
def test_groups_partition_kda_layers(name, G):
    cfg = PRESETS[name]
    G = min(G, cfg.num_kda_layers)
    groups = kda_groups(cfg, G)
    assert len(groups) == G and tuple(i for g in groups for i in g) == cfg.kda_layers
    assert max(map(len, groups)) - min(map(len, groups)) <= 1
    total = sum(group_state_bytes(cfg, len(g)) for g in groups)
    assert total == fixed_state_bytes_per_sequence(cfg)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("bs, align", [(16, 16), (16, 1), (64, 16)], ids=["bs16-a16", "bs16-a1", "bs64-a16"])
def test_policies(name, G, bs, align):
    cfg = PRESETS[name]
    per_tok = mla_kv_bytes_per_token(cfg)
    uni = page_layout(cfg, "unified", bs, G, block_align=align)
    multi = page_layout(cfg, "multi_page", bs, G, block_align=align)
    state = group_state_bytes(cfg, len(kda_groups(cfg, G)[0]))
    # unified: smallest aligned block >= bs whose KV page holds one state; the state page is padded
    assert uni.block_size % align == 0 and uni.block_size >= bs and uni.page_bytes == uni.block_size * per_tok
    assert uni.page_bytes >= state and (uni.block_size - align) * per_tok < max(state, bs * per_tok)
    assert uni.state_pages == 1 and uni.state_waste_bytes == uni.page_bytes - state
    # multi-page: KV block unchanged, state spans ceil(state / page) pages, tail waste < one page
    assert multi.block_size == bs and multi.page_bytes == bs * per_tok
    assert multi.state_pages == -(-state // multi.page_bytes)
    assert 0 <= multi.state_waste_bytes < multi.page_bytes
    assert multi.sequence_pages(100) == -(-100 // bs) + G * multi.state_pages


def test_compare_rows_and_errors():
    rows = compare_policies(PRESETS["kimi-linear-48b-a3b"], 16, 1)
    assert [r["policy"] for r in rows] == ["unified", "multi_page"]
    assert rows[0]["block_size"] > 5000  # one 20-layer state (43 MB) needs a ~5,400-token KV block
    with pytest.raises(ValueError, match="policy"):
        page_layout(PRESETS["demo"], "buddy")
    with pytest.raises(ValueError, match="block_size"):
        page_layout(PRESETS["demo"], "unified", 0)
    with pytest.raises(ValueError, match="num_groups"):
        kda_groups(PRESETS["demo"], 7)
    fp32 = page_layout(PRESETS["demo"], "multi_page", kv_dtype=torch.float32)
    assert fp32.page_bytes == 2 * page_layout(PRESETS["demo"], "multi_page").page_bytes
