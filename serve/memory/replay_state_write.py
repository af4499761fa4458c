"""ReplaySSM as the decode-time state write of the batched engine (``ServeEngine(state_write="replay_ssm")``).

The way vllm#47572 / #48792 (GDN standard decode) and #48018 (Mamba2) use ReplaySSM for plain decode: a
request's state pages hold its CHECKPOINT (the recurrent state after its last materialisation) and its
conv window; a plain decode step appends one record ``(k, u, g)`` per KDA layer to the request's ring
instead of writing the ``H K V`` state back. The state a step starts from is the checkpoint with the
``m`` records replayed (:meth:`ReplayStateWrite.read`: ``S = exp(g_t) ⊙ S + k_t ⊗ u_t``, the op order of
``kda_core.kda._step``), so every token and logit is bitwise what the slot write gives.

When the state is materialised (the step's new state is written to the pages as the new checkpoint, the
ring emptied; vLLM's "flush", flashinfer#4815's materialise):

| when | why |
|---|---|
| the step would add the ``ring_size``-th record (``m = ring_size - 1``) | the periodic flush: one state write every ``ring_size`` decode steps |
| the engine publishes a prefix-cache checkpoint at this step | a published state must be in pages (vllm#55688: materialise before publishing) |

Abort, preemption (by recompute) and finish drop the ring with the request's state: nothing to
materialise; the freed ring is NaN-filled and its cursor reset, so a recycled ring inherits neither records
nor a cursor (the TRT-LLM#13453 review's stale ``cache_buf_idx``). Prefill and verify rows write the whole
state as before; the conv window is written every decode step ("ReplaySSM never touches the conv path",
vllm#47576). Rings live outside the page pool (:meth:`nbytes`); vllm#55688 counts them in the pool.

Ring ``r`` of the store holds ``ring_size - 1`` records per KDA layer, from position 0 after each
materialisation (no speculative tail survives a flush in plain decode, so the ring never wraps):

| position range | holds |
|---|---|
| ``[0, m)`` | the records since the checkpoint in the request's pages |
| ``[m, ring_size - 1)`` | stale records or NaN (never read) |

Bytes per decode step and KDA layer (fp32, ``s = 4``): record ``H (2K + V) s`` + conv window
``(2HK + HV)(W - 1) s``, plus the state ``H K V s`` on one step in ``ring_size``; the slot write writes
state + conv window every step (:func:`decode_write_bytes`).
"""
from __future__ import annotations

import torch

from kda_core import decode
from kda_core.config import ModelConfig
from serve.errors import check_int

FIELDS = ("k", "u", "g")


def decode_write_bytes(cfg: ModelConfig, ring_size: int | None, elem_bytes: int = 4) -> dict[str, float]:
    """Predicted bytes one plain decode step writes per request, whole model (all KDA layers): ``state``
    (recurrent ``H K V``, on average: every step for the slot write ``ring_size=None``, one step in
    ``ring_size`` for ReplaySSM), ``conv`` (window ``(2HK + HV)(W - 1)``, every step) and ``records``
    (``H (2K + V)`` per step but the materialising one). Raises ValueError for a bad ring_size."""
    L, H, K, V = cfg.num_kda_layers, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
    conv = L * cfg.conv_dim * (cfg.conv_kernel - 1) * elem_bytes
    state = L * H * K * V * elem_bytes
    if ring_size is None:
        return {"state": float(state), "conv": float(conv), "records": 0.0}
    R = check_int("ring_size", ring_size)
    return {"state": state / R, "conv": float(conv), "records": L * H * (2 * K + V) * elem_bytes * (R - 1) / R}


class ReplayStateWrite:
    """The rings of the running requests (one per request, allocated at its first plain decode step).

    Args:
        cfg: the model's :class:`ModelConfig` (KDA layers, H, K, V). ring_size: R >= 1 decode steps per
            state write (R = 1 writes the state every step, as the slot write does).

    Contract: :meth:`read` mutates only the states it is handed; :meth:`commit` appends records or
    materialises, :meth:`release` frees; a ring index is valid while its request holds it.
    Raises ValueError for a bad ring_size, or at :meth:`read` / :meth:`commit` for mismatched rows.
    """

    def __init__(self, cfg: ModelConfig, ring_size: int = 16):
        self.ring_size = check_int("ring_size", ring_size)
        self.layers = tuple(cfg.kda_layers)
        self.cfg = cfg                         # which form computes a step's decay exp(g) (kda_core.decode.decay)
        L, H, K, V = len(self.layers), cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
        self._shape = {"k": (H, K), "u": (H, V), "g": (H, K)}
        self._ring = {f: torch.full((L, ring_size - 1, 0, *self._shape[f]), float("nan")) for f in FIELDS}
        self._of: dict[int, int] = {}          # request id -> ring index
        self._count: dict[int, int] = {}       # request id -> m, records since its checkpoint
        self._free: list[int] = []
        self.num_materialisations = 0          # periodic and publish flushes together
        self.num_publish_materialisations = 0

    # ---- ownership --------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._ring["k"].shape[2]

    def records(self, rid: int) -> int:
        """m: records of request ``rid`` since its checkpoint (0 without a ring)."""
        return self._count.get(rid, 0)

    def _acquire(self, rid: int) -> int:
        if rid not in self._of:
            if not self._free:                                   # grow: double the rings, new ones NaN
                n = max(1, self.capacity)
                self._ring = {f: torch.cat([t, t.new_full((*t.shape[:2], n, *t.shape[3:]), float("nan"))], dim=2)
                              for f, t in self._ring.items()}
                self._free = list(range(self.capacity - 1, self.capacity - n - 1, -1))
            self._of[rid], self._count[rid] = self._free.pop(), 0
        return self._of[rid]

    def release(self, rid: int) -> None:
        """Free the request's ring (any status; no-op without one): NaN-filled, cursor reset."""
        r = self._of.pop(rid, None)
        if r is None:
            return
        for t in self._ring.values():
            t[:, :, r] = float("nan")
        del self._count[rid]
        self._free.append(r)

    def nbytes(self) -> int:
        """Bytes of the rings allocated (``L x (R - 1) x capacity x H (2K + V) x 4``)."""
        return sum(t.numel() * t.element_size() for t in self._ring.values())

    # ---- one step ---------------------------------------------------------------------------------
    def must_materialise(self, rid: int) -> bool:
        """Whether this step's record would be the ``ring_size``-th: the periodic flush."""
        return self.records(rid) + 1 >= self.ring_size

    @torch.no_grad()
    def read(self, rids: list[int], states: dict) -> None:
        """Replay each request's records onto its checkpoint, in place: ``states[layer]`` is
        ``[B, H, K, V]`` fp32 whose row j holds request ``rids[j]``'s checkpoint on entry and its current
        state on return (rows with no record untouched). Rows are replayed longest first, so step t runs
        on the prefix of rows with more than t records (one batched update per step, no masking)."""
        m = torch.tensor([self.records(r) for r in rids], dtype=torch.long)      # [B]
        if not m.numel() or int(m.max()) == 0:
            return
        order = torch.argsort(m, descending=True, stable=True)
        n_live = int((m > 0).sum())
        order = order[:n_live]                                                    # rows with records
        counts = m[order].tolist()
        rings = torch.tensor([self._of[rids[j]] for j in order.tolist()], dtype=torch.long)   # [n_live]
        rows_at = [sum(c > t for c in counts) for t in range(counts[0])]           # rows replaying record t
        for j, layer in enumerate(self.layers):
            S = states[layer].index_select(0, order)                               # [n_live, H, K, V]
            for t, n in enumerate(rows_at):
                k, u, g = (self._ring[f][j, t].index_select(0, rings[:n]) for f in FIELDS)  # [n, H, K] / [n, H, V]
                S[:n].mul_(decode.decay(self.cfg, g).unsqueeze(-1))                 # decay, as the step [n, H, K, V]
                S[:n].add_(k.unsqueeze(-1) * u.unsqueeze(-2))                        # rank-1 write [n, H, K, V]
            states[layer].index_copy_(0, order, S)

    def commit(self, rids: list[int], records: dict, materialise: list[bool], publish: list[bool]) -> None:
        """After the step: request ``rids[j]`` appends its record (``records[layer]`` = ``(k, u, g)``
        with row j) unless ``materialise[j]`` (its new state was written to its pages: the ring empties).
        ``publish[j]`` says a materialisation was forced by a checkpoint publish (counted apart)."""
        if not len(rids) == len(materialise) == len(publish):
            raise ValueError(f"rids, materialise and publish must have one entry per row, got "
                             f"{len(rids)}, {len(materialise)}, {len(publish)}")
        append = [j for j, mat in enumerate(materialise) if not mat]
        for j, rid in enumerate(rids):
            if materialise[j]:
                periodic = self.must_materialise(rid)
                self._acquire(rid)
                self._count[rid] = 0
                self.num_materialisations += 1
                self.num_publish_materialisations += bool(publish[j]) and not periodic
        if not append:
            return
        rings = torch.tensor([self._acquire(rids[j]) for j in append], dtype=torch.long)
        pos = torch.tensor([self._count[rids[j]] for j in append], dtype=torch.long)
        sel = torch.tensor(append, dtype=torch.long)
        for li, layer in enumerate(self.layers):
            for f, src in zip(FIELDS, records[layer]):
                self._ring[f][li].index_put_((pos, rings), src.index_select(0, sel))
        for j in append:
            self._count[rids[j]] += 1

    # ---- integrity --------------------------------------------------------------------------------
    def check_integrity(self, running) -> None:
        """Every ring belongs to a running request; ``0 <= m < ring_size``; the records ``[0, m)`` are
        finite with ``g <= 0``; rings in use + free = capacity; free rings are all NaN (AssertionError)."""
        running = set(running)
        assert set(self._of) <= running, f"rings of requests not running: {sorted(set(self._of) - running)}"
        assert set(self._of) == set(self._count), "ring owners and cursors disagree"
        assert len(self._of) + len(self._free) == self.capacity, "rings in use + free != capacity"
        assert len(set(self._of.values()) | set(self._free)) == self.capacity, "a ring is held twice"
        for rid, r in self._of.items():
            m = self._count[rid]
            assert 0 <= m < self.ring_size, f"request {rid}: {m} records in a ring of {self.ring_size}"
            for f, t in self._ring.items():
                assert bool(torch.isfinite(t[:, :m, r]).all()), f"request {rid}: non-finite {f} record"
            assert bool((self._ring["g"][:, :m, r] <= 0).all()), f"request {rid}: log decay g > 0"
        for r in self._free:
            assert all(bool(t[:, :, r].isnan().all()) for t in self._ring.values()), f"free ring {r} not NaN"
