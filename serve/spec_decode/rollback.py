"""The rollback-strategy interface for speculative decoding with a recurrent (KDA) state.

A KV cache drops rejected draft tokens by truncation; a KDA state has already folded them in, so
after a partly rejected draft the state must be rebuilt at exactly the last accepted token. Each
strategy records something during the verify forward and turns it into the committed caches:

| strategy | file | records per verify token and KDA layer | commit |
|---|---|---|---|
| :class:`serve.spec_decode.snapshot.SnapshotRollback` | ``serve/spec_decode/snapshot.py`` | state + conv window | select |
| :class:`serve.spec_decode.projection.ProjectionReplay` | ``serve/spec_decode/projection.py`` | k, v, g, beta + raw conv inputs | replay ``kda_step`` |
| :class:`serve.spec_decode.raw_input_ring.RawInputRing` | ``serve/spec_decode/raw_input_ring.py`` | layer input x (ring buffer) | re-project + replay |
| :class:`serve.spec_decode.replay_ssm.ReplaySSM` | ``serve/spec_decode/replay_ssm.py`` | k, u, g + raw conv inputs (ring + checkpoint) | cursor move; replay from the checkpoint |

Token ranges of one verify (half-open, positions in the sequence; L = committed tokens before it):

| range | tokens |
|---|---|
| ``[0, L)`` | committed: inside the base caches |
| ``[L, L + 1)`` | the last committed token, not yet fed (its successor is what verify predicts first) |
| ``[L + 1, L + 1 + n)`` | the n draft tokens |
| ``[L, L + m)``, ``m = 1 + num_accepted`` | what the commit folds into the new caches |

MLA layers need no strategy: their latent KV is truncated to ``L + m`` tokens.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from kda_core.config import ModelConfig, dtype_bytes, kda_state_elems_per_layer
from kda_core.layer import KDAAux, KDACache, KDALayer
from kda_core.model import ForwardOutput, HybridCache, HybridLM


class LayerShape(NamedTuple):
    """Sizes of one KDA layer that rollback buffers depend on (all in elements).

    num_heads H, head_k_dim K, head_v_dim V, conv_kernel W, hidden_size d (the layer input width).
    """

    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    hidden_size: int = 128

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> LayerShape:
        return cls(cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.conv_kernel, cfg.hidden_size)

    @property
    def conv_dim(self) -> int:
        """Raw q, k, v channels entering the short conv: ``2 H K + H V``."""
        return self.num_heads * (2 * self.head_k_dim + self.head_v_dim)


def snapshot_bytes_per_token(shape: LayerShape, elem_bytes: int) -> int:
    """Snapshot per verify token per KDA layer: state ``H K V s`` + conv window ``(2HK + HV)(W-1) s``
    (:func:`kda_core.config.kda_state_elems_per_layer`)."""
    return sum(kda_state_elems_per_layer(shape)) * elem_bytes


def projection_bytes_per_token(shape: LayerShape, elem_bytes: int) -> int:
    """Projections per verify token per KDA layer: k, g ``H K`` each, v ``H V``, beta ``H`` -> ``H(2K + V + 1) s``,
    plus the raw conv inputs ``(2HK + HV) s`` needed to roll the conv window."""
    H, K, V = shape.num_heads, shape.head_k_dim, shape.head_v_dim
    return H * (2 * K + V + 1) * elem_bytes + shape.conv_dim * elem_bytes


def raw_input_bytes_per_token(shape: LayerShape, elem_bytes: int) -> int:
    """Raw layer input per token per KDA layer: ``d s`` (one hidden vector)."""
    return shape.hidden_size * elem_bytes


def owned(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous copy of ``t`` in ``dtype`` that shares no memory with ``t``."""
    return torch.empty(t.shape, dtype=dtype).copy_(t)


def conv_window_after(conv_state: torch.Tensor, raw_qkv: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Conv state after feeding the first ``num_tokens`` raw inputs: the last ``W-1`` of ``[state, raw]``.

    Args: conv_state ``[B, D, W-1]``; raw_qkv ``[B, T, D]``; 0 <= num_tokens <= T.
    Returns: ``[B, D, W-1]`` (a copy; bitwise what :func:`kda_core.conv.short_conv` returns).
    """
    w1 = conv_state.shape[-1]
    full = torch.cat([conv_state, raw_qkv[:, :num_tokens].transpose(1, 2).to(conv_state.dtype)], dim=-1)  # [B, D, W-1+m]
    return full[..., num_tokens: num_tokens + w1].clone()                                              # [B, D, W-1]


class RollbackStrategy(ABC):
    """Records what a verify consumed, then commits the caches at the accepted length.

    Lifecycle per speculative step: :meth:`record` (right after the verify forward) -> :meth:`commit`
    (returns new caches, releases the per-verify buffers) or :meth:`discard` (abort, e.g. a preempted
    request). Neither mutates the caches it was given: caches are immutable values.
    ``nbytes()`` counts the rollback buffers the strategy holds now (MLA KV excluded: truncated in place).

    Args:
        store_dtype: dtype of the stored buffers. fp32 (default) keeps the commit bitwise exact for the
            fp32 engine; a narrower dtype only models the memory (the replayed state is then rounded).
    """

    name: str = "strategy"

    def __init__(self, store_dtype: torch.dtype = torch.float32):
        if not isinstance(store_dtype, torch.dtype) or not store_dtype.is_floating_point:
            raise ValueError(f"store_dtype must be a floating torch.dtype, got {store_dtype!r}")
        self.store_dtype = store_dtype
        self._model: HybridLM | None = None
        self._base: HybridCache | None = None
        self._verified: HybridCache | None = None
        self._num_tokens = 0
        self._valid_tokens = 0      # tokens whose stored data is intact (< T after poison)
        self.forced_commit = False  # True when the last record had to commit older data first (ring)

    # -- interface -------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def bytes_per_token(cls, shape: LayerShape, elem_bytes: int) -> int:
        """Analytic rollback bytes per verify token per KDA layer (batch 1)."""

    @abstractmethod
    def _record_layer(self, index: int, layer: KDALayer, base: KDACache, aux: KDAAux) -> None:
        """Store what this strategy keeps of one KDA layer's verify."""

    @abstractmethod
    def _commit_layer(self, index: int, layer: KDALayer, base: KDACache, num_tokens: int) -> KDACache:
        """Cache of KDA layer ``index`` after the first ``num_tokens`` verify tokens."""

    @abstractmethod
    def _release(self) -> None:
        """Drop the per-verify buffers (after a commit or a discard)."""

    @abstractmethod
    def _buffers(self) -> list[torch.Tensor]:
        """Every tensor the strategy holds now (for ``nbytes``)."""

    def expected_nbytes(self) -> int:
        """What ``nbytes()`` must equal now by the analytic formula (``check_integrity`` compares):
        ``T x num_kda_layers x bytes_per_token`` while a verify is recorded, else 0 (batch 1)."""
        if not self.recording:
            return 0
        return self._num_tokens * len(self._model.kda_layers) * self.bytes_per_token(self.layer_shape(), self.elem_bytes())

    def poison(self, from_token: int) -> None:
        """Overwrite the stored data of verify tokens ``>= from_token`` with NaN. A control: a commit
        that accepts fewer tokens must never read them, so its result stays bitwise exact.

        Raises: ValueError if nothing is recorded or ``from_token`` is outside ``[1, T]``."""
        if not self.recording or not 1 <= from_token <= self._num_tokens:
            raise ValueError(f"from_token must be in [1, T = {self._num_tokens}] of a recorded verify, got {from_token}")
        for t in self._buffers():                   # per-verify buffers: [B, T, ...]
            t[:, from_token:] = float("nan")
        self._valid_tokens = from_token

    # -- shared ----------------------------------------------------------------------------------
    @property
    def recording(self) -> bool:
        """True between :meth:`record` and :meth:`commit` / :meth:`discard`."""
        return self._base is not None

    @property
    def num_tokens(self) -> int:
        """Verify tokens T = 1 + n recorded (0 when not recording)."""
        return self._num_tokens

    def record(self, model: HybridLM, base: HybridCache, verified: ForwardOutput) -> None:
        """Keep what this strategy needs from a verify forward run from ``base`` with ``output_aux=True``.

        Raises:
            ValueError: a verify is already recorded, aux is missing, or the batch is not 1.
            RuntimeError: from subclasses whose fixed storage cannot take the verify (see the ring).
        """
        if self.recording:
            raise ValueError("a verify is already recorded: commit() or discard() it first")
        if verified.aux is None or set(verified.aux) != set(model.kda_layers):
            raise ValueError("verified must come from model.forward(..., output_aux=True) over all layers")
        num_tokens = verified.cache.num_tokens - base.num_tokens
        first = verified.aux[model.kda_layers[0]] if model.kda_layers else None
        if first is not None and (first.x.shape[0] != 1 or first.x.shape[1] != num_tokens):
            raise ValueError(f"verify must be batch 1 with {num_tokens} tokens, got x {tuple(first.x.shape)}")
        self._begin(model, base, num_tokens)
        self._model, self._base, self._verified, self._num_tokens = model, base, verified.cache, num_tokens
        self._valid_tokens = num_tokens
        for i in model.kda_layers:
            self._record_layer(i, model.mixers[i], base.layers[i], verified.aux[i])

    def _begin(self, model: HybridLM, base: HybridCache, num_tokens: int) -> None:
        """Hook before the layers are recorded; may raise ValueError (nothing changed then).
        The ring reserves its slots here and may force a write-back."""
        self.forced_commit = False

    def commit(self, num_accepted: int) -> HybridCache:
        """Caches after the last committed token and the first ``num_accepted`` drafts.

        Raises:
            ValueError: nothing recorded, or ``num_accepted`` outside ``[0, T - 1]``.
        """
        if not self.recording:
            raise ValueError("nothing recorded: call record() after a verify first")
        if not isinstance(num_accepted, int) or not 0 <= num_accepted < self._num_tokens:
            raise ValueError(f"num_accepted must be an int in [0, {self._num_tokens - 1}], got {num_accepted!r}")
        m = 1 + num_accepted
        base, verified, model = self._base, self._verified, self._model
        layers = []
        for i, (b, v) in enumerate(zip(base.layers, verified.layers)):
            if isinstance(b, KDACache):
                layers.append(self._commit_layer(i, model.mixers[i], b, m))
            else:                                   # MLA: a KV cache just drops the rejected tokens
                layers.append(v[:, : b.shape[1] + m].clone())                # [B, L + m, r + rope]
        self._finish(m)
        return HybridCache(tuple(layers), base.num_tokens + m)

    def _finish(self, num_committed: int) -> None:
        """After a commit of ``num_committed`` verify tokens (0: a discard): release the per-verify buffers."""
        self._release()
        self._model = self._base = self._verified = None
        self._num_tokens = self._valid_tokens = 0

    def discard(self) -> None:
        """Abort the recorded verify: committed caches stay as they were; buffers are released."""
        self._finish(0)

    def nbytes(self) -> int:
        """Bytes of every rollback buffer held now (numel x element size)."""
        return sum(t.numel() * t.element_size() for t in self._buffers())

    def layer_shape(self) -> LayerShape | None:
        return None if self._model is None else LayerShape.from_config(self._model.cfg)

    def elem_bytes(self) -> int:
        return dtype_bytes(self.store_dtype)

    def _check_layer_buffers(self, per_layer: dict) -> bool:
        """Shared check of per-verify buffers keyed by KDA layer index: none without a record, one per
        KDA layer with one. Returns True when a record is there to check further."""
        if not self.recording:
            assert not per_layer, f"{self.name}: buffers held without a recorded verify"
            return False
        assert set(per_layer) == set(self._model.kda_layers), f"{self.name}: buffers missing for a KDA layer"
        return True

    def check_integrity(self) -> None:
        """Raise AssertionError if the held bytes differ from the analytic formula or state is torn."""
        assert (self._base is None) == (self._verified is None) == (self._model is None), "torn record state"
        assert self.recording or self._num_tokens == 0, "token count without a record"
        held, expected = self.nbytes(), self.expected_nbytes()
        assert held == expected, f"{self.name}: holds {held} B, formula says {expected} B"
