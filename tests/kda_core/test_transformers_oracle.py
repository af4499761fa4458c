"""Our Kimi-Linear against transformers' ``KimiLinearForCausalLM``: an implementation someone else wrote.

Each model is written by our checkpoint writer (Moonshot's names, fp32), read by transformers'
``from_pretrained`` (through its ``conversion_mapping.py``) with no missing or unexpected keys, and read back by
our loader. transformers runs its pure-torch fallbacks (``chunk_kimi_delta_attention``,
``recurrent_kimi_delta_attention``, the reference causal conv, eager MLA, its MoE loop).

Tolerance: ``|ours - theirs| <= ORACLE_RTOL * max(1, max |logit|)`` with ORACLE_RTOL = 1e-4. Both run fp32; the
difference is rounding only: transformers' chunked KDA is the plain WY form (an O(C^2) forward substitution
per chunk) where ours factors the decay per unit and runs a different summation order; its l2norm is
``x / sqrt(s + eps)`` where ours is ``x * rsqrt(s + eps)``; its MoE sums experts with ``index_add_`` in expert order
where ours sums the top-k in score order. Measured here: at most 2.9e-5 of the largest |logit| over 40 random
configs of this file's shapes (T up to 150), so the bound is about 3.5x the worst case seen. Greedy continuations must be identical token for token.
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kda_core.chunk import kda_chunk
from kda_core.config import ModelConfig
from kda_core.kda import kda_recurrent
from kda_core.model import HybridLM
from kda_core.pretrained import INDEX_NAME, WEIGHTS_NAME

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearForCausalLM  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear as tf_kimi  # noqa: E402

transformers.logging.set_verbosity_error()
ORACLE_RTOL = 1e-4


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    scale = max(1.0, float(theirs.abs().max()))
    err = float((ours - theirs).abs().max())
    assert err <= ORACLE_RTOL * scale, f"{what}: max |ours - transformers| = {err:.3g} (max |logit| {scale:.3g})"


@st.composite
def configs(draw) -> ModelConfig:
    """Small Kimi-Linear configs: heads, head dims, experts, top-k, shared experts, dense layers, the layer
    pattern, conv width, grouped routing. At least one shared expert: transformers always builds
    ``shared_experts`` (of width ``moe_intermediate_size * n_shared_experts``), as every Kimi-Linear config has one."""
    num_layers = draw(st.integers(2, 5))
    mla = draw(st.sets(st.integers(0, num_layers - 1), min_size=0, max_size=num_layers - 1))
    num_experts = draw(st.sampled_from([0, 2, 4, 6]))
    groups = draw(st.sampled_from([1, 2])) if num_experts in (4,) else 1
    return ModelConfig(
        name="oracle", num_layers=num_layers, mla_layers=tuple(sorted(mla)), hidden_size=draw(st.sampled_from([32, 48])),
        num_heads=draw(st.integers(1, 3)), head_k_dim=(hd := draw(st.sampled_from([8, 16]))), head_v_dim=hd,
        kv_lora_rank=draw(st.sampled_from([8, 16])), qk_rope_head_dim=draw(st.sampled_from([4, 8])),
        conv_kernel=draw(st.integers(2, 4)), num_mla_heads=draw(st.integers(1, 3)),
        qk_nope_head_dim=draw(st.sampled_from([8, 16])), v_head_dim=draw(st.sampled_from([8, 12])),
        intermediate_size=draw(st.sampled_from([32, 64])), rms_norm_eps=draw(st.sampled_from([1e-5, 1e-6])),
        mla_use_nope=True, num_experts=num_experts,
        num_experts_per_token=draw(st.integers(1, min(2, max(1, num_experts)))),
        moe_intermediate_size=draw(st.sampled_from([8, 16])), num_shared_experts=draw(st.integers(1, 2)),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.446])), moe_renormalize=draw(st.booleans()),
        num_expert_group=groups, topk_group=1, first_k_dense_replace=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 1000)))


def perturbed(cfg: ModelConfig) -> HybridLM:
    """A random model whose norms, gates and router biases are not at their neutral init, so that a norm or a
    bias read from the wrong tensor shows in the logits."""
    model = HybridLM(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        for ffn in model.ffn:
            if hasattr(ffn, "router_bias"):
                ffn.router_bias.copy_(0.1 * torch.randn(ffn.router_bias.shape, generator=gen))
    return model


def pair(cfg: ModelConfig, folder) -> tuple[HybridLM, KimiLinearForCausalLM]:
    """(ours loaded back from the folder, transformers' from the same folder); asserts no key is missing."""
    perturbed(cfg).save_pretrained(folder, dtype=torch.float32)
    theirs, info = KimiLinearForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return HybridLM.from_pretrained(folder), theirs.eval()


def their_logits(model: KimiLinearForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits                          # [B, T, vocab]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=configs(), num_tokens=st.integers(1, 150), data=st.data())
def test_prefill_and_decode_logits(cfg, num_tokens, data, tmp_path_factory):
    ours, theirs = pair(cfg, tmp_path_factory.mktemp("ckpt"))
    ids = torch.tensor([data.draw(st.lists(st.integers(0, 255), min_size=num_tokens, max_size=num_tokens))])
    ref = their_logits(theirs, ids)
    logits, cache = ours.prefill(ids)
    assert_close(logits, ref, "prefill")
    steps = []                                                            # decode the last tokens one by one
    split = max(1, num_tokens - 6)
    _, cache = ours.prefill(ids[:, :split])
    for t in range(split, num_tokens):
        step, cache = ours.decode_step(ids[0, t], cache)
        steps.append(step)
    if steps:
        assert_close(torch.stack(steps, dim=1), ref[:, split:], "decode")


def test_chunked_prefill_at_every_boundary(tmp_path):
    """A prefill split at every boundary b (prefill [0, b), then [b, T) from its cache) gives transformers'
    logits for both parts."""
    cfg = ModelConfig(name="oracle", num_layers=4, mla_layers=(1, 3), hidden_size=32, num_heads=2, head_k_dim=8,
                      head_v_dim=8, kv_lora_rank=8, qk_rope_head_dim=4, conv_kernel=4, num_mla_heads=2,
                      qk_nope_head_dim=8, v_head_dim=8, intermediate_size=32, rms_norm_eps=1e-5, mla_use_nope=True,
                      num_experts=4, num_experts_per_token=2, moe_intermediate_size=8, num_shared_experts=1,
                      routed_scaling_factor=2.446, first_k_dense_replace=1, seed=3)
    ours, theirs = pair(cfg, tmp_path)
    ids = torch.randint(0, 256, (1, 72), generator=torch.Generator().manual_seed(0))
    ref = their_logits(theirs, ids)
    for b in range(1, ids.shape[1]):
        first, cache = ours.prefill(ids[:, :b])
        rest, _ = ours.prefill(ids[:, b:], cache)
        assert_close(torch.cat([first, rest], dim=1), ref, f"prefill split at {b}")


def test_greedy_64_tokens_identical(tmp_path):
    cfg = ModelConfig(name="oracle", num_layers=4, mla_layers=(3,), hidden_size=48, num_heads=2, head_k_dim=16,
                      head_v_dim=16, kv_lora_rank=16, qk_rope_head_dim=8, num_mla_heads=2, qk_nope_head_dim=16,
                      v_head_dim=16, intermediate_size=64, rms_norm_eps=1e-5, mla_use_nope=True, num_experts=6,
                      num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1,
                      routed_scaling_factor=2.446, first_k_dense_replace=1, seed=5)
    ours, theirs = pair(cfg, tmp_path)
    prompt = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = theirs.generate(prompt, max_new_tokens=64, do_sample=False, pad_token_id=0)[:, 20:]
    out, _ = ours.generate(prompt, 64)
    assert torch.equal(out, ref), f"first difference at {(out != ref).nonzero()[:1].tolist()}"


@pytest.mark.parametrize("T", [1, 37, 64, 130], ids=lambda t: f"T{t}")
def test_kda_kernels_against_transformers(T):
    """``kda_chunk`` and ``kda_recurrent`` against transformers' ``chunk_kimi_delta_attention`` and
    ``recurrent_kimi_delta_attention`` (q, k already L2-normalised, as the layer passes them)."""
    gen = torch.Generator().manual_seed(T)
    B, H, K, V = 2, 3, 16, 12
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * 0.5
    beta = torch.rand(B, T, H, generator=gen)
    s0 = torch.randn(B, H, K, V, generator=gen) * 0.1
    o_ref, s_ref = tf_kimi.chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    out = kda_chunk(q, k, v, g, beta, s0)
    torch.testing.assert_close(out.o, o_ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(out.final_state, s_ref, atol=2e-5, rtol=0)
    o_rec, s_rec = tf_kimi.recurrent_kimi_delta_attention(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o, s = kda_recurrent(q, k, v, g, beta, s0)
    torch.testing.assert_close(o, o_rec, atol=2e-5, rtol=0)
    torch.testing.assert_close(s, s_rec, atol=2e-5, rtol=0)


def test_sharded_checkpoint_reads_like_one_file(tmp_path):
    """A checkpoint sharded by ``max_shard_bytes`` (with ``model.safetensors.index.json``) loads in both."""
    cfg = ModelConfig(name="oracle", num_layers=2, mla_layers=(1,), hidden_size=32, num_heads=2, head_k_dim=8,
                      head_v_dim=8, kv_lora_rank=8, qk_rope_head_dim=4, num_mla_heads=2, qk_nope_head_dim=8,
                      v_head_dim=8, intermediate_size=32, mla_use_nope=True, num_experts=4, num_experts_per_token=2,
                      moe_intermediate_size=8, first_k_dense_replace=1, seed=7)
    model = perturbed(cfg)
    model.save_pretrained(tmp_path, dtype=torch.float32, max_shard_bytes=20_000)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (tmp_path / WEIGHTS_NAME).exists()
    theirs, info = KimiLinearForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    ours = HybridLM.from_pretrained(tmp_path)
    assert_close(ours.prefill(ids)[0], their_logits(theirs.eval(), ids), "sharded")
    for a, b in zip(ours.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
