"""``ServeEngine``: requests through a :class:`HybridLM` with every cache in a :class:`PagePool`,
continuously batched.

``step()`` reads like nano-vllm's ``LLMEngine.step``: schedule (:class:`serve.engine.scheduler.Scheduler`:
admission, decode rows first, prefill chunks in the token budget) -> run (:class:`serve.engine.model_runner.
ModelRunner`: one packed forward over every row, each row's KDA state read and written by slot) ->
postprocess (append tokens, publish blocks and checkpoints, free finished requests). Every request's
tokens and logits are bitwise those of the same request run alone (``kda_core.varlen``: batch
invariance), so batching changes throughput, never an output. With speculation, the decode rows
verify their own drafts in the same forward (one verify row each).

Request flow:

  submit  -> lookup + pin the hit (pins before anything is allocated)     WAITING
  admit   -> allocate private KDA_STATE pages + own KV pages (evicting
             unpinned cache entries), restore the checkpoint into the
             private pages (copy-on-write), drop the checkpoint pin      PREFILL
  prefill -> one forward yields the state after exactly b tokens for every
             checkpoint boundary b inside it (chunk states of kda_chunk
             on its 64-token grid, plus one short chunk for a b off
             it); full blocks published as they complete              DECODE
  decode  -> one token per step (accepted drafts + one with speculation),
             committed to the request first; when the cache reaches its
             final last full block, that block and its checkpoint are
             published; then the request finishes if it is complete     FINISHED
  abort / reject -> every page and pin the request held is released.

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

Checkpoint placement (C = interval, N = block size, L = prompt length): every multiple of C reached
during prefill, the replay boundary floor((L - 1) / N) N, the end of the prompt floor(L / N) N, and at
the request's end the last full block of prompt + output. Without a prefix cache the engine runs
the same pages with no sharing: it is the reference.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import time
from itertools import islice

import torch

from kda_core.model import ForwardOutput, HybridCache, HybridLM
from serve.config import ServeConfig
from serve.engine.model_runner import ModelRunner, Row
from serve.engine.request import (
    Request,
    RequestResult,
    RequestStatus,
    prompt_ids,
    read_request_cache,
    write_request_cache,
)
from serve.engine.sampling import GREEDY, SamplingParams, sample_token
from serve.engine.scheduler import Scheduler, SchedulerConfig
from serve.errors import check_choice, check_int
from serve.memory.layout import ENGINE_STATE_DTYPES
from serve.memory.pages import write_kv, write_state, zero_state
from serve.memory.pool import PageKind, PagePool, PoolExhausted
from serve.memory.replay_state_write import ReplayStateWrite
from serve.prefix.cache import PrefixCache
from serve.prefix.index import block_keys
from serve.spec_decode.replay_ssm import DEFAULT_RING_SIZE
from serve.spec_decode.verify import Speculation, draft_budget, greedy_accept, speculative_step

DONE = (RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.REJECTED)
STATE_WRITES = ("slot", "replay_ssm")
log = logging.getLogger("serve.engine")


class EngineFailure(RuntimeError):
    """Raised by :meth:`ServeEngine.step` for a failure that is no one request's: the model fails its probe,
    or a batch fails although each of its rows runs alone. The engine must not be stepped again."""


class Fit(enum.Enum):
    """The answer of :meth:`ServeEngine.can_admit`: the request's pages fit NOW (free + evictable),
    LATER (once running requests finish), or NEVER (not even in an otherwise idle pool)."""

    NOW = "now"
    LATER = "later"
    NEVER = "never"


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
        self.requests: dict[int, Request] = {}
        self.waiting: list[int] = []
        self.running: list[int] = []
        self._next_rid = 0
        self.sched_config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, num_state_slots, max_prefill_chunk,
                                            exact_state=self.config.state_dtype == torch.float32)
        self.scheduler = Scheduler(self.sched_config, self, self.requests, self.waiting, self.running)
        check_choice("state_write", state_write, STATE_WRITES)
        check_int("ring_size", ring_size)
        if state_write == "replay_ssm" and (speculation is not None or not batched):
            raise ValueError("state_write='replay_ssm' is the plain-decode state write of the batched engine: it "
                             "needs batched=True and no speculation (with speculation, pick the 'ReplaySSM' "
                             "rollback strategy)")
        self.state_write = state_write
        self.replay = ReplayStateWrite(model.cfg, ring_size) if state_write == "replay_ssm" else None
        self.runner = ModelRunner(model, pool, self.layout, pad_decode=pad_decode, replay=self.replay)
        self.batched = bool(batched)
        self.last_batch = None          # the last step's StepBatch (rows, metadata): for pages and tests

    # ---- public API -------------------------------------------------------------------------------
    def submit(self, tokens, max_new_tokens: int, record_logits: bool = False,
               sampling: SamplingParams | None = None) -> int:
        """Queue a prompt ``[T]`` of byte ids for ``max_new_tokens`` tokens; returns its id. ``sampling``:
        a :class:`serve.engine.sampling.SamplingParams` (None: greedy); the request draws from its own generator, so
        a seeded request's tokens equal its batch-1 run's. ``record_logits`` keeps each emitted token's
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
        if self.cache is not None:
            req.hit = self.cache.lookup(prompt)
            self.cache.acquire(req.hit, rid)
        req.timings_ms["lookup"] = _ms(t0)
        self.requests[rid] = req
        self.waiting.append(rid)
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
        sched = self.scheduler.schedule(Fit.NOW, Fit.NEVER)
        if sched.empty:
            return sched.admitted
        self._run_batch(sched.decode, sched.prefill)
        return True

    def _drafts(self, req: Request) -> Row:
        """A verify row: the last token and up to ``draft_budget`` drafts of the request's proposer."""
        spec = self.speculation
        if req.strategy is None:
            req.proposer, req.strategy = spec.proposer(list(req.prompt)), spec.strategy()
        b_end = None if self.cache is None else self.config.final_checkpoint(len(req.prompt), req.final_tokens)
        n = draft_budget(spec.num_draft_tokens, req.computed, req.max_new_tokens - len(req.output), b_end)
        drafts = [int(t) for t in req.proposer.propose(req.tokens(), n)[:n]]
        return Row(req, [req.output[-1], *drafts], req.computed, False, verify=True)

    def _row(self, req: Request, n: int | None) -> Row:
        """This step's row of ``req``: a decode row (``n`` None; a verify row with speculation) or a prefill
        row of its next ``n`` prompt tokens (with the checkpoint offsets inside them)."""
        if n is None:
            if self.speculation is not None:           # every decoding row verifies its own drafts
                return self._drafts(req)
            return Row(req, [req.output[-1]], req.computed, True)
        p = req.computed
        inner = tuple(b - p for b in self.checkpoint_boundaries(len(req.prompt)) if p < b < p + n)
        return Row(req, req.prompt[p: p + n], p, False, inner)

    def _run_batch(self, decode: list, prefill: list) -> None:
        """Build the rows (one request at a time), run one forward, then postprocess (checkpoints inside
        prefill chunks, commit the states, then per row: publish, append the token, finish; a verify row
        commits through its rollback strategy: vLLM's per-row ``num_accepted_tokens``). A row that fails
        in any of these aborts its request only (:meth:`_fail_row`)."""
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
        t0 = time.perf_counter()
        batch = self._run_isolating(rows, prefill_rows, verify)
        if batch is None:
            return
        self.last_batch = batch
        fwd_ms = _ms(t0)
        finite = torch.isfinite(batch.logits).all(dim=-1).tolist()      # [N]: one check for every row
        for i, row in enumerate(batch.rows):             # 0. non-finite logits abort their row only
            if row.req is not None and (row.verify or not finite[i]):
                bad = _non_finite(batch.verify[i].logits if row.verify else batch.logits[i])
                if bad is not None:
                    self._fail_row(row.req, self._where(row), bad)
        for i, row in enumerate(batch.rows):             # 1. checkpoints inside each prefill chunk
            if row.req is None or row.decode or row.verify or row.req.status is RequestStatus.ABORTED:
                continue
            req = row.req
            req.timings_ms["prefill"] += fwd_ms
            t1 = time.perf_counter()
            try:
                for t in row.state_at:
                    write_state(self.layout, self.pool, req.state_pages, batch.states_at[i][t])
                    req.computed = row.start + t
                    self._publish(req, row.start + t, True)
            except Exception as err:                     # noqa: BLE001 - that request is aborted
                self._fail_row(req, self._where(row), err)
            req.timings_ms["checkpoint"] += _ms(t1)
        publish = {row.req.rid for row in batch.rows if row.decode and row.req is not None
                   and row.req.computed + 1 == self._final_boundary(row.req)}   # these must materialise
        self.runner.commit(batch, lambda r: r.status in (RequestStatus.PREFILL, RequestStatus.DECODE)
                           and r.rid not in bases, publish)  # 2. (a verify row's state: its strategy's commit)
        for i, row in enumerate(batch.rows):             # 3. publish, append, finish
            req = row.req
            if req is None or req.status not in (RequestStatus.PREFILL, RequestStatus.DECODE):
                continue
            try:
                if row.verify:
                    self._postprocess_verify(req, row, batch.verify[i], bases[req.rid])
                elif row.decode:
                    self._postprocess_decode(req, batch.logits[i])
                else:
                    self._postprocess_prefill(req, row, batch.logits[i])
            except Exception as err:                     # noqa: BLE001 - that request is aborted
                self._fail_row(req, self._where(row), err)

    @staticmethod
    def _where(row: Row) -> str:
        if row.decode or row.verify:
            return f"decode of output token {len(row.req.output)}"
        return f"prefill of tokens [{row.start}, {row.start + len(row.tokens)})"

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
                    self._fail_row(row.req, self._where(row), err)
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

    def _postprocess_prefill(self, req: Request, row: Row, logits: torch.Tensor) -> None:
        end, L = row.start + len(row.tokens), len(req.prompt)
        req.computed = end
        req.prefill_tokens += len(row.tokens)
        if self.cache is not None:
            t1 = time.perf_counter()
            self._publish(req, end, end in self.checkpoint_boundaries(L))
            req.timings_ms["checkpoint"] += _ms(t1)
        if end == L:
            self._append(req, sample_token(logits, req.sampling, req.generator), logits)
            self._finish_if_done(req)

    def _postprocess_verify(self, req: Request, row: Row, out, base) -> None:
        """Accept greedily, commit the state after the accepted drafts + 1 through the request's strategy
        (as :func:`serve.spec_decode.verify.verify_and_replay`), write it, then append, publish, finish."""
        b_end = None if self.cache is None else self.config.final_checkpoint(len(req.prompt), req.final_tokens)
        drafts = tuple(row.tokens[1:])
        layers = tuple(out.layers[i] for i in range(self.model.cfg.num_layers))
        verified = ForwardOutput(out.logits, HybridCache(layers, base.num_tokens + len(row.tokens)), out.aux)
        req.strategy.record(self.model, base, verified)
        target = tuple(int(t) for t in out.logits[0].argmax(-1))          # [1 + n] greedy tokens
        a = greedy_accept(drafts, target)
        write_request_cache(self.layout, self.pool, req, req.strategy.commit(a), req.computed)
        req.drafted_tokens += len(drafts)
        req.accepted_tokens += a
        for tok, logits in zip(target[: a + 1], out.logits[0, : a + 1]):
            self._append(req, tok, logits)
        if b_end is not None and req.computed == b_end:
            self._publish(req, b_end, True)
        self._finish_if_done(req)

    def _final_boundary(self, req: Request) -> int | None:
        """b_end: where the request publishes its final checkpoint (None without a cache or if none)."""
        return None if self.cache is None else self.config.final_checkpoint(len(req.prompt), req.final_tokens)

    def _postprocess_decode(self, req: Request, logits: torch.Tensor) -> None:
        b_end = self._final_boundary(req)
        req.computed += 1
        self._append(req, sample_token(logits, req.sampling, req.generator), logits)
        if b_end is not None and req.computed == b_end:
            self._publish(req, b_end, True)
        self._finish_if_done(req)

    def _step_unbatched(self) -> bool:
        """The previous engine's step (batch 1 per forward), kept as the measured baseline."""
        admitted = False
        while self.waiting:
            req = self.requests[self.waiting[0]]
            if self.cache is not None:
                self._rematch(req)
            fit = self.can_admit(req)
            if fit is Fit.LATER:
                break
            self.waiting.pop(0)
            if fit is Fit.NOW:
                self.admit(req)
            else:
                self._reject(req, self._shortfall(req))
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
        req = self._get(rid)
        if req.status in DONE:
            return False
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(rid)
        else:
            self.running.remove(rid)
        self._release(req)
        req.status = RequestStatus.ABORTED
        return True

    def result(self, rid: int) -> RequestResult:
        """The :class:`RequestResult` of a request (any status). Raises ValueError for an unknown id."""
        return self._get(rid).result()

    def generate(self, tokens, max_new_tokens: int, record_logits: bool = False,
                 sampling: SamplingParams | None = None) -> RequestResult:
        """Submit one request and run until idle; returns its result (status REJECTED with ``reason``
        when it can never fit the pool). Raises ValueError on bad input (see :meth:`submit`)."""
        rid = self.submit(tokens, max_new_tokens, record_logits, sampling)
        self.run_until_idle()
        return self.result(rid)

    # ---- admission: ask (can_admit), then act (admit) --------------------------------------------
    def _get(self, rid: int) -> Request:
        if rid not in self.requests:
            raise ValueError(f"unknown request id {rid!r}")
        return self.requests[rid]

    def rematch(self, req: Request) -> None:
        """Scheduler hook: re-match a waiting request against the cache (no-op without a cache)."""
        if self.cache is not None:
            self._rematch(req)

    def reject(self, req: Request) -> None:
        """Scheduler hook: reject a request that can never fit, with its shortfall as the reason."""
        self._reject(req, self._shortfall(req))

    def preempt(self, req: Request) -> None:
        """Preempt by recompute: release every page and pin the request holds, drop its progress and
        match it again (status WAITING; the caller puts it back at the head of the queue). Its output,
        recomputed, is bitwise the uninterrupted one (batch-invariant; a sampling request's generator restarts
        at its seed)."""
        self._release(req)
        req.generator = req.sampling.generator()
        req.status, req.computed, req.output, req.logits = RequestStatus.WAITING, 0, [], []
        req.first_token_t, req.keys, req.prefill_tokens = None, [], 0
        req.restored_bytes = req.shared_kv_bytes = 0
        req.proposer = req.strategy = None
        req.hit = None
        if self.cache is not None:
            req.hit = self.cache.lookup(req.prompt)
            self.cache.acquire(req.hit, req.rid)

    def preempt_newest(self) -> int | None:
        """Preempt the newest running request by recompute (nano-vllm's ``Scheduler.preempt``): its slot
        and pages are freed and it goes back to the head of the waiting queue. Returns its id, or None."""
        req = self.scheduler.preempt_newest()
        return None if req is None else req.rid

    def _rematch(self, req: Request) -> None:
        """Swap to a longer hit if the cache gained one since submit (release the old, pin the new)."""
        better = self.cache.lookup(req.prompt)
        if better.num_tokens > req.hit.num_tokens:
            old = req.hit
            self._release(req)
            self.cache.acquire(better, req.rid, replaces=old)
            req.hit = better

    def can_admit(self, req: Request) -> Fit:
        """Whether the waiting request's pages (:meth:`Request.pages_needed`: a state slot and its KV
        pages) fit: LATER while ``max_num_seqs`` / ``num_state_slots`` requests run; NOW in free +
        evictable pages; LATER once running requests release theirs; NEVER if they exceed the pool
        with its pinned hit counted. Pure."""
        need = sum(req.pages_needed(self.layout))
        cap = self.sched_config.max_running
        if cap is not None and len(self.running) >= cap:       # every state slot (or seq) is taken
            return Fit.LATER
        if need <= self.pool.num_free + (0 if self.cache is None else self.cache.evictable_pages()):
            return Fit.NOW
        return Fit.LATER if self.running and need + req.hit_pages <= self.pool.num_pages else Fit.NEVER

    def _shortfall(self, req: Request) -> str:
        (state, kv), free = req.pages_needed(self.layout), self.pool.num_free
        evictable = 0 if self.cache is None else self.cache.evictable_pages()
        return (f"needs {state + kv} pages ({state} state + {kv} KV) but only {free} are free and {evictable} "
                f"evictable; its {req.hit_blocks} hit blocks stay pinned")

    def admit(self, req: Request) -> None:
        """Admit a request :meth:`can_admit` said fits NOW: allocate its state and KV pages (evicting
        unpinned cache entries), restore its hit's checkpoint into its state (copy-on-write) or zero
        it, and move it to PREFILL. If the allocation still fails (PoolExhausted) it is REJECTED; if
        the restore raises (e.g. CheckpointError) it is REJECTED with the error as its reason (logged). Either
        way nothing it held leaks."""
        t0 = time.perf_counter()
        cache, lay = self.cache, self.layout
        num_state, num_kv = req.pages_needed(lay)
        alloc = self.pool.alloc if cache is None else cache.alloc
        try:
            state = alloc(PageKind.KDA_STATE, num_state, req.rid)
            it = iter(state)                                # state_pages: held by the request from here (_release)
            req.state_pages = [tuple(islice(it, lay.group_pages(g))) for g in range(lay.num_groups)]
            req.page_table = ([] if req.hit is None else list(req.hit.kv_pages))
            req.page_table += alloc(PageKind.MLA_KV, num_kv, req.rid)
        except PoolExhausted as err:                        # evictable count was stale: reject cleanly
            self._reject(req, f"pool exhausted at admission: {err}")
            return
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
            self._reject(req, f"restore failed: {type(err).__name__}: {err}")
            return
        req.timings_ms["restore"] = _ms(t1)
        req.computed = req.hit_blocks * lay.block_size
        req.shared_kv_bytes = req.hit_blocks * lay.kv_block_bytes
        req.status = RequestStatus.PREFILL
        self.running.append(req.rid)

    def _reject(self, req: Request, reason: str) -> None:
        """REJECTED with ``reason``: out of the waiting list (if still there), everything released."""
        if req.rid in self.waiting:
            self.waiting.remove(req.rid)
        self._release(req)
        req.status, req.reason = RequestStatus.REJECTED, reason

    def _release(self, req: Request) -> None:
        """THE path that frees a request's pages (any status): its state pages, its page table (or, before
        admission, the hit's KV pages it references) and its pins in the cache."""
        pool, rid = self.pool, req.rid
        if req.state_pages:
            pool.decref([p for grp in req.state_pages for p in grp], rid)
        pages = req.page_table if req.page_table else ([] if req.hit is None else list(req.hit.kv_pages))
        pool.decref(pages, rid)
        req.state_pages, req.page_table = [], []
        if self.replay is not None:                         # the ring goes with the state (nothing to materialise)
            self.replay.release(rid)
        if self.cache is not None:
            self.cache.release(rid)

    # ---- compute -----------------------------------------------------------------------------------
    def checkpoint_boundaries(self, num_prompt_tokens: int) -> list[int]:
        """Prefill checkpoint boundaries of a prompt (:meth:`ServeConfig.prefill_checkpoints`); empty
        without a prefix cache."""
        return [] if self.cache is None else self.config.prefill_checkpoints(num_prompt_tokens)

    def _prefill_chunk(self, req: Request) -> None:
        """One prefill forward over ``[p, end)`` (the whole rest of the prompt unless
        ``max_prefill_chunk`` caps it). Every checkpoint boundary inside it comes from the same forward
        (``state_at``: the state after exactly b tokens), which runs on the 64-token chunk grid from p
        (``kda_core.chunk.CHUNK_SIZE``) whatever the boundaries are. So a warm prefill from a hit b that
        is a multiple of 64 computes every token bitwise as the cache-off run does (which starts at 0),
        provided ``max_prefill_chunk`` is None or a multiple of 64; from any other b it differs by
        rounding (the grid moves; a few 1e-6 in the logits of the demo model)."""
        L, p, end = len(req.prompt), req.computed, self._prefill_end(req)
        marks = [b for b in self.checkpoint_boundaries(L) if b > p]
        inner = [b - p for b in marks if b < end]
        t0 = time.perf_counter()
        out = self.model.forward(torch.tensor([req.prompt[p:end]]), read_request_cache(self.layout, self.pool, req),
                                 mode="chunk", state_at=tuple(inner))
        bad = _non_finite(out.logits[0, -1])
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
            self._publish(req, p + t, True)
        req.timings_ms["checkpoint"] += _ms(t1)
        t0 = time.perf_counter()
        write_request_cache(self.layout, self.pool, req, out.cache, p)
        req.prefill_tokens += end - p
        req.timings_ms["prefill"] += _ms(t0)
        if self.cache is not None:
            t1 = time.perf_counter()
            self._publish(req, end, end in marks)
            req.timings_ms["checkpoint"] += _ms(t1)
        if end == L:
            self._append(req, sample_token(out.logits[0, -1], req.sampling, req.generator), out.logits[0, -1])
            self._finish_if_done(req)

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
        b_end = None if self.cache is None else self.config.final_checkpoint(len(req.prompt), req.final_tokens)
        cache = read_request_cache(self.layout, self.pool, req)
        where = f"decode of output token {len(req.output)}"
        if self.speculation is None:
            logits, new = self.model.decode_step(req.output[-1], cache)
            bad = _non_finite(logits)
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
            bad = _non_finite(res.logits)
            if bad is not None:
                self._fail_row(req, where, bad)
                return
            write_request_cache(self.layout, self.pool, req, res.state.cache, req.computed)
            emitted, rows = list(res.emitted_tokens), list(res.logits)      # rows: a + 1 of [256]
            req.drafted_tokens += len(res.draft_tokens)
            req.accepted_tokens += res.num_accepted
        for tok, row in zip(emitted, rows):
            self._append(req, tok, row)
        if b_end is not None and req.computed == b_end:
            self._publish(req, b_end, True)
        self._finish_if_done(req)

    def _append(self, req: Request, token: int, logits: torch.Tensor | None) -> None:
        """Commit one emitted token (and its ``logits [256]`` fp32 if recorded); the first sets TTFT and
        moves the request to DECODE. Touches no page."""
        req.output.append(token)
        if req.record_logits:
            req.logits.append(logits.clone())
        if req.first_token_t is None:
            req.first_token_t = time.perf_counter()
            req.status = RequestStatus.DECODE

    def _finish_if_done(self, req: Request) -> None:
        """FINISHED once ``max_new_tokens`` are out: leave the running list, release pages and pins."""
        if len(req.output) == req.max_new_tokens:
            self.running.remove(req.rid)
            self._release(req)
            req.status, req.finish_t = RequestStatus.FINISHED, time.perf_counter()

    def _publish(self, req: Request, upto: int, checkpoint: bool) -> None:
        """Publish the request's full blocks below ``upto`` tokens and, if asked, its checkpoint there
        (then ``upto`` must equal ``computed``, so the state is the state after exactly ``upto``).

        Block keys come from the committed tokens ``tokens()[:computed]`` only. Raises RuntimeError
        naming ``upto`` if the committed tokens do not cover it or the cache raises (the caller aborts the
        request through :meth:`_fail_row`: a failed publish never leaves a request mid-flight, and the
        engine keeps serving the others).
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

    # ---- integrity ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert engine invariants (AssertionError): the cache's and pool's own; every running request
        holds its state pages and page table with one reference each, enough pages for its tokens; every
        used page belongs to the cache or a live request (no leak, so an idle engine holds only cache pages);
        with ``state_write="replay_ssm"``, every ring belongs to a running request and holds fewer than
        ``ring_size`` finite records (:meth:`ReplayStateWrite.check_integrity`)."""
        pool, lay = self.pool, self.layout
        if self.cache is not None:
            self.cache.check_integrity()
        else:
            pool.check_integrity()
        if self.replay is not None:
            self.replay.check_integrity(self.running)
        cap = self.sched_config.max_running
        assert cap is None or len(self.running) <= cap, f"{len(self.running)} running > {cap} (state slots / max_num_seqs)"
        owned = set()
        for rid in self.running:
            req = self.requests[rid]
            assert req.status in (RequestStatus.PREFILL, RequestStatus.DECODE), f"running request {rid} is {req.status}"
            pages = [p for grp in req.state_pages for p in grp]
            assert len(pages) == lay.state_pages, f"request {rid} holds {len(pages)} state pages"
            assert len(req.page_table) * lay.block_size >= req.final_tokens, f"request {rid}: page table too short"
            for p in pages + req.page_table:
                assert pool.holders(p).get(rid) == 1, f"request {rid} does not hold one reference to page {p}"
            owned.update(pages + req.page_table)
        for rid in self.waiting:
            req = self.requests[rid]
            assert req.status is RequestStatus.WAITING and not req.state_pages, f"waiting request {rid} holds pages"
            if req.hit is not None:
                owned.update(req.hit.kv_pages)
                owned.update(p for grp in req.hit.checkpoint_pages for p in grp)
        if self.cache is not None:
            for node in self.cache.index.nodes.values():
                owned.add(node.payload)
                owned.update(p for c in node.ckpts.values() for p in c.payload)
        used = {p for p, (kind, _, _) in enumerate(pool.page_table()) if kind is not PageKind.FREE}
        assert used <= owned, f"leaked pages (used, owned by nobody): {sorted(used - owned)}"


def _non_finite(logits: torch.Tensor) -> str | None:
    """Why ``logits`` cannot be sampled (NaN / inf values: a non-finite state or cache page met in the
    forward; argmax of all-NaN would emit token 0 as if it were a prediction), or None if they are finite."""
    if bool(torch.isfinite(logits).all()):
        return None
    return (f"the logits hold {int((~torch.isfinite(logits)).sum())} NaN/inf value(s) of {logits.numel()} "
            "(a non-finite state or cache page); no token was emitted")
