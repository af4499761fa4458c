"""``RequestMemory``: the pages and prefix-cache pins of every request, owned by the :class:`Scheduler`
(nano-vllm's ``BlockManager`` seam: ask, then act; free through one path).

Request flow, as the memory sees it:

  match   -> at the head of the queue: lookup, choose the hit (the
             longest if it fits NOW, else none); pins nothing          WAITING
  admit   -> pin the hit (before anything is allocated), allocate
             private KDA_STATE pages (its slot: one run of
             consecutive pages per group when the runner reads the state
             in place) + own KV pages (evicting unpinned cache entries),
             restore the checkpoint into the slot's pages (a copy), drop
             the checkpoint pin (or zero the slot)                       PREFILL
             (no free run while something runs: stays WAITING); with
             snapshot speculation k + 1 such slots, held for its life
  publish -> full blocks below a boundary, and the checkpoint there (the
             state after exactly that many committed tokens)
  release -> every page and pin the request held (all its slots; finish, abort, reject,
             preempt: the one path)

Checkpoint placement (C = interval, N = block size, L = prompt length): every multiple of C reached during
prefill, the replay boundary floor((L - 1) / N) N, the end of the prompt floor(L / N) N
(:meth:`checkpoint_boundaries`), and at the request's end the last full block of prompt + output
(:meth:`final_boundary`). Without a prefix cache the engine runs the same pages with no sharing: the reference.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import time
from itertools import islice

import torch

from kda_core.model import HybridLM
from serve.config import ServeConfig
from serve.engine.request import Request, RequestStatus
from serve.errors import check_choice, check_int
from serve.memory.layout import ENGINE_STATE_DTYPES, CacheLayout
from serve.memory.pages import zero_state
from serve.memory.pool import NoFreeRun, PageKind, PagePool, PoolExhausted
from serve.memory.replay_state_write import ReplayStateWrite
from serve.prefix.cache import PrefixCache
from serve.prefix.index import block_keys

log = logging.getLogger("serve.engine")


class Fit(enum.Enum):
    """The answer of :meth:`RequestMemory.can_admit`: the request's pages fit NOW (free + evictable),
    LATER (once running requests finish), or NEVER (not even in an otherwise idle pool)."""

    NOW = "now"
    LATER = "later"
    NEVER = "never"


def resolve_layout(model: HybridLM, pool: PagePool, prefix_cache: PrefixCache | None, config: ServeConfig | None,
                   state_dtype: torch.dtype | None) -> tuple[ServeConfig, CacheLayout]:
    """The engine's ``(ServeConfig, CacheLayout)``, decided once: the prefix cache's when there is one, else
    ``config`` (None: ``ServeConfig()``) with ``state_dtype`` (None: the config's) and its layout on the pool's
    page size. Raises ValueError for a cache on another pool or model config, a ``config`` or ``state_dtype``
    unlike the cache's, a ``config`` that is not a ServeConfig, or a ``state_dtype`` not in
    :data:`serve.memory.layout.ENGINE_STATE_DTYPES`."""
    if state_dtype is not None:
        check_choice("state_dtype", state_dtype, ENGINE_STATE_DTYPES)
    if prefix_cache is not None:
        if prefix_cache.pool is not pool:
            raise ValueError("prefix_cache must be built on the engine's pool")
        if prefix_cache.layout.cfg != model.cfg:
            raise ValueError("prefix_cache was built for another model config")
        if config is not None and config != prefix_cache.config:
            raise ValueError(f"config {config} differs from the prefix cache's {prefix_cache.config}")
        if state_dtype is not None and state_dtype != prefix_cache.config.state_dtype:
            raise ValueError(f"state_dtype {state_dtype} differs from the prefix cache's "
                             f"{prefix_cache.config.state_dtype} (build it on ServeConfig(state_dtype=...))")
        return prefix_cache.config, prefix_cache.layout
    config = ServeConfig() if config is None else config
    if not isinstance(config, ServeConfig):
        raise ValueError(f"config must be a ServeConfig or None, got {type(config).__name__}")
    if state_dtype is not None:
        config = dataclasses.replace(config, state_dtype=state_dtype)
    return config, config.layout(model.cfg, pool.page_bytes)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


class RequestMemory:
    """What every request holds of ``pool`` (its state pages and page table) and of ``cache`` (its pins).

    Args: pool: the :class:`PagePool`; layout: the :class:`CacheLayout` of a request's cache in it; cache: the
    :class:`PrefixCache` on ``pool`` or None (no sharing); config: the :class:`ServeConfig` (checkpoint grid);
    replay: the ReplaySSM rings (:class:`ReplayStateWrite`; a request's ring goes with its pages) or None;
    runs: a request's state of a group that spans several pages must be one run of consecutive pages
    (:meth:`PagePool.alloc_runs`), as the model runner reads and writes it in place there
    (:attr:`ModelRunner.in_place`); ``run_sizes`` then holds the pages per group (None: any pages will do);
    spec_slots: with snapshot speculation of k drafts, k + 1: every request holds that many state slots for its life
    (``Request.spec_slots``, each a state's pages by group; ``Request.state_pages`` is the one holding its current
    state), the verify row writing the state after each of its tokens into one of them by index (vLLM's
    ``num_speculative_blocks``); None: one slot, ``spec_slots`` empty.
    Mutates only the requests it is given and the pool / cache; it never touches a queue."""

    def __init__(self, pool: PagePool, layout: CacheLayout, cache: PrefixCache | None, config: ServeConfig,
                 replay: ReplayStateWrite | None = None, runs: bool = False, spec_slots: int | None = None):
        self.pool, self.layout, self.cache, self.config, self.replay = pool, layout, cache, config, replay
        sizes = [layout.group_pages(g) for g in range(layout.num_groups)]
        self.run_sizes = sizes if runs and max(sizes) > 1 else None
        self.spec_slots = None if spec_slots is None else check_int("spec_slots", spec_slots)
        self.slots_per_request = 1 if spec_slots is None else spec_slots

    def pages_needed(self, req: Request) -> tuple[int, int]:
        """``(state pages, KV pages)`` ``req`` allocates at admission: :meth:`Request.pages_needed` with its state
        pages times :attr:`slots_per_request`."""
        state, kv = req.pages_needed(self.layout)
        return state * self.slots_per_request, kv

    # ---- the checkpoint grid ----------------------------------------------------------------------
    def checkpoint_boundaries(self, num_prompt_tokens: int) -> list[int]:
        """Prefill checkpoint boundaries of a prompt (:meth:`ServeConfig.prefill_checkpoints`); empty
        without a prefix cache."""
        return [] if self.cache is None else self.config.prefill_checkpoints(num_prompt_tokens)

    def final_boundary(self, req: Request) -> int | None:
        """b_end: where ``req`` publishes its final checkpoint (:meth:`ServeConfig.final_checkpoint` of its
        prompt and final tokens); None without a cache or if it has none."""
        return None if self.cache is None else self.config.final_checkpoint(len(req.prompt), req.final_tokens)

    # ---- ask ----------------------------------------------------------------------------------------
    def match(self, req: Request, anything_running: bool = False) -> Fit:
        """Admission's question, asked when ``req`` reaches the head of the waiting queue: look its prompt up
        (pure) and choose the hit :meth:`admit` will pin (``req.hit``; None without a cache): the longest hit if
        the request fits NOW beside it, else no hit (``num_tokens`` 0, ``kv_tokens`` kept). Returns
        :meth:`can_admit`'s answer for that choice. Pins nothing: a waiting request holds no page and no pin, and
        one that fits only LATER is matched again next time.

        A hit pins its blocks and a checkpoint beside the state it is restored into, so it can cost more free
        pages than a miss (the checkpoint's), and a request that fits the pool on its own must never be refused
        for its hit. As in vLLM's v1 ``Scheduler.schedule``, the prefix is looked up (``get_computed_blocks``)
        only when the request is scheduled, and hit pages that are eviction candidates are not counted as free
        for it (``KVCacheManager.allocate_slots``: ``num_evictable_computed_blocks``). The fall back to no hit is
        ours (a vLLM hit never costs more than a miss; ours copies a checkpoint); a shorter hit would cost the
        same copy, so none is tried."""
        t0 = time.perf_counter()
        req.hit = None if self.cache is None else self.cache.lookup(req.prompt)
        fit = self.can_admit(req, anything_running)
        if fit is not Fit.NOW and req.hit_blocks:
            req.hit = req.hit._replace(num_tokens=0, kv_pages=(), checkpoint_pages=())
            fit = self.can_admit(req, anything_running)
        req.timings_ms["lookup"] += _ms(t0)
        return fit

    def can_admit(self, req: Request, anything_running: bool) -> Fit:
        """Whether the waiting request's pages (:meth:`Request.pages_needed`: a state slot and its KV pages beside
        its chosen hit ``req.hit``, which admission pins) fit: NOW in free + evictable pages, the hit's own
        pages not counted as evictable (with ``run_sizes``: and a free run per group now, or once every other
        evictable cache page is freed: :meth:`PrefixCache.evictable_page_ids`); LATER once running requests
        release theirs (``anything_running``) if the request without its hit fits the pool; NEVER if it exceeds
        the pool even without its hit, or if it does not fit while nothing runs (waiting requests hold nothing,
        so then only unpinned cache pages and holders outside the engine are in the way; e.g. no free run in a
        fragmented idle pool). Pure (the caps on running requests are the scheduler's)."""
        state, kv = self.pages_needed(req)
        evictable = [] if self.cache is None else self.cache.evictable_page_ids()
        if req.hit_blocks:                                  # pinned at admit: not evictable then
            pinned = set(req.hit.kv_pages).union(*req.hit.checkpoint_pages)
            evictable = [p for p in evictable if p not in pinned]
        if state + kv <= self.pool.num_free + len(evictable):
            if self.run_sizes is None or self.pool.can_alloc_runs(self.run_sizes * self.slots_per_request, evictable):
                return Fit.NOW
            return Fit.LATER if anything_running else Fit.NEVER
        return Fit.LATER if anything_running and state + kv + req.hit_blocks <= self.pool.num_pages else Fit.NEVER

    def shortfall(self, req: Request) -> str:
        """Why ``req`` can never fit: the pages it needs against the free and evictable ones (or, when they
        would do, the runs of consecutive pages its state needs against the longest free run)."""
        (state, kv), free = self.pages_needed(req), self.pool.num_free
        evictable = 0 if self.cache is None else self.cache.evictable_pages()
        if state + kv <= free + evictable and self.run_sizes is not None:
            return (f"needs a run of {max(self.run_sizes)} consecutive free pages for its state slot but the "
                    f"longest free run is {self.pool.longest_free_run()} pages ({free} free, fragmented by pages "
                    f"that stay held)")
        return (f"needs {state + kv} pages ({state} state + {kv} KV) but only {free} of the pool's "
                f"{self.pool.num_pages} are free and {evictable} evictable")

    # ---- act ----------------------------------------------------------------------------------------
    def admit(self, req: Request, anything_running: bool = False) -> bool:
        """Admit a request :meth:`match` (or :meth:`can_admit`) said fits NOW, nothing changed since: pin its hit
        (:meth:`PrefixCache.acquire`, before anything is allocated; its page table holds the hit's blocks from
        then on), allocate its state (one run per group with ``run_sizes``) and KV pages (evicting unpinned cache
        entries), restore its hit's checkpoint into its state (a copy) and unpin the checkpoint, or zero the state;
        status PREFILL. Returns False if it was not admitted: REJECTED (:meth:`reject`) when the allocation still
        failed (PoolExhausted: the evictable count was stale, or no run opened while nothing runs) or the restore
        raised (e.g. CheckpointError; the error is its reason, logged); still WAITING, holding nothing, when no run
        of free pages opened (:class:`NoFreeRun`) while ``anything_running`` (running requests will free theirs). Nothing it held leaks."""
        t0 = time.perf_counter()
        cache, lay = self.cache, self.layout
        num_state, num_kv = self.pages_needed(req)
        alloc = self.pool.alloc if cache is None else cache.alloc
        G = lay.num_groups
        if cache is not None:                               # held by the request from here (release)
            cache.acquire(req.hit, req.rid)
            req.page_table = list(req.hit.kv_pages)
        try:
            if self.run_sizes is None:
                it = iter(alloc(PageKind.KDA_STATE, num_state, req.rid))
                flat = [tuple(islice(it, lay.group_pages(g % G))) for g in range(G * self.slots_per_request)]
            else:                                           # slot = each run's first page (slot_views)
                flat = [tuple(run) for run in (self.pool if cache is None else cache).alloc_runs(
                    PageKind.KDA_STATE, self.run_sizes * self.slots_per_request, req.rid)]
            slots = [flat[i: i + G] for i in range(0, len(flat), G)]   # [slot][group] -> pages
            req.state_pages = slots[0]
            req.spec_slots = slots if self.spec_slots is not None else []
            req.page_table += alloc(PageKind.MLA_KV, num_kv, req.rid)
        except NoFreeRun as err:
            if anything_running and not req.state_pages:    # nothing allocated: wait for a run to free
                log.info("request %d waits: %s", req.rid, err)
                self.release(req)
                return False
            self.reject(req, f"pool exhausted at admission: {err}")
            return False
        except PoolExhausted as err:                        # evictable count was stale: reject cleanly
            self.reject(req, f"pool exhausted at admission: {err}")
            return False
        req.keys = [] if req.hit is None else list(req.hit.keys)
        req.timings_ms["queue"] = (t0 - req.submit_t) * 1e3 - req.timings_ms["lookup"]
        req.timings_ms["admit"] = _ms(t0)
        t1 = time.perf_counter()
        try:
            if req.hit_blocks:
                req.restored_bytes = cache.restore(req.hit, req.rid, req.state_pages)
                cache.release_checkpoint(req.rid)
            else:
                zero_state(lay, self.pool, req.state_pages)
        except Exception as err:                         # noqa: BLE001 - that request is rejected
            log.warning("request %d rejected: its restore raised", req.rid, exc_info=err)
            self.reject(req, f"restore failed: {type(err).__name__}: {err}")
            return False
        req.timings_ms["restore"] = _ms(t1)
        req.computed = req.hit_blocks * lay.block_size
        req.shared_kv_bytes = req.hit_blocks * lay.kv_block_bytes
        req.status = RequestStatus.PREFILL
        return True

    def reject(self, req: Request, reason: str | None = None) -> None:
        """REJECTED with ``reason`` (None: its :meth:`shortfall`), everything it held released."""
        reason = self.shortfall(req) if reason is None else reason
        self.release(req)
        req.status, req.reason = RequestStatus.REJECTED, reason

    def release(self, req: Request) -> None:
        """THE path that frees a request's pages (any status): its state pages, its page table (the hit's blocks
        it pinned and its own KV pages), its ReplaySSM ring and its pins in the cache. A waiting request holds
        none of them (:meth:`match` pins nothing)."""
        pool, rid = self.pool, req.rid
        if req.state_pages:
            pool.decref([p for slot in (req.spec_slots or [req.state_pages]) for grp in slot for p in grp], rid)
        pool.decref(req.page_table, rid)
        req.state_pages, req.spec_slots, req.page_table = [], [], []
        if self.replay is not None:                         # the ring goes with the state (nothing to materialise)
            self.replay.release(rid)
        if self.cache is not None:
            self.cache.release(rid)

    def preempt(self, req: Request) -> None:
        """Preempt by recompute: :meth:`release` everything and drop the request's progress and its hit (status
        WAITING; it is matched again when it reaches the head of the queue). Its output, recomputed, is bitwise the uninterrupted one (batch-invariant; a sampling
        request's generator restarts at its seed)."""
        self.release(req)
        req.generator = req.sampling.generator()
        req.status, req.computed, req.output, req.logits = RequestStatus.WAITING, 0, [], []
        req.first_token_t, req.keys, req.prefill_tokens = None, [], 0
        req.restored_bytes = req.shared_kv_bytes = 0
        req.proposer = req.strategy = req.hit = None

    def publish(self, req: Request, upto: int, checkpoint: bool) -> None:
        """Publish the request's full blocks below ``upto`` tokens and, if asked, its checkpoint there
        (then ``upto`` must equal ``computed``, so the state is the state after exactly ``upto``).

        Block keys come from the committed tokens ``tokens()[:computed]`` only. Raises RuntimeError
        naming ``upto`` if the committed tokens do not cover it or the cache raises (the engine aborts the
        request: a failed publish never leaves a request mid-flight, and the engine keeps serving the others).
        """
        N = self.layout.block_size
        nb = upto // N
        try:
            committed = req.tokens()[: req.computed]
            if not upto <= req.computed == len(committed):
                raise RuntimeError(f"request {req.rid}: cannot publish {upto} tokens: the cache consumed "
                                   f"{req.computed} but only {len(committed)} are committed")
            if nb > len(req.keys):
                req.keys = block_keys(committed[: nb * N], N)
            self.cache.publish_blocks(req.keys, req.page_table, nb, req.rid)
            if checkpoint and nb:
                ok = self.cache.publish_checkpoint(req.keys, nb, req.state_pages, req.computed, req.rid)
                req.checkpoints_written += ok
        except Exception as err:
            raise RuntimeError(f"publish at {upto} tokens failed: {type(err).__name__}: {err}") from err

    # ---- integrity ----------------------------------------------------------------------------------
    def check_integrity(self, running: list[Request], waiting: list[Request]) -> None:
        """Assert (AssertionError) the cache's and pool's own invariants; every running request holds its state
        pages and page table with one reference each, enough pages for its tokens; every used page belongs to
        the cache or a live request (no leak: an idle engine holds only cache pages); with ``run_sizes``, each
        running request's state of a group is one run of that many consecutive pages (its slot, never shared);
        with ReplaySSM, every ring belongs to a running request (:meth:`ReplayStateWrite.check_integrity`)."""
        pool, lay = self.pool, self.layout
        if self.cache is not None:
            self.cache.check_integrity()
        else:
            pool.check_integrity()
        if self.replay is not None:
            self.replay.check_integrity([r.rid for r in running])
        owned = set()
        for req in running:
            rid = req.rid
            assert req.status in (RequestStatus.PREFILL, RequestStatus.DECODE), f"running request {rid} is {req.status}"
            slots = req.spec_slots or [req.state_pages]
            pages = [p for slot in slots for grp in slot for p in grp]
            assert len(slots) == self.slots_per_request and req.state_pages in slots, \
                f"request {rid} holds {len(slots)} state slots, not {self.slots_per_request} with its current one"
            assert len(pages) == lay.state_pages * len(slots), f"request {rid} holds {len(pages)} state pages"
            if self.run_sizes is not None:
                assert all(pool.is_run(grp) and len(grp) == n for s in slots for grp, n in zip(s, self.run_sizes)), \
                    f"request {rid}'s state pages {slots} are not one run per group of {self.run_sizes}"
            assert len(req.page_table) * lay.block_size >= req.final_tokens, f"request {rid}: page table too short"
            for p in pages + req.page_table:
                assert pool.holders(p).get(rid) == 1, f"request {rid} does not hold one reference to page {p}"
            owned.update(pages + req.page_table)
        for req in waiting:
            assert req.status is RequestStatus.WAITING and not req.state_pages and not req.page_table, \
                f"waiting request {req.rid} holds pages"
        if self.cache is not None:
            for node in self.cache.index.nodes.values():
                owned.add(node.payload)
                owned.update(p for c in node.ckpts.values() for p in c.payload)
        used = {p for p, (kind, _, _) in enumerate(pool.page_table()) if kind is not PageKind.FREE}
        assert used <= owned, f"leaked pages (used, owned by nobody): {sorted(used - owned)}"
