"""``ServeEngine``: requests through a :class:`HybridLM` with every cache in a :class:`PagePool`,
continuously batched.

``step()`` reads like nano-vllm's ``LLMEngine.step``: schedule (:class:`serve.engine.scheduler.Scheduler`:
admission, decode rows first, prefill chunks in the token budget) -> run (:class:`serve.engine.model_runner.
ModelRunner`: one packed forward over every row, each row's KDA state read and written by slot) ->
postprocess (append tokens, publish blocks and checkpoints, free finished requests). Every request's
tokens and logits are bitwise those of the same request run alone (``kda_core.varlen``: batch
invariance), so batching changes throughput, never an output. With speculation, the decode rows
verify their own drafts in the same forward (one verify row each).

The request flow through memory (match, admit, publish, release) and the checkpoint placement are in
:mod:`serve.engine.request_memory`; the order of the postprocess stage in :mod:`serve.engine.postprocess`.

Fault isolation (as vLLM's and SGLang's engines abort one request and keep serving): an exception raised
while building, running or post-processing one request's row (its drafts, its forward, its sampler, a
publish), non-finite logits, or a non-finite state / cache page met in a forward (NaN would emit token 0
as if it were a prediction) aborts THAT request, with the error as its ``reason``, through the one abort
path (its slot, pages and pins released; nothing of the failed part written, published or emitted), and
the step goes on for the others. A forward that raises is run again row by row to find the rows that
fail alone (:meth:`ServeEngine._run_isolating`); the others run together, bitwise as before (batch
invariance). A failure is the request's if the model still runs a one-token probe from an empty cache
(:meth:`ServeEngine.model_runs`); if it does not, or the batch fails while each of its rows runs alone,
the failure is the engine's: :meth:`ServeEngine.step` raises :class:`EngineFailure` and the engine must
not be stepped again (the server exits so that a supervisor restarts it). A restore that raises at
admission rejects its request with the error as the reason.

State write of a decode step (``state_write``): "slot" writes the request's whole KDA state back to its pages
every step; "replay_ssm" (vllm#47572) appends a ``(k, u, g)`` record per KDA layer to the request's ring and
writes the state every ``ring_size`` steps or when a checkpoint is published at that step
(:mod:`serve.memory.replay_state_write`); the ring is released with the request's pages.

16-bit states (``state_dtype`` bf16 / fp16): a request's state is rounded wherever it is written, so its output
depends on where that happens. Bitwise facts that still hold with the same state dtype and settings: a request
in any batch == its batch-1 run (its prefill chunks do not depend on its neighbours: the scheduler never cuts a
chunk to fit the token budget, :class:`serve.engine.scheduler.SchedulerConfig` ``exact_state``); a preempted request ==
its uninterrupted run (when its recompute restarts cold); the batched engine == ``batched=False``; a cache-on
cold run == the cache-off run.
Facts that hold only in fp32: a warm run from a hit at b == the cold run (the restored checkpoint is rounded at
b; it equals the cache-off run whose prefill is split at b); a chunked prefill == the unchunked one;
``replay_ssm`` == ``slot`` (ReplaySSM rounds at materialisation only, every ``ring_size`` steps, so fewer times).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from kda_core.model import HybridLM
from serve.config import ServeConfig
from serve.engine.model_runner import ModelRunner, Row
from serve.engine.postprocess import Postprocessor, non_finite, where
from serve.engine.request import (
    Request,
    RequestResult,
    RequestStatus,
    prompt_ids,
    read_request_cache,
    write_request_cache,
)
from serve.engine.request_memory import Fit, RequestMemory
from serve.engine.sampling import GREEDY, SamplingParams, sample_token
from serve.engine.scheduler import DONE, Scheduler, SchedulerConfig
from serve.errors import check_choice, check_int
from serve.memory.layout import ENGINE_STATE_DTYPES
from serve.memory.pages import write_kv, write_state
from serve.memory.pool import PagePool
from serve.memory.replay_state_write import ReplayStateWrite
from serve.prefix.cache import PrefixCache
from serve.spec_decode.replay_ssm import DEFAULT_RING_SIZE
from serve.spec_decode.verify import Speculation, draft_budget, speculative_step

__all__ = ["DONE", "STATE_WRITES", "EngineFailure", "Fit", "ServeEngine"]
STATE_WRITES = ("slot", "replay_ssm")
log = logging.getLogger("serve.engine")


class EngineFailure(RuntimeError):
    """Raised by :meth:`ServeEngine.step` for a failure that is no one request's: the model fails its probe,
    or a batch fails although each of its rows runs alone. The engine must not be stepped again."""


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


class ServeEngine:
    """Greedy serving engine with an optional dual-granularity prefix cache.

    Args:
        model: the :class:`HybridLM` (fp32). pool: the :class:`PagePool` holding every cache.
        prefix_cache: a :class:`PrefixCache` on the same pool, or None (no sharing: the reference).
        max_prefill_chunk: optional cap on tokens per prefill forward.
        config: the :class:`ServeConfig` (block size, checkpoint interval, groups); None means the
            cache's, or ``ServeConfig()`` without a cache. The page layout is the cache's, or built once
            from ``config`` on the pool's page size.
        speculation: optional :class:`serve.spec_decode.verify.Speculation` (drafts verified each decode step).
        max_num_seqs / max_num_batched_tokens / num_state_slots: the scheduler's caps
            (:class:`serve.engine.scheduler.SchedulerConfig`; None = no cap).
        batched: False runs the previous one-request-per-forward path (the baseline ``bench.batch``
            measures against); pad_decode: pad decode rows to the bucket sizes (slot -1 rows).
        state_write: how a plain decode step writes a request's KDA state: "slot" (the whole state back
            to its pages every step) or "replay_ssm" (a ``(k, u, g)`` record per step into the request's
            ring, the state materialised every ``ring_size`` steps or at a checkpoint publish; vllm#47572,
            :mod:`serve.memory.replay_state_write`). Tokens and logits are bitwise the same.
        ring_size: decode steps per state write under "replay_ssm" (an int >= 1; SGLang's default 16).
        state_dtype: the stored dtype of the KDA recurrent states (request slots and checkpoints): None keeps
            the config's (``ServeConfig.state_dtype``, fp32 by default), else torch.float32, torch.bfloat16 or
            torch.float16 replaces it (with a prefix cache it must equal the cache's). Compute stays fp32: a
            state is upcast when gathered and rounded to nearest on every write (prefill end and chunk ends,
            decode, verify commit, ReplaySSM materialisation, prefill checkpoints), so a 16-bit state holds
            about twice the slots of fp32 (conv windows and latents stay fp32). See "16-bit states" below.
    Raises ValueError for a cache on another pool, model config or serving config, or bad sizes; for a
    ``state_dtype`` not in :data:`serve.memory.layout.ENGINE_STATE_DTYPES` or unlike the cache's; for
    ``state_write="replay_ssm"`` with speculation (every decode row is then a verify row: use the
    ``ReplaySSM`` rollback strategy) or with ``batched=False``.
    """

    def __init__(self, model: HybridLM, pool: PagePool, prefix_cache: PrefixCache | None = None,
                 max_prefill_chunk: int | None = None, *, config: ServeConfig | None = None,
                 speculation: Speculation | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, num_state_slots: int | None = None,
                 batched: bool = True, pad_decode: bool = True, state_write: str = "slot",
                 ring_size: int = DEFAULT_RING_SIZE, state_dtype: torch.dtype | None = None):
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
            self.config, self.layout = prefix_cache.config, prefix_cache.layout
        else:
            self.config = ServeConfig() if config is None else config
            if not isinstance(self.config, ServeConfig):
                raise ValueError(f"config must be a ServeConfig or None, got {type(config).__name__}")
            if state_dtype is not None:
                self.config = dataclasses.replace(self.config, state_dtype=state_dtype)
            self.layout = self.config.layout(model.cfg, pool.page_bytes)
        if max_prefill_chunk is not None and (not isinstance(max_prefill_chunk, int) or max_prefill_chunk < 1):
            raise ValueError(f"max_prefill_chunk must be None or a positive int, got {max_prefill_chunk!r}")
        self.model, self.pool, self.cache = model, pool, prefix_cache
        self.max_prefill_chunk, self.speculation = max_prefill_chunk, speculation
        self._next_rid = 0
        check_choice("state_write", state_write, STATE_WRITES)
        check_int("ring_size", ring_size)
        if state_write == "replay_ssm" and (speculation is not None or not batched):
            raise ValueError("state_write='replay_ssm' is the plain-decode state write of the batched engine: it "
                             "needs batched=True and no speculation (with speculation, pick the 'ReplaySSM' "
                             "rollback strategy)")
        self.state_write = state_write
        self.replay = ReplayStateWrite(model.cfg, ring_size) if state_write == "replay_ssm" else None
        self.runner = ModelRunner(model, pool, self.layout, pad_decode=pad_decode, replay=self.replay)
        self.memory = RequestMemory(pool, self.layout, prefix_cache, self.config, self.replay)
        self.sched_config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, num_state_slots, max_prefill_chunk,
                                            exact_state=self.config.state_dtype == torch.float32)
        self.scheduler = Scheduler(self.sched_config, self.memory)
        self.postprocess = Postprocessor(model, self.runner, self.scheduler, self._fail_row)
        self.batched = bool(batched)
        self.last_batch = None          # the last step's StepBatch (rows, metadata): for pages and tests

    # ---- the queues, read through the scheduler ----------------------------------------------------
    @property
    def requests(self) -> dict[int, Request]:
        """Every request not yet released (:meth:`release`), by id (the scheduler's; read it, never write)."""
        return self.scheduler.requests

    @property
    def waiting(self) -> list[int]:
        """Ids of the waiting requests, oldest first (the scheduler's; read it, never write)."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[int]:
        """Ids of the running requests (PREFILL or DECODE), oldest first (the scheduler's; read it, never write)."""
        return self.scheduler.running

    # ---- public API -------------------------------------------------------------------------------
    def submit(self, tokens, max_new_tokens: int, record_logits: bool = False,
               sampling: SamplingParams | None = None) -> int:
        """Queue a prompt ``[T]`` of byte ids for ``max_new_tokens`` tokens; returns its id. ``sampling``:
        a :class:`serve.engine.sampling.SamplingParams` (None: greedy); the request draws from its own generator,
        so a seeded request's tokens equal its batch-1 run's. ``record_logits`` keeps each emitted token's
        logits ``[256]`` fp32 (with speculation: the verify rows of the accepted drafts and the bonus). With a
        cache, the prompt is matched and its hit pinned now. Raises ValueError on bad input, or for sampling
        with speculation (its verify step accepts drafts greedily); TypeError for ``sampling`` of another type."""
        t0 = time.perf_counter()
        prompt = prompt_ids(tokens, self.model.cfg.vocab_size)
        check_int("max_new_tokens", max_new_tokens)
        sampling = GREEDY if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
        if self.speculation is not None and not sampling.greedy:
            raise ValueError("sampling (temperature > 0) is not supported with speculation: drafts are accepted "
                             "greedily")
        rid = self._next_rid
        self._next_rid += 1
        req = Request(rid, prompt, max_new_tokens, record_logits, t0, sampling=sampling.seeded())
        req.generator = req.sampling.generator()
        self.memory.match(req)
        req.timings_ms["lookup"] = _ms(t0)
        self.scheduler.add(req)
        return rid

    def step(self) -> bool:
        """schedule -> run -> postprocess. Admit what fits (FCFS; a request that can never fit is REJECTED
        with its reason), then run one forward over every decoding request (one token each, decode rows
        first) and the prefill chunks that fit the token budget. Returns False when there was nothing to
        do (admitting or rejecting counts as work). With ``batched=False`` the previous path runs: one
        prefill chunk of the oldest prefilling request, or else each decoding request alone. A failure of
        one request's row aborts that request (its ``reason``) and the others go on; raises
        :class:`EngineFailure` for a failure that is no one request's (see "Fault isolation" above)."""
        if not self.batched:
            return self._step_unbatched()
        sched = self.scheduler.schedule()
        if sched.empty:
            return sched.admitted
        rows, bases = self._rows(sched.decode, sched.prefill)
        t0 = time.perf_counter()
        batch = self._run_isolating(*rows)
        if batch is not None:
            self.last_batch = batch
            self.postprocess(batch, bases, _ms(t0))
        return True

    # ---- run ----------------------------------------------------------------------------------------
    def _row(self, req: Request, n: int | None) -> Row:
        """This step's row of ``req``: a decode row (``n`` None), a verify row with speculation (the last token
        and up to ``draft_budget`` drafts of its proposer) or a prefill row of its next ``n`` prompt tokens (with
        the checkpoint offsets inside them)."""
        if n is None and self.speculation is None:
            return Row(req, [req.output[-1]], req.computed, True)
        if n is None:                                    # every decoding row verifies its own drafts
            spec = self.speculation
            if req.strategy is None:
                req.proposer, req.strategy = spec.proposer(list(req.prompt)), spec.strategy()
            n = draft_budget(spec.num_draft_tokens, req.computed, req.max_new_tokens - len(req.output),
                             self.memory.final_boundary(req))
            drafts = [int(t) for t in req.proposer.propose(req.tokens(), n)[:n]]
            return Row(req, [req.output[-1], *drafts], req.computed, False, verify=True)
        p = req.computed
        inner = tuple(b - p for b in self.memory.checkpoint_boundaries(len(req.prompt)) if p < b < p + n)
        return Row(req, req.prompt[p: p + n], p, False, inner)

    def _rows(self, decode: list, prefill: list) -> tuple[tuple[list, list, list], dict]:
        """The rows of this step, ``(decode, prefill, verify)``, built one request at a time (a request whose row
        fails to build is aborted), and the cache each verify row starts from (rid -> HybridCache)."""
        rows, prefill_rows, verify, bases = [], [], [], {}
        for req, n in [(req, None) for req in decode] + list(prefill):
            try:
                row = self._row(req, n)
                if row.verify:
                    bases[req.rid] = read_request_cache(self.layout, self.pool, req)
            except Exception as err:                     # noqa: BLE001 - that request is aborted
                self._fail_row(req, "building its row for this step", err)
                continue
            (verify if row.verify else rows if row.decode else prefill_rows).append(row)
        return (rows, prefill_rows, verify), bases

    def _run_isolating(self, decode: list, prefill: list, verify: list):
        """Build and run the batch. If that raises (a row's non-finite state or cache page, NonFiniteError
        from the chunk kernel; any other error of one row), find the rows that fail by running each alone,
        abort them (:meth:`_fail_row`: nothing of them written, published or emitted) and run the others
        together. Returns the run StepBatch, or None if no row is left. Raises EngineFailure if the batch
        of the rows that each ran alone fails again (a failure of no one row)."""
        try:
            return self.runner.run(self.runner.build(decode, prefill, verify))
        except Exception as err:                         # noqa: BLE001 - isolated below
            log.warning("a batch of %d rows raised %s: %s; running its rows one at a time", len(decode) +
                        len(prefill) + len(verify), type(err).__name__, err)
        keep = {"decode": [], "prefill": [], "verify": []}
        for kind, rows in (("decode", decode), ("prefill", prefill), ("verify", verify)):
            for row in rows:
                one = {"decode": [], "prefill": [], "verify": [], kind: [row]}
                try:
                    self.runner.run(self.runner.build(one["decode"], one["prefill"], one["verify"]))
                    keep[kind].append(row)
                except Exception as err:                 # noqa: BLE001 - that request is aborted
                    self._fail_row(row.req, where(row), err)
        if not any(keep.values()):
            return None
        try:
            return self.runner.run(self.runner.build(keep["decode"], keep["prefill"], keep["verify"]))
        except Exception as err:
            raise EngineFailure(f"a batch fails although each of its rows runs alone: {type(err).__name__}: "
                                f"{err}") from err

    def model_runs(self) -> bool:
        """Whether the model still runs: one token from an empty cache gives finite logits. What tells a
        request's failure (the model runs: abort the request) from the model's (it does not)."""
        try:
            out = self.model.forward(torch.zeros(1, 1, dtype=torch.long))
            return bool(torch.isfinite(out.logits).all())
        except Exception:                                # noqa: BLE001 - the answer is "no"
            return False

    def _fail_row(self, req: Request, where: str, error: BaseException | str) -> None:
        """A failure met in ``req``'s row at ``where`` (an exception, or a message such as non-finite logits):
        abort the request (:meth:`abort`: ABORTED, its slot, pages and pins released; ``reason`` names
        ``where`` and the error) if the model still runs (:meth:`model_runs`). Raises EngineFailure if it
        does not: the failure is the model's, not the request's."""
        detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if not self.model_runs():
            raise EngineFailure(f"the model fails a one-token probe from an empty cache (after request "
                                f"{req.rid}'s {where} failed: {detail})") from (None if isinstance(error, str)
                                                                                  else error)
        log.warning("request %d aborted: %s: %s", req.rid, where, detail,
                    exc_info=None if isinstance(error, str) else error)
        if self.abort(req.rid):
            req.reason = f"{where}: {detail}"

    def _step_unbatched(self) -> bool:
        """The previous engine's step (batch 1 per forward), kept as the measured baseline."""
        admitted = False
        while self.waiting:
            req = self.requests[self.waiting[0]]
            self.memory.rematch(req)
            fit = self.memory.can_admit(req, bool(self.running))
            if fit is Fit.LATER:
                break
            self.scheduler.waiting.pop(0)
            if fit is Fit.NEVER:
                self.memory.reject(req)
            elif self.memory.admit(req):
                self.scheduler.running.append(req.rid)
            admitted = True
        for rid in self.running:
            req = self.requests[rid]
            if req.status is RequestStatus.PREFILL:
                try:
                    self._prefill_chunk(req)
                except Exception as err:                 # noqa: BLE001 - that request is aborted
                    self._fail_row(req, f"prefill of tokens [{req.computed}, {self._prefill_end(req)})", err)
                return True
        decoding = [self.requests[r] for r in self.running if self.requests[r].status is RequestStatus.DECODE]
        for req in decoding:
            try:
                self._decode_one(req)
            except Exception as err:                     # noqa: BLE001 - that request is aborted
                self._fail_row(req, f"decode of output token {len(req.output)}", err)
        return bool(decoding) or admitted

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        """Step until every request is FINISHED, ABORTED or REJECTED (a rejected request's reason is in
        its :meth:`result`); returns the steps taken. Raises RuntimeError if ``max_steps`` is reached or
        waiting requests can make no progress."""
        steps = 0
        while self.waiting or self.running:
            if steps >= max_steps:
                raise RuntimeError(f"engine not idle after {max_steps} steps")
            if not self.step() and not self.running:
                raise RuntimeError("waiting requests cannot be admitted and nothing is running")
            steps += 1
        return steps

    def abort(self, rid: int) -> bool:
        """Abort a waiting or running request, releasing its pins and pages. Returns False if it had
        already ended. Raises ValueError for an unknown id."""
        return self.scheduler.abort(rid)

    def result(self, rid: int) -> RequestResult:
        """The :class:`RequestResult` of a request (any status). Raises ValueError for an unknown id."""
        return self.scheduler.get(rid).result()

    def generate(self, tokens, max_new_tokens: int, record_logits: bool = False,
                 sampling: SamplingParams | None = None) -> RequestResult:
        """Submit one request and run until idle; returns its result (status REJECTED with ``reason``
        when it can never fit the pool). Raises ValueError on bad input (see :meth:`submit`)."""
        rid = self.submit(tokens, max_new_tokens, record_logits, sampling)
        self.run_until_idle()
        return self.result(rid)

    def preempt_newest(self) -> int | None:
        """Preempt the newest running request by recompute (nano-vllm's ``Scheduler.preempt``): its slot
        and pages are freed and it goes back to the head of the waiting queue. Returns its id, or None."""
        req = self.scheduler.preempt_newest()
        return None if req is None else req.rid

    # ---- the batch-1 path --------------------------------------------------------------------------

    def _prefill_chunk(self, req: Request) -> None:
        """One prefill forward over ``[p, end)`` (the whole rest of the prompt unless
        ``max_prefill_chunk`` caps it). Every checkpoint boundary inside it comes from the same forward
        (``state_at``: the state after exactly b tokens), which runs on the 64-token chunk grid from p
        (``kda_core.chunk.CHUNK_SIZE``) whatever the boundaries are. So a warm prefill from a hit b that
        is a multiple of 64 computes every token bitwise as the cache-off run does (which starts at 0),
        provided ``max_prefill_chunk`` is None or a multiple of 64; from any other b it differs by
        rounding (the grid moves; a few 1e-6 in the logits of the demo model)."""
        L, p, end = len(req.prompt), req.computed, self._prefill_end(req)
        marks = [b for b in self.memory.checkpoint_boundaries(L) if b > p]
        inner = [b - p for b in marks if b < end]
        t0 = time.perf_counter()
        out = self.model.forward(torch.tensor([req.prompt[p:end]]), read_request_cache(self.layout, self.pool, req),
                                 mode="chunk", state_at=tuple(inner))
        bad = non_finite(out.logits[0, -1])
        if bad is not None:
            self._fail_row(req, f"prefill of tokens [{p}, {end})", bad)
            return
        if inner:  # latents first (blocks below each boundary), then each boundary's state
            write_kv(self.layout, self.pool, req.page_table, p,
                     [out.cache.layers[i][:, p:] for i in self.model.cfg.mla_layers])
        req.timings_ms["prefill"] += _ms(t0)
        t1 = time.perf_counter()
        for t in inner:
            write_state(self.layout, self.pool, req.state_pages, out.states_at[t])
            req.computed = p + t
            self.memory.publish(req, p + t, True)
        req.timings_ms["checkpoint"] += _ms(t1)
        t0 = time.perf_counter()
        write_request_cache(self.layout, self.pool, req, out.cache, p)
        req.prefill_tokens += end - p
        req.timings_ms["prefill"] += _ms(t0)
        if self.cache is not None:
            t1 = time.perf_counter()
            self.memory.publish(req, end, end in marks)
            req.timings_ms["checkpoint"] += _ms(t1)
        if end == L:
            self.postprocess.append(req, sample_token(out.logits[0, -1], req.sampling, req.generator),
                                    out.logits[0, -1])
            self.postprocess.finish_if_done(req)

    def _prefill_end(self, req: Request) -> int:
        """Where the unbatched path's next prefill chunk of ``req`` ends: the prompt's end, or
        ``max_prefill_chunk`` tokens on."""
        L, p = len(req.prompt), req.computed
        return L if self.max_prefill_chunk is None else min(L, p + self.max_prefill_chunk)

    def _decode_one(self, req: Request) -> None:
        """One decode step (a verify step with speculation) in three transitions, in this order:

        1. compute: the new cache is written to the request's pages (``computed`` advances by the
           tokens consumed: the fed-back token plus the accepted drafts);
        2. commit: every emitted token is appended to ``output`` (accepted drafts, then the bonus), so
           ``tokens()[:computed]`` is again exactly what the cache consumed;
        3. publish, if the cache landed on the end boundary ``b_end``, then finish if the request has all
           its tokens (finishing releases the pages the publish reads).

        Publishing before step 2 built the block keys from fewer tokens than the cache had consumed
        whenever a verify accepted drafts onto the boundary (the class of bug in vllm-project/vllm#53505: a commit
        landing on a boundary must publish the state after exactly that many tokens).
        """
        b_end = self.memory.final_boundary(req)
        cache = read_request_cache(self.layout, self.pool, req)
        where = f"decode of output token {len(req.output)}"
        if self.speculation is None:
            logits, new = self.model.decode_step(req.output[-1], cache)
            bad = non_finite(logits)
            if bad is not None:
                self._fail_row(req, where, bad)
                return
            write_request_cache(self.layout, self.pool, req, new, req.computed)
            emitted, rows = [sample_token(logits[0], req.sampling, req.generator)], [logits[0]]
        else:
            spec = self.speculation
            if req.strategy is None:
                req.proposer, req.strategy = spec.proposer(list(req.prompt)), spec.strategy()
            n = draft_budget(spec.num_draft_tokens, req.computed, req.max_new_tokens - len(req.output), b_end)
            res = speculative_step(self.model, cache, req.tokens(), req.proposer, req.strategy, n)
            bad = non_finite(res.logits)
            if bad is not None:
                self._fail_row(req, where, bad)
                return
            write_request_cache(self.layout, self.pool, req, res.state.cache, req.computed)
            emitted, rows = list(res.emitted_tokens), list(res.logits)      # rows: a + 1 of [256]
            req.drafted_tokens += len(res.draft_tokens)
            req.accepted_tokens += res.num_accepted
        for tok, row in zip(emitted, rows):
            self.postprocess.append(req, tok, row)
        if b_end is not None and req.computed == b_end:
            self.memory.publish(req, b_end, True)
        self.postprocess.finish_if_done(req)

    # ---- integrity ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert engine invariants (AssertionError): the cache's and pool's own; every running request
        holds its state pages and page table with one reference each, enough pages for its tokens; every
        used page belongs to the cache or a live request (no leak, so an idle engine holds only cache pages);
        with ``state_write="replay_ssm"``, every ring belongs to a running request and holds fewer than
        ``ring_size`` finite records (:meth:`ReplayStateWrite.check_integrity`)."""
        cap = self.sched_config.max_running
        assert cap is None or len(self.running) <= cap, f"{len(self.running)} running > {cap} (state slots / max_num_seqs)"
        self.memory.check_integrity([self.requests[r] for r in self.running], [self.requests[r] for r in self.waiting])
