"""ReplaySSM for KDA: one checkpoint state per request plus a ring of per-step ``(k, u, g)`` records.

Sources (read for this port): the cross-project ReplaySSM RFC and tracking issues vLLM #46187 / #47572 /
#49232 (for GDN the ring caches ``(u, k, g)`` with ``u = beta (v - S k)``; #47572 also uses it as the
state write of standard decode), vLLM #47576, SGLang's KDA path (``replayssm_is_kda`` in
``python/sglang/srt/layers/attention/hybrid_linear_attn_backend.py`` and ``mem_cache/memory_pool.py``:
per-K gate ring ``g_cache`` instead of GDN's per-head scalar; sglang#28451, #36821), TensorRT-LLM #18294
(Kimi K3 KDA replay) and flashinfer#4864 (``k_cache [H, L, K]``, ``u_cache [H, L, V]``, ``g_cache``).

KDA recurrence per token (``kda_core.kda._step``), with ``S'`` the decayed state:

    S' = exp(g) ⊙ S                 g [H, K] per-key-channel log decay (GDN: one scalar per head)
    u  = beta (v - S'^T k)          u [H, V]: the delta correction, the only state-dependent term
    S  = S' + k ⊗ u

Given ``u``, the update no longer reads the state, so a request keeps ONE checkpoint state ``S_0`` and a
ring of records ``(k_j, u_j, g_j)``; any later state is ``S_h = replay(S_0, records[0:h])``. A decode
step (or a verify) writes records, not the ``H K V`` state; the checkpoint is **materialised** (the
committed records folded into it) only when the ring cannot take the next verify, i.e. about every
``ring_size`` tokens; after a partly rejected draft **rollback is a cursor move** (``commit_end += m``,
``tail = commit_end``): the rejected records stay in place, are never read and are overwritten later.

Record per token per KDA layer (store dtype ``s`` bytes per element):

| field | shape | elements |
|---|---|---|
| k (after conv, SiLU, L2 norm) | ``[H, K]`` | ``H K`` |
| u = beta (v - S'^T k) | ``[H, V]`` | ``H V`` |
| g (log decay, per key channel) | ``[H, K]`` | ``H K`` |
| raw q, k, v conv inputs | ``[2HK + HV]`` | ``2HK + HV`` |

-> ``H(2K + V) s + (2HK + HV) s`` bytes (:func:`replay_ssm_bytes_per_token`). The raw conv inputs roll
the short-conv window forward (SGLang keeps per-step conv windows instead; the window is the small part).
Kimi K3 (H = 96, K = V = 128, bf16): 73,728 + 98,304 B per layer-token versus a 6.29 MB fp32 state write.

Held per request: the ring ``[ring_size, num_kda_layers, record]`` (allocated at first use; ``nbytes``)
and one checkpoint (state ``[1, H, K, V]`` fp32 + conv window ``[1, 2HK + HV, W-1]`` fp32) per KDA layer,
the request's one state slot (not counted in ``nbytes``, as no strategy counts the committed cache).

This engine's ``u`` is recomputed in :meth:`ReplaySSM._record_layer` from the verify's per-token states
with the kernel's own step (:func:`kda_core.kda.kda_step_with_correction`, bitwise what the forward
computed), because ``KDAAux`` does not expose it; a fused kernel writes it from registers
(ROCm/ATOM#1919). The replay runs the same op order as ``_step``, so with fp32 records every commit is
bitwise equal to plain decoding; bf16 records only model the memory (the state is then rounded).
"""
from __future__ import annotations

import torch

from kda_core import decode
from kda_core.config import ModelConfig
from kda_core.kda import kda_step_with_correction
from kda_core.layer import KDAAux, KDACache, KDALayer
from kda_core.model import HybridCache, HybridLM
from serve.spec_decode.rollback import LayerShape, RollbackStrategy, conv_window_after

DEFAULT_RING_SIZE = 16   # SGLang's ``linear_replayssm_cache_len`` default


def replay_ssm_bytes_per_token(shape: LayerShape, elem_bytes: int) -> int:
    """ReplaySSM record per token per KDA layer: k, g ``H K`` each, u ``H V`` -> ``H(2K + V) s``, plus the
    raw conv inputs ``(2HK + HV) s``."""
    H, K, V = shape.num_heads, shape.head_k_dim, shape.head_v_dim
    return H * (2 * K + V) * elem_bytes + shape.conv_dim * elem_bytes


def replay_records(state: torch.Tensor, k: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
                   cfg: ModelConfig | None = None) -> torch.Tensor:
    """Fold records into a state: ``S = exp(g_t) ⊙ S + k_t ⊗ u_t`` for t = 0..m-1 (the op order of ``_step``).

    Args: state ``[B, H, K, V]`` fp32; k, g ``[B, m, H, K]``; u ``[B, m, H, V]`` (any float dtype, cast to fp32);
    cfg: the model's config: ``exp(g)`` as its decode step computes it (:func:`kda_core.decode.decay`; None: ATen's).
    Returns: the state after the m records ``[B, H, K, V]`` fp32 (``state`` when m = 0; never mutated).
    """
    S = state
    k, u, g = (t.to(state.dtype) for t in (k, u, g))
    for t in range(k.shape[1]):
        gt = g[:, t].contiguous()
        S = S * (gt.exp() if cfg is None else decode.decay(cfg, gt)).unsqueeze(-1)   # decay   [B, H, K, V]
        S = S + k[:, t].contiguous().unsqueeze(-1) * u[:, t].contiguous().unsqueeze(-2)  # rank-1 write
    return S


class ReplaySSM(RollbackStrategy):
    """A checkpoint plus a ring of ``ring_size`` token records per KDA layer (one request, batch 1).

    Ring counters are absolute; slot = counter mod ring_size:

    | range | records |
    |---|---|
    | ``[head, commit_end)`` | committed since the checkpoint (the checkpoint is the state before ``head``) |
    | ``[commit_end, tail)`` | the pending verify (1 + n tokens) |

    Args:
        ring_size: records per KDA layer (tokens). window: the most verify tokens (``1 + n``) one step
            holds pending; ``1 <= window <= ring_size``. store_dtype: record dtype.

    Raises:
        ValueError: bad ring_size/window; at record, a draft longer than the window, caches not at the
        committed position, or another model than the one the ring serves.
    """

    name = "ReplaySSM"

    def __init__(self, ring_size: int = DEFAULT_RING_SIZE, window: int = 8, store_dtype: torch.dtype = torch.float32):
        super().__init__(store_dtype)
        if not isinstance(ring_size, int) or isinstance(ring_size, bool) or ring_size < 1:
            raise ValueError(f"ring_size must be an int >= 1 (records per layer), got {ring_size!r}")
        if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= ring_size:
            raise ValueError(f"window must be an int in [1, ring_size = {ring_size}], got {window!r}")
        self.ring_size, self.window = ring_size, window
        self.head = self.commit_end = self.tail = 0
        self.num_materialisations = 0
        self._ring: dict[str, torch.Tensor] = {}           # field -> [ring_size, num_kda_layers, ...]
        self._ring_model: HybridLM | None = None
        self._checkpoint: dict[int, KDACache] = {}          # KDA caches before token `head`
        self._checkpoint_position = 0
        self._committed: dict[int, KDACache] = {}           # KDA caches the last commit returned

    @classmethod
    def bytes_per_token(cls, shape: LayerShape, elem_bytes: int) -> int:
        return replay_ssm_bytes_per_token(shape, elem_bytes)

    def slot(self, counter: int) -> int:
        return counter % self.ring_size

    def _slots(self, start: int, stop: int) -> torch.Tensor:
        """Slot indices of absolute counters ``[start, stop)``."""
        return torch.tensor([self.slot(c) for c in range(start, stop)], dtype=torch.long)

    def _kda_index(self, index: int) -> int:
        return self._ring_model.kda_layers.index(index)

    def _allocate(self, model: HybridLM) -> None:
        cfg, L, R = model.cfg, model.cfg.num_kda_layers, self.ring_size
        H, K, V = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
        nan = float("nan")                                  # never-written records fail loudly
        self._ring = {"k": torch.full((R, L, H, K), nan, dtype=self.store_dtype),
                      "u": torch.full((R, L, H, V), nan, dtype=self.store_dtype),
                      "g": torch.full((R, L, H, K), nan, dtype=self.store_dtype),
                      "raw_qkv": torch.full((R, L, cfg.conv_dim), nan, dtype=self.store_dtype)}
        self._ring_model = model

    def materialise(self) -> None:
        """Fold the committed records ``[head, commit_end)`` into the checkpoint and free them (the flush).
        Cost: one replay per committed record and a state write per KDA layer."""
        if self.commit_end > self.head:
            self._checkpoint = self.read_state(self.commit_end)
            self._checkpoint_position += self.commit_end - self.head
            self.head = self.commit_end
            self.num_materialisations += 1

    def read_state(self, stop: int) -> dict[int, KDACache]:
        """KDA caches after absolute counter ``stop - 1``: the checkpoint plus records ``[head, stop)``
        replayed (what a ReplaySSM decode kernel reads). ``head <= stop <= tail``."""
        if not self.head <= stop <= self.tail:
            raise ValueError(f"stop must be in [head = {self.head}, tail = {self.tail}], got {stop}")
        if stop == self.head:
            return dict(self._checkpoint)
        idx = self._slots(self.head, stop)
        out = {}
        for i, c in self._checkpoint.items():
            j = self._kda_index(i)
            rec = {f: t[idx, j].unsqueeze(0) for f, t in self._ring.items()}   # [1, m, ...]
            out[i] = KDACache(replay_records(c.recurrent, rec["k"], rec["u"], rec["g"], self._ring_model.cfg),
                              conv_window_after(c.conv, rec["raw_qkv"], stop - self.head))
        return out

    def _begin(self, model: HybridLM, base: HybridCache, num_tokens: int) -> None:
        self.forced_commit = False
        if num_tokens > self.window:
            raise ValueError(f"a draft of {num_tokens - 1} tokens needs {num_tokens} pending records, more than "
                             f"the window of {self.window}: draft at most {self.window - 1} tokens")
        if self._ring_model is not None and model is not self._ring_model:
            raise ValueError("this ReplaySSM ring serves another model: use one per request and model")
        committed = self._checkpoint_position + (self.commit_end - self.head)
        if self._checkpoint and base.num_tokens != committed:
            raise ValueError(f"base caches hold {base.num_tokens} tokens but ReplaySSM is committed up to "
                             f"{committed}: the caches must be the ones the last commit returned")
        if not self._ring:
            self._allocate(model)
        if not self._checkpoint:                            # first use: the prefill state is the checkpoint
            self._checkpoint = {i: base.layers[i] for i in model.kda_layers}
            self._checkpoint_position = base.num_tokens
        if self.tail + num_tokens - self.head > self.ring_size:   # ring full: fold, then record
            self.forced_commit = True
            self.materialise()
        self.tail += num_tokens

    def _record_layer(self, index: int, layer: KDALayer, base: KDACache, aux: KDAAux) -> None:
        j, T = self._kda_index(index), self._num_tokens
        u = aux.u                                                                  # [1, T, H, V] the step's own
        if u is None:                                                              # the torch form: recompute it
            prev = [base.recurrent] + [aux.states[:, t] for t in range(T - 1)]    # state before token t
            u = torch.stack([kda_step_with_correction(aux.q[:, t].contiguous(), aux.k[:, t].contiguous(),
                                                      aux.v[:, t].contiguous(), aux.g[:, t].contiguous(),
                                                      aux.beta[:, t].contiguous(), prev[t])[2]
                             for t in range(T)], dim=1)                             # [1, T, H, V]
        idx = self._slots(self.commit_end, self.commit_end + T)
        for f, src in (("k", aux.k), ("u", u), ("g", aux.g), ("raw_qkv", aux.raw_qkv)):
            self._ring[f][idx, j] = src[0].to(self.store_dtype)

    def _commit_layer(self, index: int, layer: KDALayer, base: KDACache, num_tokens: int) -> KDACache:
        c, j = self._checkpoint[index], self._kda_index(index)
        idx = self._slots(self.head, self.commit_end + num_tokens)
        rec = {f: t[idx, j].unsqueeze(0) for f, t in self._ring.items()}
        return KDACache(replay_records(c.recurrent, rec["k"], rec["u"], rec["g"], layer.cfg),
                        conv_window_after(c.conv, rec["raw_qkv"], len(idx)))

    def commit(self, num_accepted: int) -> HybridCache:
        cache = super().commit(num_accepted)
        self._committed = {i: cache.layers[i] for i in self._ring_model.kda_layers}
        return cache

    def _finish(self, num_committed: int) -> None:
        self.commit_end += num_committed                    # the rollback: a cursor move
        self.tail = self.commit_end
        super()._finish(num_committed)

    def _release(self) -> None:
        """Nothing to free: rejected records stay in their slots, unread, until overwritten."""

    def _buffers(self) -> list[torch.Tensor]:
        return list(self._ring.values())

    def expected_nbytes(self) -> int:
        """``ring_size x num_kda_layers x record`` once allocated. The checkpoint is not counted: it is the
        request's one state slot, which the other strategies hold as the committed cache."""
        if not self._ring:
            return 0
        cfg = self._ring_model.cfg
        return self.ring_size * cfg.num_kda_layers * self.bytes_per_token(LayerShape.from_config(cfg), self.elem_bytes())

    def poison(self, from_token: int) -> None:
        if not self.recording or not 1 <= from_token <= self._num_tokens:
            raise ValueError(f"from_token must be in [1, T = {self._num_tokens}] of a recorded verify, got {from_token}")
        idx = self._slots(self.commit_end + from_token, self.tail)
        for t in self._ring.values():
            t[idx] = float("nan")
        self._valid_tokens = from_token

    def check_integrity(self) -> None:
        """Counters ordered, pending within the window, held bytes equal the formula, and the caches the last
        commit returned equal the checkpoint plus a replay of the committed records, bitwise."""
        super().check_integrity()
        assert 0 <= self.head <= self.commit_end <= self.tail, "ReplaySSM counters out of order"
        assert self.tail - self.head <= self.ring_size, "ReplaySSM holds more records than slots"
        assert self.tail - self.commit_end <= self.window, "pending records exceed the window"
        assert self.recording or self.tail == self.commit_end, "pending records without a recorded verify"
        if self.recording:
            g = self._ring["g"][self._slots(self.commit_end, self.commit_end + self._valid_tokens)]
            assert bool((g <= 0).all()), "log decay g must be <= 0"
        if self._committed:
            for i, c in self.read_state(self.commit_end).items():
                assert torch.equal(c.recurrent, self._committed[i].recurrent) and \
                    torch.equal(c.conv, self._committed[i].conv), f"layer {i}: committed state differs from its replay"
