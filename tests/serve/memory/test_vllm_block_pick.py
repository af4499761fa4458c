"""serve.memory.vllm_block.vllm_block_pick: the attention block vLLM's _align_hybrid_block_size picks.

Expected values are worked by hand from the published configs: one KDA layer's state per TP rank is
H*K*V*4 (fp32 recurrent) + (2HK + HV)*(W - 1)*2 (bf16 conv); one MLA layer's latent is
(512 + 64)*2 = 1152 B per token; block = align * ceil(state / (align * 1152)).
"""
import pytest

from kda_core.config import PRESETS
from serve.memory.vllm_block import VLLM_MLA_KERNEL_BLOCK, vllm_block_pick, vllm_vs_ours

KL_STATE = 32 * 128 * 128 * 4 + 3 * 32 * 128 * 3 * 2      # 2,170,880 B per KDA layer
K3_STATE = 96 * 128 * 128 * 4 + 3 * 96 * 128 * 3 * 2      # 6,512,640 B per KDA layer


@pytest.mark.parametrize("name, kernel, block, state", [
    pytest.param("kimi-linear-48b-a3b", 32, 1888, KL_STATE, id="kimi-linear-flashinfer32"),
    pytest.param("kimi-linear-48b-a3b", 64, 1920, KL_STATE, id="kimi-linear-flashmla64"),
    pytest.param("kimi-linear-48b-a3b", 128, 1920, KL_STATE, id="kimi-linear-cutlass128"),
    pytest.param("kimi-k3", 32, 5664, K3_STATE, id="k3-flashinfer32"),
    pytest.param("kimi-k3", 64, 5696, K3_STATE, id="k3-flashmla64"),
    pytest.param("kimi-k3", 128, 5760, K3_STATE, id="k3-cutlass128"),
])
def test_vllm_block_pick_presets(name, kernel, block, state):
    pick = vllm_block_pick(PRESETS[name], kernel)
    assert (pick.align, pick.block_size, pick.state_bytes) == (kernel, block, state)
    assert pick.attn_page_bytes == block * 1152 >= state > (block - kernel) * 1152
    assert pick.padding_fraction == pytest.approx((block * 1152 - state) / state)


def test_vllm_block_pick_user_block_and_tp():
    cfg = PRESETS["kimi-linear-48b-a3b"]
    assert vllm_block_pick(cfg, 64, block_size=256).block_size == 2048          # align = max(64, 256)
    half = vllm_block_pick(cfg, 64, tp_size=2)                                  # heads split, latent not
    assert half.state_bytes == KL_STATE // 2 and half.block_size == 64 * 15     # ceil(1,085,440 / 73,728)


def test_vllm_vs_ours_rows():
    cfg = PRESETS["kimi-k3"]
    rows = vllm_vs_ours(cfg)
    assert [r["vLLM backend"] for r in rows] == list(VLLM_MLA_KERNEL_BLOCK)
    page = 69 * K3_STATE                                # one group of all 69 KDA layers; a multiple of 64 B
    kv_block = 16 * 24 * 1152                           # 16 tokens x 24 MLA layers x 1152 B
    for r in rows:                                      # ours keeps the 16-token block and pads the KV page
        assert (r["our block (tokens)"], r["our page (B)"], r["our state padding"]) == (16, page, 0.0)
        assert r["our KV page padding"] == pytest.approx((page - kv_block) / page)
    assert [r["vLLM block (tokens)"] for r in rows] == [5664, 5696, 5760]


@pytest.mark.parametrize("kwargs, match", [({"kernel_block_size": 0}, "kernel_block_size"),
                                           ({"kernel_block_size": 64, "block_size": -1}, "block_size"),
                                           ({"kernel_block_size": 64, "tp_size": 5}, "tp_size")])
def test_vllm_block_pick_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vllm_block_pick(PRESETS["kimi-k3"], **kwargs)
