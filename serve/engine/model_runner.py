"""``ModelRunner``: builds one step's batch as data and runs one forward (nano-vllm's
``nanovllm/engine/model_runner.py`` seam; the batch description follows vLLM's
``vllm/v1/attention/backends/gdn_attn.py`` metadata builder: decode rows first, ``query_start_loc``,
per-row state indices, ``has_initial_state``, block tables and the slot mapping).

Three words (mini-sglang's ``TableManager``, vLLM's ``ssm_state_indices``): a **page** is storage in the unified
:class:`PagePool`; a request's **slot** of a page group is the index its state has there for its whole life; a
**row** is its position in this step's batch. A request's state of group g lives in one run of
``n = layout.group_pages(g)`` consecutive pages (one page under the "unified" page policy; a run of the pages of
one KV block each under the server's default "multi_page": :meth:`serve.memory.pool.PagePool.alloc_runs`, asked
for by :class:`serve.engine.request_memory.RequestMemory`), and its slot IS the run's first page id: the runner
hands :func:`kda_core.varlen.forward_batch` per-layer strided views of the arena
(:func:`serve.memory.pages.slot_views`: recurrent ``[S, H, K, V]``, conv ``[S, 2HK + HV, W-1]``, stride(0) = one
page, S = P - n + 1) and each row's slot, built once per step as one int64 tensor ``[G, N]`` (pad rows ``-1``,
never clamped); the forward reads each live row's state there by slot, and
:meth:`ModelRunner.commit` writes the new states there by slot (one ``index_copy_`` per layer and piece; a bf16 /
fp16 ``layout.state_dtype`` rounded to nearest on that write, upcast exactly on read). No step copies the live
states into a dense pool and back. The writes wait for commit (not inside the forward) so that a forward that
raises, a probe run of the engine's fault isolation, and a row the engine drops write no state, and so that the
engine's checkpoints of a prefill row can pass through the request's pages before its final state lands there.

The prefix cache restores a checkpoint by copying it into the request's own state pages at admission
(:meth:`serve.prefix.cache.PrefixCache.restore`), i.e. into its slot, and admission zeroes the slot of a request
without a hit (:func:`serve.memory.pages.zero_state`), so a request never reads the state of the one that held the
page before it.

The dense path (slot j = live row j: :meth:`ModelRunner.gather_states` before the forward, the new states written
into that copy, :meth:`ModelRunner.scatter_states` at commit) runs only with ReplaySSM (its decode rows read a
replayed state, not the pages, and write only the conv window unless they materialise) and as the reference
(``in_place=False``); it reads and writes any pages, runs or not. :attr:`ModelRunner.in_place` says which groups
run in place; :attr:`ModelRunner.num_dense_copies` counts the dense gathers and scatters. MLA latents are read and written in place through
the pool's arena by block table.

Snapshot speculation of k drafts (fp32 snapshots): a request holds k + 1 state slots for its life
(``Request.spec_slots``, vLLM's ``num_speculative_blocks`` / ``spec_state_indices_tensor`` in
``vllm/v1/attention/backends/gdn_attn.py``); its verify row reads the current slot in place like a decode row, and
:meth:`ModelRunner.write_verify_states` writes the state after each of its ``1 + n`` tokens into slots ``0 .. n``
by index; the commit makes slot a (a drafts accepted) the current one (``Request.state_pages``): no copy of the
request's cache, no snapshot buffers. The other rollback strategies keep their copying path (the engine reads the
request's cache, records, commits and writes it back).

Decode rows are padded to a bucket size in :data:`DECODE_BUCKETS` (what CUDA-graph capture forces on
GPU engines); a pad row has slot ``-1``, NaN hidden states, and is never read from or written to a slot.

State write of a plain decode row: the slot write (the whole state back to its pages every step), or, with
a :class:`serve.memory.replay_state_write.ReplayStateWrite`, ReplaySSM (vllm#47572): the pages hold a
checkpoint the row's records are replayed onto before the forward, the step appends a record and writes
only the conv window, and the whole state only when it materialises. ``decode_bytes`` counts what the
decode rows wrote (state, conv window, records).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from kda_core.model import HybridLM
from kda_core.varlen import PAD_SLOT, BatchMeta, LayerSlots, SlotPools, forward_batch, make_meta, write_states
from serve.memory.layout import FP32_BYTES, CacheLayout
from serve.memory.pages import slot_views, stored_words
from serve.memory.pool import PagePool
from serve.memory.replay_state_write import ReplayStateWrite

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def decode_bucket(n: int) -> int:
    """The smallest bucket in :data:`DECODE_BUCKETS` holding ``n`` decode rows (n itself above 64)."""
    i = bisect_left(DECODE_BUCKETS, n)
    return DECODE_BUCKETS[i] if i < len(DECODE_BUCKETS) else n


@dataclass
class Row:
    """One row of a step: ``req`` (None for a pad row), its new ``tokens``, the position of the first
    (``start`` = tokens already in its cache) and, for a prefill row, the checkpoint offsets ``state_at``
    (relative to ``start``)."""

    req: object
    tokens: list
    start: int
    decode: bool
    state_at: tuple = ()
    verify: bool = False


@dataclass
class StepBatch:
    """A built and run batch: rows (decode first), the metadata, ``slot_idx [G, N]`` int64 (row i's slot in
    group g's storage: the first page of its state run in an in-place group, its live-row number in a dense one; ``-1`` for a pad
    row; ``meta.slot_idx`` is row 0 of it), the logits ``[N, 256]`` and the states at checkpoints
    ``{row: {t: {layer: KDACache}}}``; ``writes`` holds the in-place layers' new states
    (:class:`kda_core.varlen.StateWrite` pieces) and ``dense`` the dense groups' states until :meth:`commit`
    writes them to their pages."""

    rows: list
    meta: BatchMeta
    slot_idx: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    states_at: dict = field(default_factory=dict)
    dense: dict = field(default_factory=dict)
    writes: dict = field(default_factory=dict)
    verify: dict = field(default_factory=dict)
    live_pages: list = field(default_factory=list)
    decode_records: dict | None = None

    @property
    def num_pad(self) -> int:
        return sum(r.req is None for r in self.rows)

    @property
    def num_decode(self) -> int:
        return sum(r.decode and r.req is not None for r in self.rows)

    @property
    def num_verify(self) -> int:
        """Verify rows (speculative decoding: the last token and its drafts, one row per request)."""
        return sum(r.verify for r in self.rows)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens prefilled in this forward (verify rows are not prefill)."""
        return sum(len(r.tokens) for r in self.rows if not r.decode and not r.verify)


class ModelRunner:
    """Runs a :class:`HybridLM` on batches whose caches live in ``pool`` under ``layout``.

    Args: model; pool: the unified PagePool; layout: the :class:`CacheLayout` (fp32 latents and conv windows,
    the recurrent state in ``layout.state_dtype``: fp32, bf16 or fp16); pad_decode: pad the decode rows to
    :func:`decode_bucket` (default True); replay: the decode rows' ReplaySSM rings (None: the slot write);
    in_place: False runs every group on the dense path (the reference the in-place path is tested against).
    Compute is fp32: a 16-bit state is upcast exactly when read and rounded to nearest when written.
    ``in_place[g]``: group g's states are read and written in place by slot (no ReplaySSM; a request's state of
    the group must then be one run of consecutive pages: ``RequestMemory(runs=True)``); else by the dense path
    (module docstring). ``num_dense_copies``: calls of :meth:`gather_states`, :meth:`scatter_states` and
    :meth:`scatter_conv` that moved states (0 for an engine that runs every group in place).
    Raises ValueError for a layout the engine cannot store (:meth:`CacheLayout.check_engine_dtypes`).
    """

    def __init__(self, model: HybridLM, pool: PagePool, layout: CacheLayout, pad_decode: bool = True,
                 replay: ReplayStateWrite | None = None, in_place: bool = True):
        layout.check_engine_dtypes()
        self.model, self.pool, self.layout, self.pad_decode = model, pool, layout, pad_decode
        self.replay = replay
        cfg = model.cfg
        self._w_rec, self._w_conv = layout.state_words()                    # fp32 words per layer
        self._rec_shape = (cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim)
        self._conv_shape = (cfg.conv_dim, cfg.conv_kernel - 1)
        self._n_record = cfg.num_heads * (2 * cfg.head_k_dim + cfg.head_v_dim)   # k, u, g elements
        self.decode_bytes = dict.fromkeys(("state", "conv", "records"), 0)     # written by decode rows (stored bytes)
        self.in_place = tuple(in_place and replay is None for _ in range(layout.num_groups))
        self.num_dense_copies = 0
        self._dense_groups = [g for g, ip in enumerate(self.in_place) if not ip]
        self._views = {li: v for g, ip in enumerate(self.in_place) if ip
                       for li, v in slot_views(layout, pool, g).items()}   # {layer: (rec [P, H, K, V], conv)}
        self._group_of = {li: g for g, layers in enumerate(layout.groups) for li in layers}
        self._verify_views = dict(self._views)                             # every layer's slot views, for verify
        self._kv = pool.typed_arena(torch.float32, layout.kv_block_shape)   # [P, M, NB, R] MLA latents, in place

    # ---- snapshot speculation: the verify row's states into the request's k + 1 slots ---------------
    def write_verify_states(self, req, out, num_tokens: int) -> None:
        """Write the state after each of a verify row's ``num_tokens`` tokens (``out``: its
        :class:`kda_core.varlen.VerifyRow`; per KDA layer ``aux.states [1, T, H, K, V]`` and the conv windows
        rebuilt from the current slot's window and ``aux.raw_qkv``, as :class:`SnapshotRollback` records them)
        into the request's slots ``req.spec_slots[0 .. T-1]``, in place by slot (one ``index_copy_`` per layer and
        piece; a 16-bit state rounded to nearest). Reads the current slot's conv window first: it may be
        overwritten. Raises ValueError if the request holds fewer than T slots."""
        if num_tokens > len(req.spec_slots):
            raise ValueError(f"request {req.rid}: {num_tokens} verify tokens but {len(req.spec_slots)} state slots")
        if len(self._verify_views) < len(self._group_of):                  # built once (the dense reference runner)
            self._verify_views = {li: v for g in range(self.layout.num_groups)
                                  for li, v in slot_views(self.layout, self.pool, g).items()}
        slots = torch.tensor([[s[g][0] for s in req.spec_slots[:num_tokens]] for g in range(self.layout.num_groups)],
                             dtype=torch.long)                             # [G, T]: token t's slot per group
        for li, g in self._group_of.items():
            rec, conv = self._verify_views[li]
            aux, cur = out.aux[li], req.state_pages[g][0]
            w1 = conv.shape[-1]
            full = torch.cat([conv[cur].unsqueeze(0), aux.raw_qkv.transpose(1, 2)], dim=-1)   # [1, C, W-1+T]
            windows = full.unfold(-1, w1, 1)[0, :, 1:].transpose(0, 1)    # [T, C, W-1]: after token t
            conv.index_copy_(0, slots[g], windows)
            rec.index_copy_(0, slots[g], aux.states[0].to(rec.dtype))      # [T, H, K, V]

    # ---- state slots: gather / scatter the rows' state pages --------------------------------------
    def _flat_arena(self) -> torch.Tensor:
        return self.pool.typed_arena(torch.float32, (self.pool.page_bytes // FP32_BYTES,))  # [P, E] words

    def gather_states(self, state_pages: list, groups=None) -> dict:
        """Dense fp32 states of ``len(state_pages)`` requests: ``{layer: (recurrent [S, H, K, V], conv
        [S, 2HK + HV, W-1])}``, slot j = ``state_pages[j]`` (a request's pages by group); a 16-bit recurrent
        state is upcast exactly. ``groups``: only these groups' layers (default all)."""
        self.num_dense_copies += 1
        arena, S = self._flat_arena(), len(state_pages)
        out = {}
        per, dt = self._w_rec + self._w_conv, self.layout.state_dtype
        for g in range(self.layout.num_groups) if groups is None else groups:
            layers = self.layout.groups[g]
            idx = torch.tensor([list(sp[g]) for sp in state_pages], dtype=torch.long).reshape(-1)  # [S * P_g]
            used = len(layers) * per
            if idx.numel() == S:                                          # one page per state: read the used part
                flat = arena[:, :used].index_select(0, idx)               # [S, used] words
            else:
                flat = arena.index_select(0, idx).reshape(S, -1)          # [S, P_g * E] words
            for j, layer in enumerate(layers):
                rec = flat[:, j * per: j * per + self._w_rec].contiguous().view(dt).to(torch.float32)  # [S, HKV]
                conv = flat[:, j * per + self._w_rec: (j + 1) * per].reshape(S, *self._conv_shape)
                out[layer] = (rec.reshape(S, *self._rec_shape), conv.contiguous())
        return out

    def scatter_states(self, state_pages: list, dense: dict, keep: list, groups=None) -> None:
        """Write the dense states of the slots ``keep`` back into their requests' pages (in place); the
        recurrent state rounded to nearest into ``layout.state_dtype``. ``groups``: only these groups (default
        all)."""
        if not keep or groups is not None and not groups:
            return
        self.num_dense_copies += 1
        arena = self._flat_arena()
        E = arena.shape[1]
        for g in range(self.layout.num_groups) if groups is None else groups:
            layers = self.layout.groups[g]
            idx = torch.tensor([list(state_pages[j][g]) for j in keep], dtype=torch.long).reshape(-1)
            sel = torch.tensor(keep, dtype=torch.long)
            parts = []
            for layer in layers:
                rec, conv = dense[layer]
                parts += [stored_words(rec[sel], self.layout.state_dtype).reshape(len(keep), -1),
                          conv[sel].reshape(len(keep), -1)]
            data = torch.cat(parts, dim=1)                                # [S', used] words: recurrent, conv, ...
            if idx.numel() == len(keep):                                  # one page per state: write the used part
                arena[:, : data.shape[1]].index_copy_(0, idx, data)
            else:                                                         # pages of a state: keep the last's tail
                flat = arena.index_select(0, idx).reshape(len(keep), -1)  # [S', P_g * E]
                flat[:, : data.shape[1]] = data
                arena.index_copy_(0, idx, flat.reshape(-1, E))

    def scatter_conv(self, state_pages: list, dense: dict, keep: list) -> None:
        """Write only the conv windows of the slots ``keep`` into their requests' pages (in place): the
        ReplaySSM decode write, which leaves the checkpoint in the pages untouched."""
        if not keep:
            return
        self.num_dense_copies += 1
        arena = self._flat_arena()
        E, flat = arena.shape[1], arena.view(-1)                          # flat [P * E]
        per, sel = self._w_rec + self._w_conv, torch.tensor(keep, dtype=torch.long)
        for g, layers in enumerate(self.layout.groups):
            pages = torch.tensor([list(state_pages[j][g]) for j in keep], dtype=torch.long)   # [S', P_g]
            if pages.shape[1] == 1:                                       # one page per state: contiguous windows
                for j, layer in enumerate(layers):
                    a = j * per + self._w_rec                             # window of layer j: words [a, a + w_conv)
                    arena[:, a: a + self._w_conv].index_copy_(0, pages[:, 0], dense[layer][1].index_select(0, sel)
                                                              .reshape(len(keep), -1))
                continue
            q = torch.cat([torch.arange(j * per + self._w_rec, (j + 1) * per) for j in range(len(layers))])
            pos = pages[:, q // E] * E + q % E                            # [S', n_layers w_conv]: arena positions
            data = torch.cat([dense[layer][1].index_select(0, sel).reshape(len(keep), -1) for layer in layers], 1)
            flat.index_copy_(0, pos.reshape(-1), data.reshape(-1))        # conv windows only, one copy per group

    # ---- one step ---------------------------------------------------------------------------------
    def build(self, decode_rows: list, prefill_rows: list, verify_rows: list = ()) -> StepBatch:
        """The batch as data: decode rows (padded to a bucket), then verify rows (speculative decoding,
        ``1 + n`` tokens each), then prefill rows; row i's slot in group g is ``slot_idx[g, i]``: the first page of
        its request's state run of that group (in-place group) or its live-row number (dense group), ``-1`` for a
        pad row.
        Raises ValueError (from :func:`kda_core.varlen.make_meta`) for malformed rows."""
        rows = list(decode_rows)
        if self.pad_decode and rows:
            rows += [Row(None, [0], 0, True) for _ in range(decode_bucket(len(rows)) - len(rows))]
        rows += list(verify_rows) + list(prefill_rows)
        per_row, j = [], 0                                                 # [N][G]
        for r in rows:
            if r.req is None:
                per_row.append([PAD_SLOT] * len(self.in_place))
            else:
                per_row.append([r.req.state_pages[g][0] if ip else j for g, ip in enumerate(self.in_place)])
                j += 1
        slot_idx = torch.tensor(per_row, dtype=torch.long).reshape(len(rows), -1).t().contiguous()   # [G, N]
        nd = sum(r.decode for r in rows)
        meta = make_meta([len(r.tokens) for r in rows], nd, slot_idx[0],
                         [r.req is not None and (r.start > 0 or r.decode) for r in rows],
                         [r.start for r in rows], [r.req.page_table if r.req is not None else [] for r in rows],
                         [r.state_at for r in rows], num_verify=len(verify_rows))
        return StepBatch(rows, meta, slot_idx)

    def run(self, batch: StepBatch) -> StepBatch:
        """One forward over ``batch``: KV latents written in place; the in-place groups' states read from
        their slots (their new states in ``batch.writes`` until :meth:`commit`), the dense groups' gathered into
        ``batch.dense`` and their new states written there. Writes no KDA state to the pool."""
        lay = self.layout
        live = [r.req for r in batch.rows if r.req is not None]
        batch.live_pages = [req.state_pages for req in live]
        batch.dense = {}
        if self._dense_groups:
            batch.dense = self.gather_states(batch.live_pages, self._dense_groups) if live else {
                i: (torch.zeros(0, *self._rec_shape), torch.zeros(0, *self._conv_shape))
                for g in self._dense_groups for i in lay.groups[g]}
        if self.replay is not None and batch.num_decode:                  # checkpoint + records -> state
            rids = [r.req.rid for r in batch.rows[: batch.num_decode]]    # live decode rows: dense slots 0..nd-1
            self.replay.read(rids, {i: rec for i, (rec, _) in batch.dense.items()})
        groups = batch.slot_idx.unbind(0)                                  # G x [N]: one tensor per group, shared
        kda = {li: LayerSlots(*(batch.dense[li] if li in batch.dense else self._views[li]),
                              groups[self._group_of[li]]) for li in self.model.cfg.kda_layers}
        kv = self._kv                                                      # [P, M, NB, R]
        toks = torch.tensor([t for r in batch.rows for t in r.tokens], dtype=torch.long)
        out = forward_batch(self.model, toks, batch.meta, SlotPools(kda, kv),
                            decode_records=self.replay is not None, write=False)
        batch.logits, batch.states_at, batch.verify = out.logits, out.states_at, out.verify
        batch.decode_records = out.decode_records
        dense = {li: w for li, w in out.state_writes.items() if li in batch.dense}
        if dense:                                                          # the private copy: written now
            write_states(SlotPools(kda, kv), batch.meta, dense)
        batch.writes = {li: w for li, w in out.state_writes.items() if li not in batch.dense}
        return batch

    def commit(self, batch: StepBatch, keep, publish=frozenset()) -> None:
        """Write the new states of the live rows whose request ``keep(req)`` says is still running into their
        slots: in place by slot for the in-place groups (:func:`kda_core.varlen.write_states`), by
        :meth:`scatter_states` for the dense ones. With ReplaySSM a kept decode row writes its whole state only if
        it materialises (its ring is full, or its request id is in ``publish``: a checkpoint is published at this
        step), else its conv window, and appends its record."""
        kept_row = [r.req is None or bool(keep(r.req)) for r in batch.rows]   # [N]; a pad row writes nothing anyway
        live = [r.req for r in batch.rows if r.req is not None]
        kept = [j for j, k in enumerate(k for r, k in zip(batch.rows, kept_row) if r.req is not None) if k]
        nd = batch.num_decode                                              # live decode rows: live rows 0..nd-1
        dec = [j for j in kept if j < nd]
        rec_bytes, conv_bytes = self._w_rec * FP32_BYTES, self._w_conv * FP32_BYTES   # per layer, as stored
        if self.replay is None:
            if batch.writes:
                groups = batch.slot_idx.unbind(0)                          # G x [N]
                kda = {li: LayerSlots(*self._views[li], groups[self._group_of[li]]) for li in batch.writes}
                write_states(SlotPools(kda, None), batch.meta, batch.writes,
                             None if all(kept_row) else torch.tensor(kept_row))
            self.scatter_states(batch.live_pages, batch.dense, kept, self._dense_groups)
            L = len(self.model.cfg.kda_layers)
            self.decode_bytes["state"] += len(dec) * L * rec_bytes
            self.decode_bytes["conv"] += len(dec) * L * conv_bytes
            return
        rids = [live[j].rid for j in dec]
        mat = [self.replay.must_materialise(rid) or rid in publish for rid in rids]
        full = [j for j in kept if j >= nd] + [j for j, m in zip(dec, mat) if m]
        self.scatter_states(batch.live_pages, batch.dense, sorted(full))
        self.scatter_conv(batch.live_pages, batch.dense, [j for j, m in zip(dec, mat) if not m])
        if dec:
            sel = torch.tensor(dec, dtype=torch.long)
            recs = {i: tuple(t.index_select(0, sel) for t in r) for i, r in batch.decode_records.items()}
            self.replay.commit(rids, recs, mat, [rid in publish for rid in rids])
        L = len(batch.dense)
        self.decode_bytes["state"] += sum(mat) * L * rec_bytes
        self.decode_bytes["conv"] += len(dec) * L * conv_bytes
        self.decode_bytes["records"] += (len(dec) - sum(mat)) * L * self._n_record * 4
