"""Projection replay: keep what the KDA kernel consumed per verify token, replay the recurrence at commit.

Per KDA layer and verify token the strategy keeps the tensors the kernel consumed — k, v, g, beta —
and the raw conv inputs; the commit replays the per-token step (through :func:`kda_core.decode.replay`,
the same step as the verify ran) from the committed state over the accepted tokens and rolls
the conv window forward. Memory ``H(2K + V + 1) s + (2HK + HV) s`` per verify token per KDA layer
(:func:`serve.spec_decode.rollback.projection_bytes_per_token`); commit cost one recurrence per accepted token.

:mod:`serve.spec_decode.replay_ssm` (ReplaySSM) stores u = beta (v - S'^T k) instead of v and beta,
keeps its records in a ring across steps and a checkpoint, and replays only at materialisation;
:mod:`serve.spec_decode.raw_input_ring` caches the raw layer inputs and re-projects.
"""
from __future__ import annotations

import torch

from kda_core import decode
from kda_core.layer import KDAAux, KDACache, KDALayer
from serve.spec_decode.rollback import (
    LayerShape,
    RollbackStrategy,
    conv_window_after,
    owned,
    projection_bytes_per_token,
)


class ProjectionReplay(RollbackStrategy):
    """Per KDA layer: k, g ``[1, T, H, K]``, v ``[1, T, H, V]``, beta ``[1, T, H]``, raw ``[1, T, 2HK + HV]``."""

    name = "projection replay"
    FIELDS = ("k", "v", "g", "beta", "raw_qkv")

    def __init__(self, store_dtype: torch.dtype = torch.float32):
        super().__init__(store_dtype)
        self._store: dict[int, dict[str, torch.Tensor]] = {}

    @classmethod
    def bytes_per_token(cls, shape: LayerShape, elem_bytes: int) -> int:
        return projection_bytes_per_token(shape, elem_bytes)

    def projections(self, index: int) -> dict[str, torch.Tensor]:
        """The stored tensors of KDA layer ``index`` (k, v, g, beta, raw_qkv; ``[1, T, ...]``)."""
        return self._store[index]

    def _record_layer(self, index: int, layer: KDALayer, base: KDACache, aux: KDAAux) -> None:
        self._store[index] = {f: owned(getattr(aux, f), self.store_dtype) for f in self.FIELDS}

    def _commit_layer(self, index: int, layer: KDALayer, base: KDACache, num_tokens: int) -> KDACache:
        p = {f: t[:, :num_tokens] for f, t in self._store[index].items()}     # accepted tokens only
        # the same per-token step as the verify ran (kda_core.decode: the fused C form or the torch one)
        state = decode.replay(layer, p["k"], p["v"], p["g"], p["beta"], base.recurrent)
        return KDACache(state, conv_window_after(base.conv, p["raw_qkv"], num_tokens))

    def _release(self) -> None:
        self._store = {}

    def _buffers(self) -> list[torch.Tensor]:
        return [t for d in self._store.values() for t in d.values()]

    def check_integrity(self) -> None:
        super().check_integrity()
        if not self._check_layer_buffers(self._store):
            return
        valid = self._valid_tokens
        for i, p in self._store.items():
            assert all(t.shape[1] == self._num_tokens for t in p.values()), f"layer {i}: wrong token count"
            assert bool((p["g"][:, :valid] <= 0).all()), f"layer {i}: log decay g must be <= 0"
            beta = p["beta"][:, :valid]
            assert bool(((beta >= 0) & (beta <= 1)).all()), f"layer {i}: beta outside [0, 1]"
