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

The state write of a decode step (``state_write``) and what stays bitwise with 16-bit states are in the
package docstring (:mod:`serve.engine`).
"""
from __future__ import annotations

import logging
import time

import torch

from kda_core.model import HybridLM
from serve.config import ServeConfig
from serve.engine.model_runner import ModelRunner, Row
from serve.engine.postprocess import Postprocessor, where
from serve.engine.request import Request, RequestResult, prompt_ids, read_request_cache
from serve.engine.request_memory import RequestMemory, resolve_layout
from serve.engine.sampling import GREEDY, SamplingParams
from serve.engine.scheduler import Scheduler, SchedulerConfig
from serve.errors import check_choice, check_int
from serve.memory.pool import PagePool
from serve.memory.replay_state_write import ReplayStateWrite
from serve.prefix.cache import PrefixCache
from serve.spec_decode.replay_ssm import DEFAULT_RING_SIZE
from serve.spec_decode.verify import Speculation

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
        rows_per_forward: most rows one forward holds (None: every row of the step in one forward); 1 runs each
            row in its own forward, one after the other: the batch-1 baseline ``bench.batch`` and
            ``lab.batching`` measure batching against (same scheduler, same rows, same tokens and logits).
        pad_decode: pad decode rows to the bucket sizes (slot -1 rows).
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
            about twice the slots of fp32 (conv windows and latents stay fp32); what stays bitwise:
            :mod:`serve.engine`.
    Raises ValueError for a cache on another pool, model config or serving config, or bad sizes; for a
    ``state_dtype`` not in :data:`serve.memory.layout.ENGINE_STATE_DTYPES` or unlike the cache's; for
    ``state_write="replay_ssm"`` with speculation (every decode row is then a verify row: use the
    ``ReplaySSM`` rollback strategy); for a ``rows_per_forward`` that is neither None nor an int >= 1.
    """

    def __init__(self, model: HybridLM, pool: PagePool, prefix_cache: PrefixCache | None = None,
                 max_prefill_chunk: int | None = None, *, config: ServeConfig | None = None,
                 speculation: Speculation | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, num_state_slots: int | None = None,
                 rows_per_forward: int | None = None, pad_decode: bool = True, state_write: str = "slot",
                 ring_size: int = DEFAULT_RING_SIZE, state_dtype: torch.dtype | None = None):
        self.config, self.layout = resolve_layout(model, pool, prefix_cache, config, state_dtype)
        if max_prefill_chunk is not None and (not isinstance(max_prefill_chunk, int) or max_prefill_chunk < 1):
            raise ValueError(f"max_prefill_chunk must be None or a positive int, got {max_prefill_chunk!r}")
        self.model, self.pool, self.cache = model, pool, prefix_cache
        self.max_prefill_chunk, self.speculation = max_prefill_chunk, speculation
        self._next_rid = 0
        check_choice("state_write", state_write, STATE_WRITES)
        check_int("ring_size", ring_size)
        if state_write == "replay_ssm" and speculation is not None:
            raise ValueError("state_write='replay_ssm' is the plain-decode state write: it needs no speculation "
                             "(with speculation, pick the 'ReplaySSM' rollback strategy)")
        if rows_per_forward is not None:
            check_int("rows_per_forward", rows_per_forward)
        self.state_write = state_write
        self.replay = ReplayStateWrite(model.cfg, ring_size) if state_write == "replay_ssm" else None
        self.runner = ModelRunner(model, pool, self.layout, pad_decode=pad_decode, replay=self.replay)
        self.memory = RequestMemory(pool, self.layout, prefix_cache, self.config, self.replay,
                                    runs=any(self.runner.in_place), spec_slots=speculation and speculation.snapshot_slots())
        self.sched_config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, num_state_slots, max_prefill_chunk,
                                            exact_state=self.config.state_dtype == torch.float32,
                                            num_spec_tokens=None if speculation is None else speculation.num_draft_tokens)
        self.scheduler = Scheduler(self.sched_config, self.memory)
        self.postprocess = Postprocessor(model, self.runner, self.scheduler, self._fail_row)
        self.rows_per_forward = rows_per_forward
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
        cache, the prompt is looked up and its hit pinned at admission. Raises ValueError on bad input, or for sampling
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
        self.scheduler.add(req)
        return rid

    def step(self) -> bool:
        """schedule -> run -> postprocess. Admit what fits (FCFS; a request that can never fit is REJECTED
        with its reason), then run one forward over every decoding request (one token each, decode rows
        first) and the prefill chunks that fit the token budget. Returns False when there was nothing to
        do (admitting or rejecting counts as work). With ``rows_per_forward`` the rows run in forwards of at
        most that many rows, each postprocessed before the next runs. A failure of one request's row aborts that
        request (its ``reason``) and the others go on; raises :class:`EngineFailure` for a failure that is no one
        request's (see "Fault isolation" in the module docstring)."""
        sched = self.scheduler.schedule()
        if sched.empty:
            return sched.admitted
        rows, bases = self._rows(sched.decode, sched.prefill, sched.drafts)
        for part in self._forwards(*rows):
            if not any(part):                            # every row failed to build (aborted): no forward
                continue
            t0 = time.perf_counter()
            batch = self._run_isolating(*part)
            if batch is not None:
                self.last_batch = batch
                self.postprocess(batch, bases, _ms(t0))
        return True

    # ---- run ----------------------------------------------------------------------------------------
    def _row(self, req: Request, n: int | None, num_drafts: int = 0) -> Row:
        """This step's row of ``req``: a decode row (``n`` None), a verify row with speculation (the last token
        and up to ``num_drafts`` drafts of its proposer: the scheduler's, inside the token budget) or a prefill
        row of its next ``n`` prompt tokens (with the checkpoint offsets inside them)."""
        if n is None and self.speculation is None:
            return Row(req, [req.output[-1]], req.computed, True)
        if n is None:                                    # every decoding row verifies its own drafts
            spec = self.speculation
            if req.strategy is None:
                req.proposer, req.strategy = spec.proposer(list(req.prompt)), spec.strategy()
            n = num_drafts
            drafts = [int(t) for t in req.proposer.propose(req.tokens(), n)[:n]]
            return Row(req, [req.output[-1], *drafts], req.computed, False, verify=True)
        p = req.computed
        inner = tuple(b - p for b in self.memory.checkpoint_boundaries(len(req.prompt)) if p < b < p + n)
        return Row(req, req.prompt[p: p + n], p, False, inner)

    def _rows(self, decode: list, prefill: list, drafts: dict) -> tuple[tuple[list, list, list], dict]:
        """The rows of this step, ``(decode, prefill, verify)``, built one request at a time (a request whose row
        fails to build is aborted), and the cache each verify row starts from (rid -> HybridCache)."""
        rows, prefill_rows, verify, bases = [], [], [], {}
        for req, n in [(req, None) for req in decode] + list(prefill):
            try:
                row = self._row(req, n, drafts.get(req.rid, 0))
                if row.verify:                           # None: its states go into its k + 1 slots
                    bases[req.rid] = None if req.spec_slots else read_request_cache(self.layout, self.pool, req)
            except Exception as err:                     # noqa: BLE001 - that request is aborted
                self._fail_row(req, "building its row for this step", err)
                continue
            (verify if row.verify else rows if row.decode else prefill_rows).append(row)
        return (rows, prefill_rows, verify), bases

    def _forwards(self, decode: list, prefill: list, verify: list) -> list[tuple[list, list, list]]:
        """The step's rows split into forwards of at most ``rows_per_forward`` rows (one forward when None),
        each ``(decode, prefill, verify)``, in row order (decode, verify, then prefill)."""
        k = self.rows_per_forward
        if k is None:
            return [(decode, prefill, verify)]
        tagged = [(0, r) for r in decode] + [(2, r) for r in verify] + [(1, r) for r in prefill]
        parts = []
        for i in range(0, len(tagged), k):
            part = ([], [], [])
            for kind, row in tagged[i: i + k]:
                part[kind].append(row)
            parts.append(part)
        return parts

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

    def release(self, rid: int) -> RequestResult:
        """Forget an ended request (FINISHED, ABORTED or REJECTED): it leaves :attr:`requests` and its final
        :class:`RequestResult` is returned (a long-running server calls this once it has sent the result).
        Raises ValueError for an unknown id or one still waiting or running (:meth:`abort` it first)."""
        return self.scheduler.pop(rid).result()

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
