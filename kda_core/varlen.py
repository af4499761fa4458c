"""Batched KDA over a state-slot pool: varlen chunked prefill, a slot-indexed decode step, and one
packed forward of :class:`kda_core.model.HybridLM` for a continuous-batching engine.

The batch is described as data first, as vLLM's metadata builders do
(``vllm/v1/attention/backends/gdn_attn.py``, ``mamba_attn.py``): decode rows first (one token each),
then prefill rows; ``query_start_loc`` (fla's ``cu_seqlens``) ``[N + 1]`` splits the packed tokens
into the N rows; ``slot_idx [N]`` names each row's state slot in the pools; ``has_initial_state [N]``
says whether the slot holds a state to continue (else the row starts from zeros).

A slot is an index, a row a position in this step's batch (mini-sglang's ``TableManager``, vLLM's
``ssm_state_indices``): each KDA layer's states live in a pool ``[S, ...]`` (:class:`LayerSlots`; the
engine's is a strided view of its page arena, slot = page id) and :func:`forward_batch` reads the live rows'
states from it by slot. It writes the new states back by slot (:func:`write_states`, one ``index_copy_``
per layer and piece) once every layer has run, or hands them to the caller (``write=False``,
:class:`StateWrite`) to write when it commits the step; no dense copy of the pool is made. A decode kernel
gets a layer's ``recurrent`` / ``conv`` pools and the decode rows' slots (``slot_idx``) and returns the new
states.

Rules every function here keeps:
- No chunk crosses a sequence: each prefill row runs :func:`kda_core.chunk.kda_chunk` on its own
  64-token grid from its own first token (fla's varlen ``chunk_kda`` does the same with
  ``cu_seqlens``), so the prefix-cache bitwise-warm rule holds per row.
- A pad row carries slot index ``-1`` and is skipped: its state is never read from a slot (it reads
  NaN, the way a ``torch.empty`` pad row reads garbage on a GPU engine) and never written. ``-1`` is
  never clamped to 0 (tokenspeed#700 clamped it and overwrote slot 0's live state).
- Batch invariance: every row's result is bitwise what the same row computes alone. Projections go
  through the row-invariant :mod:`kda_core.invariant` ops; every reduction of a row (conv window, the
  KDA step's ``S^T k``, MLA scores / softmax / ``P V``) runs over that row's data alone, in a fixed
  order, with the same shapes a batch-1 forward uses (vLLM's batch-invariant mode, same idea).

Shapes: N rows; T_total packed tokens; S slots; D model width; H, K, V as in :mod:`kda_core.kda`;
P pages, M MLA layers, NB tokens per KV block, R = kv_lora_rank + rope width (MLA latent).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kda_core import cpu_mla, decode_cpu
from kda_core.chunk import CHUNK_SIZE, kda_chunk
from kda_core.decode import kda_decode, why_not
from kda_core.invariant import linear
from kda_core.kda import _step
from kda_core.layer import KDAAux, KDACache, KDALayer, MLALayer, _block_causal_attention, latent_attention

PAD_SLOT = -1


# ---- slot gather / scatter ------------------------------------------------------------------------
def _check_slots(slot_idx: torch.Tensor, num_slots: int, name: str = "slot_idx", as_list: list | None = None) -> list:
    """Check ``slot_idx`` (``as_list``: its ``tolist()``, when the caller has it) and return it as a list."""
    if not isinstance(slot_idx, torch.Tensor) or slot_idx.dim() != 1 or slot_idx.dtype != torch.long:
        raise ValueError(f"{name} must be a 1-D int64 tensor, got "
                         f"{getattr(slot_idx, 'dtype', type(slot_idx).__name__)}")
    slots = slot_idx.tolist() if as_list is None else as_list
    live = [s for s in slots if s != PAD_SLOT]
    if live and (min(live) < 0 or max(live) >= num_slots):
        raise ValueError(f"{name} must hold slots in [0, {num_slots}) or {PAD_SLOT} (pad), got {slots}")
    if len(set(live)) != len(live):
        raise ValueError(f"{name} holds a live slot twice (TRT-LLM#13151: duplicate state indices): {slots}")
    return slots


def gather_slots(pool: torch.Tensor, slot_idx: torch.Tensor) -> torch.Tensor:
    """Rows of ``pool [S, ...]`` named by ``slot_idx [B]``; a pad row (``-1``) gets NaN, never slot 0.

    Returns a new tensor ``[B, ...]``. Raises ValueError for out-of-range or duplicate live slots."""
    r = _rows(slot_idx, pool.shape[0])
    return _gather(pool, r._replace(identity=False))


def scatter_slots(pool: torch.Tensor, slot_idx: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values [B, ...]`` into ``pool [S, ...]`` at ``slot_idx [B]`` in place; pad rows are
    skipped (never written). Raises ValueError for bad slots or shapes."""
    r = _rows(slot_idx, pool.shape[0])
    if values.shape[0] != slot_idx.shape[0] or values.shape[1:] != pool.shape[1:]:
        raise ValueError(f"values must have shape [B, *pool.shape[1:]] = {(slot_idx.shape[0],) + tuple(pool.shape[1:])}"
                         f", got {tuple(values.shape)}")
    _scatter(pool, r, values)


class _Rows(NamedTuple):
    """Precomputed gather / scatter indices of a set of rows (checked once per forward): ``rows`` the
    live rows' positions, ``slots`` their slots, ``n`` all rows, ``identity`` when every row is live and
    row j is slot j of a pool of exactly n slots (the engine's dense per-step pool: no copy needed)."""

    rows: torch.Tensor
    slots: torch.Tensor
    n: int
    identity: bool


def _rows(slot_idx: torch.Tensor, num_slots: int) -> _Rows:
    _check_slots(slot_idx, num_slots)
    live = (slot_idx != PAD_SLOT).nonzero().flatten()                    # [B_live]
    slots = slot_idx[live]
    n = slot_idx.shape[0]
    identity = live.numel() == n == num_slots and bool((slots == torch.arange(n)).all())
    return _Rows(live, slots, n, identity)


def _gather(pool: torch.Tensor, r: _Rows) -> torch.Tensor:
    """The rows' states ``[n, ...]`` fp32 read from ``pool [S, ...]`` by slot (a 16-bit pool upcast exactly);
    a pad row gets NaN, never slot 0. ``pool`` may be a strided view (the page arena): only the live rows'
    slots are read."""
    if r.identity:
        return pool.float()
    if r.rows.numel() == r.n:                                            # no pad row: one read, no NaN fill
        return pool.index_select(0, r.slots).float()
    out = pool.new_full((r.n,) + tuple(pool.shape[1:]), float("nan"), dtype=torch.float32)  # pad rows: NaN
    if r.rows.numel():
        out[r.rows] = pool.index_select(0, r.slots).float()
    return out


def _scatter(pool: torch.Tensor, r: _Rows, values: torch.Tensor) -> None:
    """Write the live rows of ``values [n, ...]`` into ``pool`` at their slots, in place (rounded to nearest
    into a 16-bit pool); pad rows are never written."""
    if r.identity:
        pool.copy_(values)
    elif r.rows.numel() == r.n:
        pool.index_copy_(0, r.slots, values.to(pool.dtype))
    elif r.rows.numel():
        pool.index_copy_(0, r.slots, values[r.rows].to(pool.dtype))


def _initial(pool: torch.Tensor, slot: int, has_initial: bool) -> torch.Tensor:
    """One row's initial state ``[1, ...]`` fp32: a copy of the slot's (upcast exactly), or zeros for a row
    that starts a sequence (its slot is then not read)."""
    if has_initial:
        return pool[slot: slot + 1].to(torch.float32, copy=True, memory_format=torch.contiguous_format)
    return torch.zeros((1,) + tuple(pool.shape[1:]), dtype=torch.float32)


# ---- the two KDA kernels by slot ------------------------------------------------------------------
def kda_decode_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state_pool: torch.Tensor, slot_idx: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One KDA token for each of B rows, reading and writing each row's state in ``state_pool`` BY SLOT.

    Args:
        q, k ``[B, H, K]``; v ``[B, H, V]``; g ``[B, H, K]`` (log decay); beta ``[B, H]``;
        state_pool ``[S, H, K, V]`` fp32, mutated in place at the live rows' slots;
        slot_idx ``[B]`` int64, ``-1`` = pad row (reads NaN, writes nothing); scale defaults to ``K ** -0.5``.

    Returns:
        o ``[B, H, V]`` fp32 (pad rows: garbage, to be dropped). Each live row is bitwise
        :func:`kda_core.kda.kda_step` of that row alone.

    Raises:
        ValueError: bad slots (out of range, duplicated) or shapes.
    """
    if q.dim() != 3 or state_pool.dim() != 4 or state_pool.shape[1:3] != q.shape[1:]:
        raise ValueError(f"q must be [B, H, K] and state_pool [S, H, K, V] with the same H, K; got "
                         f"{tuple(q.shape)}, {tuple(state_pool.shape)}")
    if slot_idx.shape[0] != q.shape[0]:
        raise ValueError(f"slot_idx must have B = {q.shape[0]} entries, got {slot_idx.shape[0]}")
    r = _rows(slot_idx, state_pool.shape[0])
    o, state, _ = _decode(q, k, v, g, beta, state_pool, r, scale)
    _scatter(state_pool, r, state)
    return o


def _decode(q, k, v, g, beta, state_pool, r: _Rows, scale=None):
    """One step by slot, reading ``state_pool`` (not writing it); returns ``(o [B, H, V], new state
    [B, H, K, V] fp32 (pad rows: NaN), record)`` with record = ``(k [B, H, K], u [B, H, V], g [B, H, K])`` fp32,
    the exact operands of the step's rank-1 write and decay (a ReplaySSM record)."""
    S = _gather(state_pool, r)                                           # [B, H, K, V]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    o, S, u = _step(q, k, v, g, beta, S, scale)
    return o, S, (k, u, g)


def kda_varlen_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       query_start_loc: torch.Tensor, state_pool: torch.Tensor, slot_idx: torch.Tensor,
                       has_initial_state: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Chunked KDA over N packed sequences; no chunk crosses a sequence.

    Args:
        q, k ``[1, T_total, H, K]``; v ``[1, T_total, H, V]``; g ``[1, T_total, H, K]``; beta
        ``[1, T_total, H]``; query_start_loc ``[N + 1]`` int64 (cu_seqlens, 0 first, T_total last);
        state_pool ``[S, H, K, V]`` fp32, mutated at the live rows' slots (final state of each row);
        slot_idx ``[N]`` (``-1`` = pad: skipped entirely, its output rows are zeros);
        has_initial_state ``[N]`` bool: continue from the slot's state, else from zeros.

    Returns:
        o ``[1, T_total, H, V]``; row i's tokens are bitwise :func:`kda_chunk` of that row alone.

    Raises:
        ValueError: bad cu_seqlens, slots or shapes (and :func:`kda_chunk`'s errors for a live row).
    """
    _check_cu(query_start_loc, q.shape[1], slot_idx.shape[0])
    _check_slots(slot_idx, state_pool.shape[0])
    o = v.new_zeros(v.shape, dtype=torch.float32)
    bounds = query_start_loc.tolist()
    for i, slot in enumerate(slot_idx.tolist()):
        a, b = bounds[i], bounds[i + 1]
        if slot == PAD_SLOT or a == b:
            continue
        s0 = _initial(state_pool, slot, bool(has_initial_state[i]))
        res = kda_chunk(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], s0, chunk_size=chunk_size)
        o[:, a:b] = res.o
        state_pool[slot] = res.final_state[0]
    return o


def _check_cu(cu: torch.Tensor, total: int, n: int) -> list:
    """Check ``cu`` (query_start_loc) and return it as a list."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.shape[0] != n + 1:
        raise ValueError(f"query_start_loc must be a 1-D tensor of N + 1 = {n + 1} offsets, got "
                         f"{getattr(cu, 'shape', type(cu).__name__)}")
    c = cu.tolist()
    if c[0] != 0 or c[-1] != total or any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"query_start_loc must rise from 0 to T_total = {total}, got {c}")
    return c


# ---- the packed model forward ---------------------------------------------------------------------
class BatchMeta(NamedTuple):
    """One step's batch as plain data (decode rows first, then prefill rows).

    query_start_loc ``[N + 1]`` int64: row i owns packed tokens ``[qsl[i], qsl[i+1])``; a decode row has
    one token. num_decode: rows ``[0, num_decode)`` are decode rows (pad rows included; they run the
    exact token-by-token maths), the rest prefill rows (chunk maths). slot_idx ``[N]`` int64: state slot
    of each row in the KDA pools, ``-1`` = pad row. has_initial_state ``[N]`` bool. context_lens: per row,
    tokens its cache already holds (its first new token's position). block_tables: per row, the pages of
    its MLA latents (block j holds positions ``[j NB, (j + 1) NB)``). state_at: per row, offsets t in
    ``(0, T_row)`` after which every KDA layer's state is also returned (prefix-cache checkpoints).
    num_verify: rows ``[num_decode, num_decode + num_verify)`` are verify rows of speculative decoding
    (``1 + n`` tokens each, the exact token-by-token maths, with the per-token aux the rollback
    strategies record); the rest are prefill rows.
    """

    query_start_loc: torch.Tensor
    num_decode: int
    slot_idx: torch.Tensor
    has_initial_state: torch.Tensor
    context_lens: tuple
    block_tables: tuple
    state_at: tuple
    num_verify: int = 0


class VerifyRow(NamedTuple):
    """What a verify row (speculative decoding) returns, as ``model.forward(mode="recurrent",
    output_aux=True)`` of that row alone would: logits ``[1, T, 256]``, the cache after its T tokens
    (``layers[i]``: a :class:`KDACache` or the MLA latents ``[1, L + T, R]``), aux ``{layer: KDAAux}``."""

    logits: torch.Tensor
    layers: dict
    aux: dict


class BatchOutput(NamedTuple):
    """logits ``[N, 256]`` fp32: each row's logits at its last new token (pad rows: garbage);
    states_at: ``{row: {t: {layer: KDACache [1, ...]}}}`` for the rows that asked; verify:
    ``{row: VerifyRow}`` for the verify rows; decode_records (when asked): ``{layer: (k [nd, H, K],
    u [nd, H, V], g [nd, H, K])}`` fp32 of the decode rows (pad rows included, last), the ReplaySSM record
    of each row's step (``u = beta (v - S'^T k)``, vllm#47576), bitwise the operands of its state update;
    state_writes (``forward_batch(write=False)``): ``{layer: [StateWrite]}``, the new KDA states for
    :func:`write_states` (None when the forward wrote them)."""

    logits: torch.Tensor
    states_at: dict
    verify: dict = {}
    decode_records: dict | None = None
    state_writes: dict | None = None


class LayerSlots(NamedTuple):
    """One KDA layer's state storage and each row's slot in it (vLLM's ``ssm_state_indices``).

    recurrent ``[S, H, K, V]`` (fp32, or bf16 / fp16: read upcast exactly, written rounded to nearest) and conv
    ``[S, 2HK + HV, W-1]`` fp32: S slots, each possibly a strided view whose stride(0) is a page of the engine's
    arena (slot = page id). slot_idx ``[N]`` int64: row i's slot, ``-1`` for a pad row (the same rows as
    :attr:`BatchMeta.slot_idx`); None: use :attr:`BatchMeta.slot_idx`. Layers of one page group share one
    slot_idx tensor."""

    recurrent: torch.Tensor
    conv: torch.Tensor
    slot_idx: torch.Tensor | None = None


class StateWrite(NamedTuple):
    """New KDA states of the consecutive rows ``[first_row, first_row + n)`` of a batch, for one layer:
    recurrent ``[n, H, K, V]`` and conv ``[n, 2HK + HV, W-1]`` fp32 (a pad row's entries are garbage and never
    written). Written at the rows' slots by :func:`write_states`."""

    first_row: int
    recurrent: torch.Tensor
    conv: torch.Tensor


class SlotPools(NamedTuple):
    """Where a batch's caches live. kda: ``{layer: LayerSlots}`` (a plain ``(recurrent, conv)`` pair is
    ``LayerSlots(recurrent, conv)``), read and written at live slots only; kv_cache: ``[P, M, NB, R]`` paged MLA
    latents (the pool's arena viewed typed), mutated at the new tokens' positions of live rows."""

    kda: dict
    kv_cache: torch.Tensor


def write_states(pools: SlotPools, meta: BatchMeta, writes: dict, keep: torch.Tensor | None = None) -> None:
    """Write a forward's new KDA states (:attr:`BatchOutput.state_writes`, ``{layer: [StateWrite]}``) into
    ``pools`` in place, each live row at its slot (one ``index_copy_`` per layer and piece; a 16-bit recurrent
    pool rounded to nearest). Pad rows (slot ``-1``) are never written, never clamped to slot 0.

    keep ``[N]`` bool: write only these rows (None: every live row). Raises ValueError for bad slots (before any
    write). fp32 pieces into fp32 pools go in one C copy per slot group and piece (:func:`kda_core.decode_cpu.
    write_slots`) where the library is loaded; the rest by ``index_copy_``."""
    targets, copies = {}, {}                                              # per slot tensor and piece: where to
    for li, pieces in writes.items():
        ls = _layer_slots(pools.kda[li])
        idx = meta.slot_idx if ls.slot_idx is None else ls.slot_idx
        if (id(idx), ls.recurrent.shape[0]) not in targets:
            _check_slots(idx, ls.recurrent.shape[0])
            targets[id(idx), ls.recurrent.shape[0]] = {}
        where = targets[id(idx), ls.recurrent.shape[0]]
        for w in pieces:
            key = (w.first_row, w.recurrent.shape[0])
            if key not in where:                                          # same rows in every layer of a group
                where[key] = _write_target(idx, keep, *key)
            t = where[key]
            if t is None:
                continue
            for pool, rows in ((ls.recurrent, w.recurrent), (ls.conv, w.conv)):
                if decode_cpu.copyable(pool, rows):                       # in one C copy below
                    copies.setdefault(id(t), (t, key[1], []))[2].append((pool, rows))
                    continue
                slots, live = t
                rows = rows if live is None else rows[live]
                pool.index_copy_(0, slots, rows if rows.dtype is pool.dtype else rows.to(pool.dtype))
    for (slots, live), n, pairs in copies.values():
        row_slots = slots.tolist() if live is None else [PAD_SLOT] * n  # row i -> its slot, -1: not written
        if live is not None:
            for i, s in zip(live.tolist(), slots.tolist()):
                row_slots[i] = s
        decode_cpu.write_slots(row_slots, pairs)


def _write_target(idx: torch.Tensor, keep: torch.Tensor | None, first: int, n: int):
    """Rows ``[first, first + n)``: ``(slots [n'], live rows [n'] or None when all n are written)``, or None when
    none is (pad rows and rows not kept)."""
    slots = idx[first: first + n]                                         # [n]
    if keep is None and PAD_SLOT not in slots.tolist():                   # every row written: no mask op
        return slots, None
    sel = slots != PAD_SLOT
    if keep is not None:
        sel &= keep[first: first + n]
    if bool(sel.all()):
        return slots, None
    live = sel.nonzero().flatten()                                        # [n']
    return (slots[live], live) if live.numel() else None


def _layer_slots(entry) -> LayerSlots:
    return entry if isinstance(entry, LayerSlots) else LayerSlots(*entry)


def make_meta(row_lens, num_decode: int, slot_idx, has_initial_state, context_lens, block_tables,
              state_at=None, num_verify: int = 0) -> BatchMeta:
    """Build a :class:`BatchMeta` from per-row Python lists (``row_lens``: new tokens per row).
    Raises ValueError if a decode row does not have exactly one token or the lists disagree in length."""
    n = len(row_lens)
    for name, x in (("slot_idx", slot_idx), ("has_initial_state", has_initial_state),
                    ("context_lens", context_lens), ("block_tables", block_tables)):
        if len(x) != n:
            raise ValueError(f"{name} must have one entry per row ({n}), got {len(x)}")
    if not 0 <= num_decode <= n or any(t != 1 for t in row_lens[:num_decode]) or any(t < 1 for t in row_lens):
        raise ValueError(f"rows [0, num_decode={num_decode}) must have 1 token and every row >= 1, got {list(row_lens)}")
    if num_decode == n:                                                   # one token per row
        qsl = torch.arange(n + 1)
    else:
        qsl = torch.zeros(n + 1, dtype=torch.long)
        qsl[1:] = torch.tensor(list(row_lens), dtype=torch.long).cumsum(0)
    slot_idx = slot_idx.to(torch.long, copy=True) if isinstance(slot_idx, torch.Tensor) else \
        torch.tensor(list(slot_idx), dtype=torch.long)                    # (a tensor: no 0-d tensor per row)
    return BatchMeta(qsl, num_decode, slot_idx,
                     torch.tensor(list(has_initial_state), dtype=torch.bool), tuple(context_lens),
                     tuple(tuple(t) for t in block_tables), tuple(state_at or ((),) * n), num_verify)


def read_latents(kv_cache: torch.Tensor, m_idx: int, block_table, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` latents ``[1, num_tokens, R]`` of MLA layer ``m_idx`` through a block table."""
    _, _, NB, R = kv_cache.shape
    nb = -(-num_tokens // NB)
    if nb == 0:
        return kv_cache.new_zeros(1, 0, R)
    blocks = kv_cache.index_select(0, torch.as_tensor(list(block_table[:nb]), dtype=torch.long))  # [nb, M, NB, R]
    return blocks[:, m_idx].reshape(1, nb * NB, R)[:, :num_tokens]      # [1, num_tokens, R]


def _write_latents(kv_cache: torch.Tensor, m_idx: int, pages: torch.Tensor, offs: torch.Tensor,
                   lat: torch.Tensor) -> None:
    """Write latents ``[T_live, R]`` at (page, offset) pairs (the slot mapping) of MLA layer ``m_idx``."""
    if pages.numel():
        kv_cache.select(1, m_idx).index_put_((pages, offs), lat)


def _slot_mapping(meta: BatchMeta, block_size: int):
    """Per live new token: its page and offset (vLLM's ``slot_mapping``), and which packed tokens are live."""
    pages, offs, live = [], [], []
    qsl = meta.query_start_loc.tolist()
    for i, slot in enumerate(meta.slot_idx.tolist()):
        if slot == PAD_SLOT:
            continue
        for j in range(qsl[i + 1] - qsl[i]):
            p = meta.context_lens[i] + j
            pages.append(meta.block_tables[i][p // block_size])
            offs.append(p % block_size)
            live.append(qsl[i] + j)
    as_t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return as_t(pages), as_t(offs), as_t(live)


def _positions(meta: BatchMeta, qsl: list):
    """Per packed token: its position in its sequence ``[T_total]`` int64 and whether its row is a pad row
    ``[T_total]`` bool; built with no loop over rows (all-decode steps: the context lengths themselves)."""
    ctx = torch.tensor(meta.context_lens, dtype=torch.long)               # [N]
    pad_row = meta.slot_idx == PAD_SLOT                                   # [N]
    if qsl == list(range(len(qsl))):                                      # one token per row
        return ctx, pad_row
    lens = meta.query_start_loc.diff()                                    # [N] new tokens per row
    row = torch.repeat_interleave(torch.arange(ctx.shape[0]), lens)       # [T_total] row of each token
    return ctx[row] + torch.arange(qsl[-1]) - meta.query_start_loc[row], pad_row[row]


@torch.no_grad()
def forward_batch(model, tokens: torch.Tensor, meta: BatchMeta, pools: SlotPools,
                  decode_records: bool = False, write: bool = True) -> BatchOutput:
    """One forward of ``model`` (:class:`HybridLM`) over a mixed batch of decode and prefill rows.

    Args:
        model: the HybridLM. tokens ``[T_total]`` int64 packed new tokens (pad rows: any id; their
            hidden states are NaN from the embedding on, as a ``torch.empty`` pad row on a GPU).
        meta: the :class:`BatchMeta`. pools: the :class:`SlotPools`; each KDA layer's states are read by slot
            in place (only the live rows' slots), its latents written in place at the new tokens' positions.
        decode_records: also return each decode row's ReplaySSM record per KDA layer
            (:attr:`BatchOutput.decode_records`).
        write: write the new KDA states into their slots once every layer has run (:func:`write_states`), so
            a forward that raises writes no state; False: write none and return them
            (:attr:`BatchOutput.state_writes`) for the caller to write later (the engine does at commit, so a
            row it drops or probes writes nothing).

    Returns:
        :class:`BatchOutput`. Each live row's logits, states and latents are bitwise those of
        ``model.forward`` on that row alone (``mode="recurrent"`` for decode rows, ``"chunk"`` for prefill
        rows, from the same cache): the engine's batch-1 path.

    Raises:
        ValueError: malformed metadata (see :func:`make_meta`), bad slots, tokens not in [0, 255].
    """
    cfg = model.cfg
    n = meta.slot_idx.shape[0]
    total = tokens.shape[0]
    qsl = _check_cu(meta.query_start_loc, total, n)
    ids = (tokens if tokens.dim() == 1 else tokens.flatten()).tolist()   # one op, not a min and a max
    if ids and (min(ids) < 0 or max(ids) >= cfg.vocab_size):
        raise ValueError(f"tokens must be ids in [0, {cfg.vocab_size - 1}]")
    slots = meta.slot_idx.tolist()
    NB = pools.kv_cache.shape[2]
    tok_map = None                                     # (positions, slot mapping): built when a layer needs them
    x = model.embed[tokens].unsqueeze(0)                                  # [1, T_total, D] (a copy: indexed)
    if PAD_SLOT in slots:
        x[0, _positions(meta, qsl)[1]] = float("nan")
    states_at = {i: {t: {} for t in meta.state_at[i]} for i in range(n) if meta.state_at[i]}
    verify = {i: VerifyRow(None, {}, {}) for i in range(meta.num_decode, meta.num_decode + meta.num_verify)}
    kda = {li: _layer_slots(e) for li, e in pools.kda.items()}
    if not kda:
        _check_slots(meta.slot_idx, n, as_list=slots)                     # no KDA layer: slots index nothing
    by_slots = _slot_lists(kda, meta, slots)                             # {layer: its slots as a list}
    writes = {}
    mla_index = {layer: j for j, layer in enumerate(cfg.mla_layers)}
    packed = _pack_latents(meta, qsl, slots, pools.kv_cache) if cfg.mla_layers else None
    records = {} if decode_records else None
    decode_only = meta.num_decode == n > 0
    norms = model.norm1.unbind(0) if decode_only else None               # L x [D]: the input norms' weights
    x_rows = x[0]                                                         # [T_total, D]: a view of x
    for li, m in enumerate(model.mixers):
        got = None
        if decode_only:                                                    # the whole sublayer in one C call
            if isinstance(m, KDALayer):
                got = _kda_decode_block(m, x_rows, norms[li], cfg.rms_norm_eps, meta, kda[li], records, li)
                if got is not None:
                    writes[li] = got
            else:
                got = _mla_decode_block(m, x_rows, norms[li], cfg.rms_norm_eps, pools.kv_cache, mla_index[li],
                                        packed)
        if got is None:
            h = model.input_norm(li, x)
            if isinstance(m, KDALayer):
                writes[li] = []
                y = _kda_layer(m, h, meta, qsl, by_slots[li], kda[li], states_at, li, verify, records, writes[li])
            else:
                if tok_map is None:
                    tok_map = (_positions(meta, qsl)[0], *_slot_mapping(meta, NB))
                y = _mla_layer(m, h, meta, qsl, slots, tok_map[0], pools.kv_cache, mla_index[li], *tok_map[1:],
                               packed, verify, li)
            x += y                                                         # x is this forward's own tensor
        y = model.feed_forward(li, x)
        if y is not x:                                                     # (not written in place)
            x, x_rows = y, y[0]
    if qsl == list(range(n + 1)):                                          # one token per row: every token is last
        logits = model.head(x_rows)                                        # [N, vocab]
    else:
        logits = model.head(x[0, meta.query_start_loc[1:] - 1])            # [N, vocab] each row's last token
    for i in verify:
        rows = x[:, qsl[i]: qsl[i + 1]]                                    # [1, T, D]
        verify[i] = verify[i]._replace(logits=model.head(rows))             # [1, T, vocab]
    if write:
        write_states(SlotPools(kda, pools.kv_cache), meta, writes)
    return BatchOutput(logits, states_at, verify, records, None if write else writes)


def _slot_lists(kda: dict, meta: BatchMeta, meta_slots: list) -> dict:
    """Per KDA layer its rows' slots as a list, each distinct slot tensor checked once (:func:`_check_slots`; pad
    rows where ``meta.slot_idx`` has them, ``meta_slots`` its list). Raises ValueError for bad slots."""
    out, seen = {}, {}
    for li, ls in kda.items():
        idx = meta.slot_idx if ls.slot_idx is None else ls.slot_idx
        key = (id(idx), ls.recurrent.shape[0])
        if key not in seen:
            same = idx is meta.slot_idx
            slots = _check_slots(idx, ls.recurrent.shape[0], as_list=meta_slots if same else None)
            if not same and (len(slots) != len(meta_slots) or any(
                    (a == PAD_SLOT) != (b == PAD_SLOT) for a, b in zip(slots, meta_slots))):
                raise ValueError(f"a layer's slot_idx must mark the pad rows of meta.slot_idx with {PAD_SLOT}, got "
                                 f"{slots} for {meta_slots}")
            seen[key] = slots
        out[li] = seen[key]
    return out


def _kda_decode_block(m: KDALayer, x, norm, eps: float, meta: BatchMeta, pool: LayerSlots, records: dict | None,
                      li: int) -> list | None:
    """An all-decode batch's KDA sublayer, ``x [N, D] += o_proj(layer(input_norm(x)))`` in place, in one C call
    (:func:`kda_core.decode_cpu.block`: bitwise :func:`_kda_layer` and the add) where it runs; returns the rows' new
    states (one :class:`StateWrite`, nothing written to the pools) and puts the records in ``records[li]``. None
    (nothing done) where it does not run: then the caller runs :func:`_kda_layer`."""
    rec_pool, conv_pool = pool.recurrent, pool.conv
    gemm = decode_cpu.block_runs(rec_pool, conv_pool)
    if gemm is None or norm.dtype is not torch.float32 or not norm.is_contiguous() or why_not(m, x) is not None:
        return None
    cfg, nd = m.cfg, x.shape[0]
    idx = meta.slot_idx if pool.slot_idx is None else pool.slot_idx
    state = x.new_empty(nd, cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim)   # [nd, H, K, V] new states
    conv = x.new_empty(nd, cfg.conv_dim, cfg.conv_kernel - 1)                # [nd, D_conv, W-1]
    recs = decode_cpu.block(gemm, m, x, norm, eps, rec_pool, conv_pool, idx.contiguous(), (state, conv),
                            records is not None)
    if records is not None:
        records[li] = recs                                                # [nd, H, K], [nd, H, V], [nd, H, K]
    return [StateWrite(0, state, conv)]


def _mla_decode_block(m: MLALayer, x, norm, eps: float, kv_cache, m_idx: int, packed: _Packed) -> bool | None:
    """An all-decode batch's MLA sublayer, ``x [N, D] += layer(input_norm(x))`` in place, in one C call
    (:meth:`kda_core.cpu_mla.CMLA.decode_residual`: bitwise :func:`_mla_layer` and the add) where it runs: True;
    None (nothing done) where it does not."""
    c = cpu_mla.runs(x, kv_cache, m.kv_b)
    if c is None or not m.cfg.mla_use_nope or norm.dtype is not torch.float32 or not norm.is_contiguous():
        return None
    c.decode_residual(m, x, norm, eps, kv_cache.select(1, m_idx), packed.queries.qm, packed.queries.pages)
    return True


def _kda_layer(m: KDALayer, h, meta: BatchMeta, qsl, slots, pool: LayerSlots, states_at, li,
               verify, records: dict | None, writes: list):
    """One KDA layer over the batch: reads each live row's state from ``pool`` by its slot (``slots``, a list,
    ``-1`` = pad) and appends the rows' new states to ``writes`` (:class:`StateWrite`; nothing is written here).

    One input GEMM over every token (:meth:`KDALayer.project_inputs`); the decode rows in one
    :func:`kda_core.decode.kda_decode` call and each verify row in one (the fused C form where it runs: the same
    per-token code, so verify == decode bitwise, and as ``KDALayer.forward(mode="recurrent")``); the prefill rows'
    gates, chunked KDA and gated norm in torch; one o_proj GEMM over every token."""
    cfg = m.cfg
    H, V, HV = cfg.num_heads, cfg.head_v_dim, cfg.num_heads * cfg.head_v_dim
    rec_pool, conv_pool = pool.recurrent, pool.conv
    idx = meta.slot_idx if pool.slot_idx is None else pool.slot_idx
    ins = m.project_inputs(h[0])                                          # raw, f_low, b, g_low [T_total, *]
    nd, n_dv = meta.num_decode, meta.num_decode + meta.num_verify
    y_parts = []                                                          # o_proj's input, [tokens, H V] each
    if nd:                                                                # read by slot (kda_core.decode)
        state = h.new_empty(nd, H, cfg.head_k_dim, V)                     # [nd, H, K, V] new states
        conv = h.new_empty(nd, cfg.conv_dim, cfg.conv_kernel - 1)         # [nd, D_conv, W-1]
        res = kda_decode(m, *(ins if nd == qsl[-1] else (t[:nd] for t in ins)), rec_pool, conv_pool,
                         idx if nd == idx.shape[0] else idx[:nd], check=False, out=(state, conv),
                         records=records is not None)                     # slots checked once per forward
        if records is not None:
            records[li] = (res.k, res.u, res.g)                           # [nd, H, K], [nd, H, V], [nd, H, K]
        writes.append(StateWrite(0, state, conv))                         # written by slot at commit
        y_parts.append(res.y)                                             # [nd, H V]
    if nd == len(slots):                                                  # decode rows only
        return linear(y_parts[0], m.o_proj).unsqueeze(0)                  # [1, nd, D]
    raw, f_low, b_in, g_low = (t.unsqueeze(0) for t in ins)               # [1, T_total, *]
    for i in range(nd, n_dv):                                             # as KDALayer.forward(mode="recurrent", aux)
        a, b = qsl[i], qsl[i + 1]
        if slots[i] == PAD_SLOT:
            y_parts.append(raw.new_zeros(b - a, HV))
            continue
        if bool(meta.has_initial_state[i]):
            src, slot = (rec_pool, conv_pool), idx[i: i + 1]
        else:                                                             # starts from zeros: its slot is not read
            src, slot = (_initial(rec_pool, 0, False), _initial(conv_pool, 0, False)), idx.new_zeros(1)
        state, conv = torch.empty((1,) + rec_pool.shape[1:]), torch.empty((1,) + conv_pool.shape[1:])
        res = kda_decode(m, raw[:, a:b], f_low[:, a:b], b_in[:, a:b], g_low[:, a:b], *src, slot, check=False,
                         out=(state, conv), aux=True)
        verify[i].layers[li] = KDACache(state, conv)                      # [1, H, K, V], [1, D_conv, W-1]
        verify[i].aux[li] = KDAAux(h[:, a:b], raw[:, a:b], res.q, res.k, res.v, res.g, res.beta, res.states, res.u)
        writes.append(StateWrite(i, state, conv))
        y_parts.append(res.y[0])                                          # [T, H V]
    if n_dv < len(slots):
        y_parts.append(_kda_prefill(m, raw, f_low, b_in, g_low, meta, qsl, slots, rec_pool, conv_pool, states_at, li,
                                    writes))
    y = y_parts[0] if len(y_parts) == 1 else torch.cat(y_parts)          # [T_total, H V]
    return linear(y.unsqueeze(0), m.o_proj)                               # [1, T_total, D]


def _kda_prefill(m: KDALayer, raw, f_low, b_in, g_low, meta: BatchMeta, qsl, slots, rec_pool, conv_pool, states_at,
                 li, writes: list) -> torch.Tensor:
    """The prefill rows (after the decode and verify rows) of one KDA layer, each as ``KDALayer.forward(mode=
    "chunk")`` of that row alone: gates, conv, :func:`kda_chunk` on its own 64-token grid, the ``state_at``
    checkpoints, the gated norm. Returns o_proj's input ``[T_pre, H V]`` of their tokens."""
    off = qsl[meta.num_decode + meta.num_verify]                          # the first prefill token
    g, beta, out_gate = m.gates(f_low[:, off:], b_in[:, off:], g_low[:, off:])   # [1, T_pre, *]
    C, W1 = CHUNK_SIZE, m.cfg.conv_kernel - 1
    o_parts = []
    for i in range(meta.num_decode + meta.num_verify, len(slots)):
        a, b = qsl[i], qsl[i + 1]
        ga, gb = a - off, b - off
        slot = slots[i]
        if slot == PAD_SLOT:
            o_parts.append(g.new_zeros(1, b - a, m.cfg.num_heads, m.cfg.head_v_dim))
            continue
        has = bool(meta.has_initial_state[i])
        rec0, conv0 = _initial(rec_pool, slot, has), _initial(conv_pool, slot, has)
        q, k, v, conv = m.activate(raw[:, a:b], conv0)
        o, state, hs = kda_chunk(q, k, v, g[:, ga:gb], beta[:, ga:gb], rec0, chunk_size=C)
        for t in meta.state_at[i]:                                        # as KDALayer.forward(state_at=...)
            s0 = t // C * C
            rec = hs[:, t // C].clone()
            if t > s0:
                part = slice(s0, t)
                rec = kda_chunk(q[:, part], k[:, part], v[:, part], g[:, ga:gb][:, part], beta[:, ga:gb][:, part],
                                rec, chunk_size=C).final_state
            full = torch.cat([conv0, raw[:, a:b].transpose(1, 2)], dim=-1)  # [1, D_conv, W-1+T]
            states_at[i][t][li] = KDACache(rec, full[..., t: t + W1].clone())
        writes.append(StateWrite(i, state, conv))                         # [1, H, K, V], [1, D_conv, W-1]
        o_parts.append(o)
    o = o_parts[0] if len(o_parts) == 1 else torch.cat(o_parts, dim=1)    # [1, T_pre, H, V]
    return m.gated_norm(o, out_gate)[0].flatten(1)                        # [T_pre, H V]


class _Packed(NamedTuple):
    """Where every row's MLA latents ``[0, L_i + T_i)`` sit in one packed ``[sum_i (L_i + T_i), R]`` tensor:
    row i at ``[start[i], start[i] + L_i + T_i)``; cached positions gathered from (old_page, old_off) to
    old_dst (live rows only: a pad row's cached part stays NaN), new tokens from packed token new_src to new_dst.
    None but ``queries`` where no row needs the packed tensor (every row a decode row, read in place by the C
    absorbed attention). ``queries``: the decode and verify tokens' latent runs for that attention."""

    start: list | None
    total: int | None
    old_page: torch.Tensor | None
    old_off: torch.Tensor | None
    old_dst: torch.Tensor | None
    new_src: torch.Tensor | None
    new_dst: torch.Tensor | None
    queries: _Queries


class _Queries(NamedTuple):
    """The latent run of every decode and verify token (Q of them, in packed token order), as
    :meth:`kda_core.cpu_mla.CMLA.attend_paged` and ``decode`` read it: ``qm [6, Q]`` int64 = (start of its row's
    block table in ``pages``, cached latents read from the pages, its row's first new token, latents read, the page
    and offset its own latent is written to: -1 and 0 for a pad row), ``pages`` the decode and verify rows' block
    tables, concatenated. Token t of row i reads its L_i cached latents then new tokens
    ``[qsl[i], qsl[i] + t]``; a pad row reads only its own new (NaN) tokens."""

    qm: torch.Tensor
    pages: torch.Tensor


def _queries(meta: BatchMeta, qsl, slots, NB: int) -> _Queries:
    cols, pages = [], []
    for i in range(meta.num_decode + meta.num_verify):
        live = slots[i] != PAD_SLOT
        L = meta.context_lens[i] if live else 0
        start = len(pages)
        pages.extend(meta.block_tables[i][: -(-L // NB)])
        for t in range(qsl[i + 1] - qsl[i]):                              # where its own latent is written
            page, off = (meta.block_tables[i][(L + t) // NB], (L + t) % NB) if live else (PAD_SLOT, 0)
            cols.append((start, L, qsl[i], L + t + 1, page, off))
    qm = torch.tensor(cols, dtype=torch.long).view(-1, 6).T.contiguous()  # [6, Q]
    return _Queries(qm, torch.tensor(pages, dtype=torch.long))


def _pack_latents(meta: BatchMeta, qsl, slots, kv_cache: torch.Tensor, full: bool = False) -> _Packed:
    """Index tensors of :class:`_Packed`, built once per forward from the block tables (vectorised per block); those
    of the packed tensor only where a row needs it (``full``, a verify or prefill row, or no C absorbed attention
    for this cache)."""
    NB = kv_cache.shape[2]
    queries = _queries(meta, qsl, slots, NB)
    if not full and meta.num_decode == len(slots) and cpu_mla.runs(kv_cache) is not None:
        return _Packed(None, None, None, None, None, None, None, queries)
    starts, pages, dsts, counts, total = [], [], [], [], 0
    for i, slot in enumerate(slots):
        L, T = meta.context_lens[i], qsl[i + 1] - qsl[i]
        starts.append(total)
        if slot != PAD_SLOT:
            for j in range(-(-L // NB)):
                pages.append(meta.block_tables[i][j])
                dsts.append(total + j * NB)
                counts.append(min(NB, L - j * NB))
        total += L + T
    c = torch.tensor(counts, dtype=torch.long)
    within = torch.arange(int(c.sum())) - torch.repeat_interleave(c.cumsum(0) - c, c)     # offset in its block
    old_page = torch.repeat_interleave(torch.tensor(pages, dtype=torch.long), c)
    old_dst = torch.repeat_interleave(torch.tensor(dsts, dtype=torch.long), c) + within
    lens = torch.tensor([qsl[i + 1] - qsl[i] for i in range(len(slots))], dtype=torch.long)
    shift = torch.tensor([starts[i] + meta.context_lens[i] - qsl[i] for i in range(len(slots))], dtype=torch.long)
    new_src = torch.arange(qsl[-1])
    return _Packed(starts, total, old_page, within, old_dst, new_src, new_src + torch.repeat_interleave(shift, lens),
                   queries)


def _mla_decode_rows(m: MLALayer, meta: BatchMeta, packed: _Packed, q_cat, full) -> list:
    """The decode rows' attention outputs as a list of one ``[1, nd, Hm vd]`` (empty without decode rows), in row
    order, in the absorbed form (:meth:`MLALayer.attend_absorbed`: no latent expanded through ``kv_b``). Rows
    with the same context length L run as one batched product: each row is its own ``[Hm, r + rope] @
    [r + rope, L + 1]`` product, softmax and ``P C`` over exactly its L + 1 latents, with the shapes and layouts
    ``MLALayer.forward(mode="recurrent")`` gives that row alone, and the batched matmul computes each item as it
    computes one alone (bitwise: ``tests/kda_core/test_varlen_decode.py``). q_cat ``[>= nd, Hm, r + rope]``."""
    nd = meta.num_decode
    if not nd:
        return []
    r = m.cfg.kv_lora_rank
    by_len: dict = {}
    for i in range(nd):
        by_len.setdefault(meta.context_lens[i], []).append(i)
    o_lat = q_cat.new_empty(nd, q_cat.shape[1], r)                        # [nd, Hm, r]
    for L, rows in by_len.items():
        idx = torch.tensor([packed.start[i] for i in rows])[:, None] + torch.arange(L + 1)   # [R, L+1]
        sel = torch.tensor(rows) if len(rows) < nd else None
        q = q_cat[:nd] if sel is None else q_cat[sel]                     # [R, Hm, r + rope]
        part = latent_attention(q, full[idx], r, m.scale)                 # [R, Hm, r]
        if sel is None:
            o_lat = part
        else:
            o_lat[sel] = part
    return [m.absorbed_output(o_lat).unsqueeze(0)]                        # [1, nd, Hm vd]


def _mla_layer(m: MLALayer, h, meta: BatchMeta, qsl, slots, pos, kv_cache, m_idx, kv_pages, kv_offs, kv_live,
               packed: _Packed, verify, li):
    """One MLA layer over the batch: an all-decode batch (without rotary embedding) in one C call where it runs
    (:meth:`kda_core.cpu_mla.CMLA.decode`); else decode and verify rows in the absorbed form (as ``MLALayer.forward(mode=
    "recurrent")``), prefill rows with keys and values expanded from their own latents (as chunk mode)."""
    cfg = m.cfg
    r, nope, Hm = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.num_mla_heads
    nd, n_dv = meta.num_decode, meta.num_decode + meta.num_verify
    c = cpu_mla.runs(h, kv_cache, m.kv_b) if n_dv else None
    if c is not None and nd == len(slots) and cfg.mla_use_nope:           # every row a decode row: one C call
        return c.decode(m, h[0], kv_cache.select(1, m_idx), packed.queries.qm, packed.queries.pages)[None]
    lat_new, qall = m.latents_and_queries_at(h, pos)                      # [1, T_total, R], [1, T_total, Hm, dq]
    if c is None and packed.start is None:                                # the C form does not run these tensors
        packed = _pack_latents(meta, qsl, slots, kv_cache, full=True)
    if packed.start is not None:
        full = lat_new.new_full((packed.total, lat_new.shape[-1]), float("nan"))  # [sum, R]
        if packed.old_dst.numel():
            full[packed.old_dst] = kv_cache[packed.old_page, m_idx, packed.old_off]
        full[packed.new_dst] = lat_new[0, packed.new_src]
    if c is not None:                                                     # decode + verify tokens: one C call,
        q_cat = None                                                      # cached latents read in place
        o_rows = [c.attend_paged(m, qall[0, : qsl[n_dv]], lat_new[0], packed.queries.qm, kv_cache.select(1, m_idx),
                                 packed.queries.pages)[None]]            # [1, T_dv, Hm vd]
    else:
        q_cat = m.absorb_queries(qall[0, : qsl[n_dv]]) if n_dv else None  # [T_dv, Hm, r + rope] decode + verify tokens
        o_rows = _mla_decode_rows(m, meta, packed, q_cat, full)          # decode rows, absorbed
    for i in range(nd, len(slots)):
        a, b = qsl[i], qsl[i + 1]
        L, T = meta.context_lens[i], b - a
        s0, s1 = packed.start[i], packed.start[i] + L + T
        if i >= n_dv:                                                     # prefill: as MLALayer.forward(mode="chunk")
            kv = linear(full[s0:s1, :r], m.kv_b).view(1, L + T, Hm, -1)  # [1, L+T, Hm, nope+vd]
            k_rope = full[None, s0:s1, None, r:].expand(1, L + T, Hm, -1)  # [1, L+T, Hm, rope]
            k = torch.cat([kv[..., :nope], k_rope], dim=-1).transpose(1, 2).contiguous()   # [1, Hm, L+T, dq]
            v = kv[..., nope:].transpose(1, 2).contiguous()               # [1, Hm, L+T, vd]
            q = qall[:, a:b].transpose(1, 2)                              # [1, Hm, T, dq]
            o = _block_causal_attention(q, k, v, L, m.scale)              # [1, Hm, T, vd]
            o_rows.append(o.transpose(1, 2).reshape(1, T, -1))            # [1, T, Hm vd]
            continue
        lat = full[s0:s1].unsqueeze(0)                                    # [1, L+T, R]: as MLALayer.attend_absorbed
        if c is None:                                                     # (the C call above did its tokens)
            o_lat = torch.stack([latent_attention(q_cat[a + t][None], lat[:, : L + t + 1].contiguous(), r, m.scale)
                                 for t in range(T)], dim=1)               # [1, T, Hm, r]
            o_rows.append(m.absorbed_output(o_lat))                       # [1, T, Hm vd]
        if i in verify:
            verify[i].layers[li] = lat.clone()                            # [1, L+T, R]
    live = lat_new[0] if kv_live.shape[0] == lat_new.shape[1] else lat_new[0, kv_live]   # [T_live, R] (no pad row:
    _write_latents(kv_cache, m_idx, kv_pages, kv_offs, live)                               # every token, in order)
    o = o_rows[0] if len(o_rows) == 1 else torch.cat(o_rows, dim=1)       # [1, T_total, Hm vd]
    return linear(o, m.o_proj)                                            # [1, T_total, D]
