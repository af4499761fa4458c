"""Snapshot rollback: keep the state and conv window after every verify token, select one at commit.

This is what SGLang's Mamba/GDN "intermediate state cache" and vLLM's per-draft-position state slots
do for hybrid models: the verify kernel writes the recurrent state after each of the ``1 + n`` tokens,
and the commit copies the one at the accepted length. Commit is a copy (no maths); memory is one full
state ``H K V`` per verify token per KDA layer, the largest of the three strategies.
"""
from __future__ import annotations

import torch

from kda_core.layer import KDAAux, KDACache, KDALayer
from serve.spec_decode.rollback import LayerShape, RollbackStrategy, owned, snapshot_bytes_per_token


class SnapshotRollback(RollbackStrategy):
    """Per KDA layer: states ``[1, T, H, K, V]`` and conv windows ``[1, T, 2HK + HV, W-1]`` (store dtype)."""

    name = "snapshot"

    def __init__(self, store_dtype: torch.dtype = torch.float32):
        super().__init__(store_dtype)
        self._states: dict[int, torch.Tensor] = {}
        self._convs: dict[int, torch.Tensor] = {}

    @classmethod
    def bytes_per_token(cls, shape: LayerShape, elem_bytes: int) -> int:
        return snapshot_bytes_per_token(shape, elem_bytes)

    def _record_layer(self, index: int, layer: KDALayer, base: KDACache, aux: KDAAux) -> None:
        w1 = base.conv.shape[-1]
        full = torch.cat([base.conv, aux.raw_qkv.transpose(1, 2)], dim=-1)    # [B, D, W-1+T]
        windows = full.unfold(-1, w1, 1)[:, :, 1:].transpose(1, 2)            # [B, T, D, W-1]: after token t
        self._states[index] = owned(aux.states, self.store_dtype)              # [B, T, H, K, V]
        self._convs[index] = owned(windows, self.store_dtype)                  # [B, T, D, W-1]

    def _commit_layer(self, index: int, layer: KDALayer, base: KDACache, num_tokens: int) -> KDACache:
        t = num_tokens - 1                                                     # state after token t
        return KDACache(owned(self._states[index][:, t], torch.float32),      # [B, H, K, V]
                        owned(self._convs[index][:, t], torch.float32))       # [B, D, W-1]

    def _release(self) -> None:
        self._states, self._convs = {}, {}

    def _buffers(self) -> list[torch.Tensor]:
        return [*self._states.values(), *self._convs.values()]

    def check_integrity(self) -> None:
        super().check_integrity()
        assert set(self._states) == set(self._convs), "state and conv snapshots cover different layers"
        if not self._check_layer_buffers(self._states):
            return
        valid = self._valid_tokens
        for i, win in self._convs.items():
            assert self._states[i].shape[1] == win.shape[1] == self._num_tokens, f"layer {i}: wrong token count"
            # window after token t is the window after t-1 shifted left by one column
            assert torch.equal(win[:, 1:valid, :, :-1], win[:, : valid - 1, :, 1:]), f"layer {i}: torn conv windows"
