"""Roofline: hand-computed toy cases, monotonicity, TP, checkpoint restore, argument errors."""
import dataclasses

import pytest

from serve.scale.hardware import GPUS, Hardware
from serve.scale.model_shape import ModelShape, preset
from serve.scale.roofline import KDA_CHUNK, checkpoint_restore_time, decode_time, prefill_time

# A toy with numbers small enough to count by hand: 2 layers (KDA 0, MLA 1), no dense layer,
# one expert (top-1) with no router noise, width 8.
TOY = ModelShape(
    name="toy", num_layers=2, mla_layers=(1,), hidden_size=8, vocab_size=16, kda_heads=2, kda_head_dim=4,
    conv_kernel=4, full_rank_gate=True, mla_heads=2, q_lora_rank=0, kv_lora_rank=4, qk_nope_head_dim=2,
    qk_rope_head_dim=2, v_head_dim=2, mla_output_gate=False, first_dense_layers=0, dense_intermediate_size=8,
    num_experts=1, experts_per_token=1, num_shared_experts=0, moe_intermediate_size=4, routed_expert_hidden_size=8)
HW = Hardware("unit", peak_bf16_flops=1e3, hbm_bytes_per_s=1e2, hbm_bytes=1e9, nvlink_bytes_per_s=1e2)


def test_toy_params_by_hand():
    # KDA: q,k,v 3*8*8=192, o 8*8=64, beta 8*2=16, full-rank output gate 8*8=64, decay gate 8*4+4*8=64, conv (16+8)*4=96
    assert TOY.kda_layer_params == 192 + 64 + 16 + 64 + 64 + 96
    # MLA: q 8*2*4=64, kv_a 8*(4+2)=48, kv_b 4*2*(2+2)=32, o 2*2*8=32
    assert TOY.mla_layer_params == 64 + 48 + 32 + 32
    assert TOY.expert_params == 3 * 8 * 4 and TOY.moe_always_params == 8  # router 8*1
    # state: 2*4*4*4 bytes recurrent + 3*8*(4-1)*2 conv
    assert TOY.kda_state_bytes_layer == 128 + 144
    assert TOY.mla_kv_bytes_per_token_layer == (4 + 2) * 2


def test_decode_toy_by_hand():
    step = decode_time(TOY, HW, 1, batch=1, contexts=10)
    kda, mla, moe = step.kind("kda"), step.kind("mla"), step.kind("moe")
    assert kda.flops == 2 * 496 + 7 * 2 * 4 * 4  # projections + recurrent step
    assert kda.bytes == 496 * 2 + 2 * 272 + 1 * 2 * 5 * 4 * 2  # weights + state r/w + q,k,g,v,o
    # absorbed MLA: 11 keys (10 cached + the new one), 2 H (2 r + rope) FLOP each
    assert mla.flops == 2 * 176 + 11 * 2 * 2 * (2 * 4 + 2)
    assert mla.bytes == 176 * 2 + 11 * 12
    assert moe.flops == 2 * 2 * (8 + 96) and moe.bytes == 2 * (8 + 96) * 2  # both layers have the MoE
    assert mla.time_s == max(mla.flops / 1e3, mla.bytes / 1e2) and mla.bound == "memory"
    assert step.comm_s == 0 and step.total_s == pytest.approx(sum(k.time_s for k in step.kinds))


def test_prefill_toy_by_hand():
    n, b = 3, 5
    step = prefill_time(TOY, HW, 1, new_tokens=n, cached_tokens=b)
    pairs = n * b + n * (n + 1) // 2
    mla = step.kind("mla")
    assert mla.flops == pairs * 2 * 2 * (4 + 2) + 2 * (176 - 32) * n + 2 * 32 * (b + n)
    core = 2 * (6 * n * 16 + 3 * n * KDA_CHUNK * 4 + n * KDA_CHUNK ** 2)  # Eq. 13 per head, 2 heads
    assert step.kind("kda").flops == 2 * 496 * n + core


def test_mla_decode_grows_with_context_kda_flat():
    kl = preset("kimi-linear-48b-a3b")
    hw = GPUS["H100"]
    steps = [decode_time(kl, hw, 1, 8, c) for c in (4096, 65536, 1 << 20)]
    mla = [s.kind("mla").time_s for s in steps]
    kda = [s.kind("kda").time_s for s in steps]
    assert mla[0] < mla[1] < mla[2]
    assert kda[0] == kda[1] == kda[2]
    assert steps[0].total_s < steps[1].total_s < steps[2].total_s


def test_all_mla_decode_costs_more_at_long_context():
    kl = preset("kimi-linear-48b-a3b")
    hw = GPUS["H200"]
    assert decode_time(kl.all_mla(), hw, 1, 1, 1 << 20).total_s > 2 * decode_time(kl, hw, 1, 1, 1 << 20).total_s


def test_prefill_hit_is_cheaper_than_cold():
    kl = preset("kimi-k3")
    hw = GPUS["B200"]
    cold = prefill_time(kl, hw, 8, new_tokens=32768)
    warm = prefill_time(kl, hw, 8, new_tokens=1024, cached_tokens=31744)
    assert warm.total_s < cold.total_s / 4


def test_tp_splits_weights_but_replicates_latent_kv():
    kl = preset("kimi-linear-48b-a3b")
    hw = GPUS["H100"]
    one, eight = decode_time(kl, hw, 1, 1, 1 << 20), decode_time(kl, hw, 8, 1, 1 << 20)
    kv = kl.num_mla_layers * ((1 << 20) + 1) * kl.mla_kv_bytes_per_token_layer
    weights = kl.num_mla_layers * kl.mla_layer_params * kl.weight_bytes
    assert one.kind("mla").bytes == pytest.approx(weights + kv)
    assert eight.kind("mla").bytes == pytest.approx(weights / 8 + kv)
    assert eight.kind("moe").bytes == pytest.approx(one.kind("moe").bytes / 8)
    assert eight.comm_s > 0 == one.comm_s


def test_checkpoint_restore_is_state_bytes_over_bandwidth():
    kl = preset("kimi-linear-48b-a3b")
    hw = GPUS["H100"]
    state = kl.num_kda_layers * kl.kda_state_bytes_layer
    assert checkpoint_restore_time(kl, hw, 1) == pytest.approx(2 * state / 3.35e12)
    assert checkpoint_restore_time(kl, hw, 4, batch=2) == pytest.approx(2 * state * 2 / 4 / 3.35e12)


def test_overhead_is_added_once():
    kl = preset("kimi-linear-48b-a3b")
    base = decode_time(kl, GPUS["A100"], 1, 4, 1000)
    with_oh = decode_time(kl, GPUS["A100"], 1, 4, 1000, overhead_s=0.003)
    assert with_oh.total_s == pytest.approx(base.total_s + 0.003)


@pytest.mark.parametrize("call, arg", [
    (lambda: decode_time(TOY, HW, 3, 1, 10), "tp"),
    (lambda: decode_time(TOY, HW, 1, 0, 10), "batch"),
    (lambda: decode_time(TOY, HW, 1, 2, [1]), "contexts"),
    (lambda: decode_time(TOY, HW, 1, 1, -1), "contexts"),
    (lambda: prefill_time(TOY, HW, 1, 0), "new_tokens"),
    (lambda: prefill_time(TOY, HW, 1, 4, cached_tokens=-1), "cached_tokens"),
    (lambda: prefill_time(TOY, HW, 1, 4, overhead_s=-1.0), "overhead_s"),
    (lambda: prefill_time("toy", HW, 1, 4), "shape"),
    (lambda: checkpoint_restore_time(TOY, HW, 1, batch=0), "batch"),
    (lambda: dataclasses.replace(HW, hbm_bytes_per_s=0), "hbm_bytes_per_s"),
], ids=["tp", "batch", "contexts-len", "contexts-neg", "new_tokens", "cached", "overhead", "shape", "restore", "hw"])
def test_bad_args_name_the_argument(call, arg):
    with pytest.raises(ValueError, match=arg):
        call()


def test_prefill_reads_the_whole_latent_kv_on_every_tp_rank():
    """MLA's latent KV (cached + new tokens) is replicated under TP, in prefill as in decode: every split term of
    the MLA bytes shrinks by tp, the latent does not. Splitting it makes a warm TTFT after a long hit ~5 % low."""
    kl, hw = preset("kimi-linear-48b-a3b"), GPUS["H200"]
    n, b = 1024, 500_000
    kv = kl.num_mla_layers * (b + n) * kl.mla_kv_bytes_per_token_layer
    one = prefill_time(kl, hw, 1, n, cached_tokens=b).kind("mla").bytes
    for tp in (2, 8):
        assert prefill_time(kl, hw, tp, n, cached_tokens=b).kind("mla").bytes == pytest.approx((one - kv) / tp + kv)


def test_tp_beyond_one_node_all_reduces_over_infiniband():
    """TP16 spans two 8-GPU HGX nodes: its all-reduces run at the NIC's 50 GB/s (400 Gb/s NDR per GPU), not NVLink."""
    kl, hw = preset("kimi-k3"), GPUS["H200"]
    nbytes = 2 * kl.num_layers * 1 * kl.hidden_size * 2   # two all-reduces per layer, one token, bf16
    assert decode_time(kl, hw, 16, 1, 4096).comm_s == pytest.approx(2 * 15 / 16 * nbytes / 50e9)
    assert decode_time(kl, hw, 8, 1, 4096).comm_s == pytest.approx(2 * 7 / 8 * nbytes / 450e9)
    assert hw.allreduce_bytes_per_s(16) == 50e9 and GPUS["A100"].allreduce_bytes_per_s(16) == 25e9


def test_b200_bandwidth_is_the_current_hgx_table():
    assert GPUS["B200"].hbm_bytes_per_s == 7.7e12 and "7.7 TB/s" in GPUS["B200"].source


def test_a_billion_sequence_batch_builds_no_list():
    """One int context is not expanded per sequence: 10**7 sequences allocate nothing per sequence (the old code
    built a 10**7-element list, and 10**9 ran out of memory), and 10**9 gives the 10**7 answer scaled."""
    import tracemalloc
    kl, hw = preset("kimi-linear-48b-a3b"), GPUS["H200"]
    tracemalloc.start()
    decode_time(kl, hw, 8, 10 ** 7, 4096)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1_000_000, peak
    weights = kl.num_mla_layers * kl.mla_layer_params * kl.weight_bytes / 8
    big, small = (decode_time(kl, hw, 8, n, 4096).kind("mla").bytes - weights for n in (10 ** 9, 10 ** 7))
    assert big == pytest.approx(100 * small)


@pytest.mark.parametrize("call, arg", [
    (lambda: prefill_time(TOY, HW, 1, 10 ** 200), "new_tokens"),
    (lambda: prefill_time(TOY, HW, 1, 4, cached_tokens=10 ** 200), "cached_tokens"),
    (lambda: decode_time(TOY, HW, 1, 1, 10 ** 200), "contexts"),
    (lambda: decode_time(TOY, HW, 1, 10 ** 200, 4), "batch"),
    (lambda: decode_time(TOY, HW, 1, 1, 4096.0), "contexts"),
    (lambda: decode_time(TOY, HW, 1, 2, [1, 2.5]), "contexts"),
    (lambda: decode_time(TOY, HW, 1, 1, "4096"), "contexts"),
    (lambda: decode_time(TOY, HW, 1, 1, True), "contexts"),
    (lambda: decode_time(TOY, HW, 1, 1, [True]), "contexts"),
    (lambda: prefill_time(TOY, HW, 1, True), "new_tokens"),
    (lambda: prefill_time(TOY, HW, 1, 4096.0), "new_tokens"),
    (lambda: decode_time(TOY, HW, True, 1, 10), "tp"),
    (lambda: checkpoint_restore_time(TOY, HW, True), "tp"),
    (lambda: decode_time(TOY, HW, 1, 1, 10, overhead_s="0.001"), "overhead_s"),
    (lambda: decode_time(TOY, HW, 1, 1, 10, overhead_s=float("inf")), "overhead_s"),
    (lambda: decode_time(TOY, HW, 1, 1, 10, overhead_s=float("nan")), "overhead_s"),
    (lambda: prefill_time(TOY, HW, 1, 4, overhead_s=True), "overhead_s"),
    (lambda: dataclasses.replace(HW, internode_bytes_per_s=float("inf")), "internode_bytes_per_s"),
    (lambda: dataclasses.replace(HW, gpus_per_node=0), "gpus_per_node"),
], ids=["new-huge", "cached-huge", "ctx-huge", "batch-huge", "ctx-float", "ctx-list-float", "ctx-str", "ctx-true",
        "ctx-list-true", "new-true", "new-float", "tp-true", "restore-tp-true", "overhead-str", "overhead-inf",
        "overhead-nan", "overhead-true", "hw-inf", "hw-node"])
def test_bad_input_names_the_argument(call, arg):
    with pytest.raises(ValueError, match=arg):
        call()


def test_k3_full_rank_gate_is_the_output_gate():
    """Kimi K3's ``use_full_rank_gate`` replaces the KDA output gate's g_a / g_b pair by one g_proj (D x H V); the
    decay gate f_a / f_b stays low rank (the checkpoint's tensor names, revision f831ab6)."""
    k3, kl = preset("kimi-k3"), preset("kimi-linear-48b-a3b")
    d, h, k = k3.hidden_size, k3.kda_heads, k3.kda_head_dim
    assert k3.kda_output_gate_params == d * h * k
    assert k3.kda_decay_gate_params == d * k + k * h * k
    assert kl.kda_output_gate_params == kl.hidden_size * 128 + 128 * kl.kda_heads * 128
    assert "f831ab66814297da540d832a5235f8e904f29d06" in k3.source
