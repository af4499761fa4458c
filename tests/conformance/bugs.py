"""Deliberate bugs, one per check, each of the class that check comes from, put into our engine for a test only
(pytest's ``monkeypatch``: undone when the test ends; nothing in the product can turn them on). Each function
patches one engine or model function of this process, where the test then starts our server in process
(:class:`conformance.launch.InProcess`)."""
from __future__ import annotations

import torch

import kda_core.varlen as varlen
from kda_core.layer import KDACache
from serve.engine import DONE, ServeEngine
from serve.engine.model_runner import ModelRunner
from serve.engine.request import RequestStatus
from serve.http.metrics import ServerMetrics
from serve.memory.pages import zero_state
from serve.prefix.cache import PrefixCache
from serve.spec_decode.snapshot import SnapshotRollback


def state_not_restored(mp) -> None:
    """A prefix hit shares the KV blocks but restores no state: the recurrence restarts from zero (vLLM #43090:
    the attention group hits, the Mamba group misses, and the metadata says there is an initial state)."""
    restore = PrefixCache.restore

    def buggy(self, hit, owner, dst_pages_by_group):
        restored = restore(self, hit, owner, dst_pages_by_group)
        zero_state(self.layout, self.pool, dst_pages_by_group)
        return restored

    mp.setattr(PrefixCache, "restore", buggy)


def checkpoint_found_by_length(mp) -> None:
    """A hit restores the checkpoint last published at its boundary's length, whoever's tokens it holds (a state
    found by its position, not its prefix; vLLM PR #55601's wrong-unit index restores "the state from an unrelated
    block"). A repeated prompt still hits its own; A after B of the same length gets B's."""
    publish, restore, last = PrefixCache.publish_checkpoint, PrefixCache.restore, {}

    def buggy_publish(self, keys, num_blocks, state_pages_by_group, written_at, owner):
        ok = publish(self, keys, num_blocks, state_pages_by_group, written_at, owner)
        if ok:
            node = self.index.node(keys[num_blocks - 1])
            last[num_blocks * self.block_size] = tuple(node.ckpts[g].payload for g in range(self.num_groups))
        return ok

    def buggy_restore(self, hit, owner, dst_pages_by_group):
        pages = last.get(hit.num_tokens)
        return restore(self, hit if pages is None else hit._replace(checkpoint_pages=pages), owner, dst_pages_by_group)

    mp.setattr(PrefixCache, "publish_checkpoint", buggy_publish)
    mp.setattr(PrefixCache, "restore", buggy_restore)


def stale_state_after_rollback(mp) -> None:
    """A verify's commit keeps the state after its first token whatever was accepted: the accepted drafts' updates
    are missing from the state (vLLM PR #52942 reads the state at column 0 after a step that accepted drafts).
    Planted in both commit paths: the copying one (``SnapshotRollback``) and the k + 1 state slots (every slot gets
    the state after token 0)."""

    def buggy(self, index, layer, base, num_tokens):
        return KDACache(self._states[index][:, 0].to(torch.float32).clone(),
                        self._convs[index][:, num_tokens - 1].to(torch.float32).clone())

    mp.setattr(SnapshotRollback, "_commit_layer", buggy)
    write = ModelRunner.write_verify_states

    def buggy_slots(self, req, out, num_tokens):      # the k + 1 slots: every slot gets the state after token 0
        for li, aux in out.aux.items():
            out.aux[li] = aux._replace(states=aux.states[:, :1].expand_as(aux.states).clone())
        return write(self, req, out, num_tokens)

    mp.setattr(ModelRunner, "write_verify_states", buggy_slots)


def reset_at_chunk_boundary(mp) -> None:
    """Every multi-token prefill forward starts from a zero state (lablup/mlxcel #1749: a multi-token forward is
    read as the start of a new prompt), so a chunked prompt is answered from its last chunk alone."""
    build = ModelRunner.build

    def buggy(self, decode_rows, prefill_rows, verify_rows=()):
        batch = build(self, decode_rows, prefill_rows, verify_rows)
        has = batch.meta.has_initial_state.clone()
        for i, row in enumerate(batch.rows):
            if row.req is not None and not row.decode and not row.verify and len(row.tokens) > 1:
                has[i] = False
        batch.meta = batch.meta._replace(has_initial_state=has)
        return batch

    mp.setattr(ModelRunner, "build", buggy)


def pad_slot_clamped_to_zero(mp) -> None:
    """A decode pad row's slot ``-1`` clamped to 0: the pad row reads and writes slot 0, a live request's state
    (tokenspeed#700, as STYLE.md recounts; tpu-inference PR #2469's padded positions holding live slot ids). The
    pad row's input is zeros here (garbage on a GPU), so the corruption is silent."""
    layer, rows, target, rows_type = varlen._kda_layer, varlen._rows, varlen._write_target, varlen._Rows

    def buggy_layer(m, h, *args):
        return layer(m, torch.nan_to_num(h, nan=0.0), *args)            # only pad rows hold NaN

    def buggy_rows(slot_idx, num_slots):                                 # reads: every row, -1 read as 0
        rows(slot_idx, num_slots)
        return rows_type(torch.arange(slot_idx.shape[0]), slot_idx.clamp(min=0), slot_idx.shape[0], False)

    def buggy_target(idx, keep, first, n):                               # writes: -1 written as 0
        return target(idx.clamp(min=0), keep, first, n)

    mp.setattr(varlen, "_kda_layer", buggy_layer)
    mp.setattr(varlen, "_rows", buggy_rows)
    mp.setattr(varlen, "_write_target", buggy_target)


def abort_keeps_pages(mp) -> None:
    """An aborted request leaves the running list but never releases its state slot and pages."""

    def buggy(self, rid):
        req = self.requests[rid]
        if req.status in DONE:
            return False
        (self.waiting if req.status is RequestStatus.WAITING else self.running).remove(rid)
        req.status = RequestStatus.ABORTED
        return True

    mp.setattr(ServeEngine, "abort", buggy)


def kv_hit_counted_as_state_hit(mp) -> None:
    """The metrics count the block-aligned KV hit as the prefix-cache hit, so a state that was not restored looks
    like a hit and no state-cache miss is counted (one counter for a hybrid cache: vLLM #45238)."""
    finished = ServerMetrics.finished

    def buggy(self, stream, res):
        if res is not None:
            res = res._replace(hit_tokens=res.kv_hit_tokens // self.block_size * self.block_size)
        finished(self, stream, res)

    mp.setattr(ServerMetrics, "finished", buggy)


BUGS = {"prefix_hit": state_not_restored, "cache_order": checkpoint_found_by_length,
        "speculative": stale_state_after_rollback, "chunked_prefill": reset_at_chunk_boundary,
        "batch_invariance": pad_slot_clamped_to_zero, "abort_recompute": abort_keeps_pages,
        "state_hit_metrics": kv_hit_counted_as_state_hit}
