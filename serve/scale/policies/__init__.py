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

__all__ = ["BYTE_KINDS", "MODES", "OursPolicy", "PolicyResult", "PrefixPolicy", "ReplicaBytes", "SGLangExtraBuffer",
           "SGLangNoBuffer", "StateTree", "VLLMMambaPolicy", "all_policies", "replay", "vllm_block_size",
           "vllm_group_pages"]


def all_policies(preset: str, tp_size: int = 1, checkpoint_interval: int = 2048) -> list:
    """One fresh instance of every policy for ``preset`` on ``tp_size`` ranks, default knobs."""
    replica = ReplicaBytes.for_preset(preset, tp_size)
    return [OursPolicy(preset, checkpoint_interval, tp_size=tp_size), SGLangNoBuffer(replica),
            SGLangExtraBuffer(replica)] + [VLLMMambaPolicy(preset, m, tp_size) for m in MODES] + [
            VLLMMambaPolicy(preset, "align", tp_size, replay_stop=True)]
