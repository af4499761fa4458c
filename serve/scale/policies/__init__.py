"""The production engines' prefix-cache policies for KDA hybrids, replayed at real bytes.

Concept → file → main type → test:
- replica bytes, policy interface, timeless replay .. base.py ....... ``ReplicaBytes``, ``PrefixPolicy``,
  ``replay``, ``PolicyResult`` ........................................ tests/serve/scale/test_policies.py
- KV blocks + states at token positions, 2 LRUs ..... state_tree.py . ``StateTree`` ....... same file
- ours (wraps serve.prefix.sim) ..................... ours.py ....... ``OursPolicy`` ...... same file
- SGLang MambaRadixCache no_buffer / extra_buffer ... sglang.py ..... ``SGLangNoBuffer``, ``SGLangExtraBuffer``
- vLLM mamba_cache_mode none / align / all .......... vllm.py ....... ``VLLMMambaPolicy``, ``vllm_block_size``,
  ``vllm_group_pages``

Each policy class's docstring cites the code it models and says what could not be confirmed. A replay
returns each request's hit tokens, so prefill time saved can be computed with a roofline afterwards.
"""
from __future__ import annotations

from serve.scale.policies.base import BYTE_KINDS, PolicyResult, PrefixPolicy, ReplicaBytes, replay
from serve.scale.policies.ours import OursPolicy
from serve.scale.policies.sglang import SGLangExtraBuffer, SGLangNoBuffer
from serve.scale.policies.state_tree import StateTree
from serve.scale.policies.vllm import MODES, VLLMMambaPolicy, vllm_block_size, vllm_group_pages

# The policies by the name their engine gives them. vLLM's "all" is a counterfactual for Kimi: its
# KimiLinearForCausalLM does not declare SupportsMambaPrefixCaching, so vLLM serves Kimi in "align" (vllm.py).
CACHE_POLICIES = ("ours", "sglang no_buffer", "sglang extra_buffer", "vllm align", "vllm all")
EXTRA_CACHE_POLICIES = ("vllm none", "vllm align +replay stop")                         # opt-in variants
OURS_C, EXTRA_BUFFER_CHUNK = 2048, 8192   # ours' checkpoint interval C, SGLang's default chunked_prefill_size (tokens)

__all__ = ["BYTE_KINDS", "CACHE_POLICIES", "EXTRA_CACHE_POLICIES", "MODES", "make_policy", "OursPolicy", "PolicyResult", "PrefixPolicy", "ReplicaBytes", "SGLangExtraBuffer",
           "SGLangNoBuffer", "StateTree", "VLLMMambaPolicy", "all_policies", "replay", "vllm_block_size",
           "vllm_group_pages"]


def all_policies(preset: str, tp_size: int = 1, checkpoint_interval: int = OURS_C) -> list:
    """One fresh instance of every policy (:data:`CACHE_POLICIES` + :data:`EXTRA_CACHE_POLICIES`) for ``preset``
    on ``tp_size`` ranks, default knobs but ours' ``checkpoint_interval``."""
    return [make_policy(name, preset, tp_size, checkpoint_interval if name == "ours" else None)
            for name in CACHE_POLICIES + EXTRA_CACHE_POLICIES]


def make_policy(name: str, model: str, tp: int, interval: int | None = None) -> PrefixPolicy:
    """A fresh policy ``name`` (:data:`CACHE_POLICIES` + :data:`EXTRA_CACHE_POLICIES`) for ``model`` on ``tp``
    ranks; ``interval`` sets ours' C or extra_buffer's ``chunked_prefill_size`` (tokens; None = :data:`OURS_C` /
    :data:`EXTRA_BUFFER_CHUNK`; 0 is an error, not the default). Raises ValueError for an unknown name."""
    if name == "ours":
        return OursPolicy(model, OURS_C if interval is None else interval, tp_size=tp)
    if name == "sglang no_buffer":
        return SGLangNoBuffer(ReplicaBytes.for_preset(model, tp))
    if name == "sglang extra_buffer":
        return SGLangExtraBuffer(ReplicaBytes.for_preset(model, tp),
                                 chunked_prefill_size=EXTRA_BUFFER_CHUNK if interval is None else interval)
    if name in ("vllm none", "vllm align", "vllm all"):
        return VLLMMambaPolicy(model, name.split()[1], tp)
    if name == "vllm align +replay stop":
        return VLLMMambaPolicy(model, "align", tp, replay_stop=True)
    raise ValueError(f"policy must be one of {CACHE_POLICIES + EXTRA_CACHE_POLICIES}, got {name!r}")
