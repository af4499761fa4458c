"""``EngineLoop``: one background thread that owns the engine; HTTP handlers join and leave its batch.

Every engine call happens on this thread (the engine is not thread-safe). Handlers talk to it through a
command queue (submit, abort, call) and read a per-request :class:`Stream` (an ``asyncio.Queue`` on the
server's event loop, fed with ``call_soon_threadsafe``). The thread's loop, while any request exists:

    drain commands -> hand queued requests to the engine while it holds < max_num_seqs
    -> engine.step() -> push each request's new tokens; a finished / aborted / rejected one gets its end

and sleeps on an event when idle. A failure of one request (its row raised, its logits were NaN) is the engine's to
isolate: that request ends ABORTED with the error as its reason and the others go on (:mod:`serve.engine`, "Fault
isolation"); so ``step()`` raises only for a failure that is no one request's (:class:`serve.engine.EngineFailure`:
the model itself), and then the loop stops at once, as vLLM's engine core does on an error it cannot pin on a request:
every request ends (the handlers answer 503), :attr:`EngineLoop.alive` turns False, :attr:`EngineLoop.error` holds
the cause and ``on_death`` is called (``python -m serve.http`` then exits non-zero so that a supervisor restarts
it). Admission control is here, not in the engine: at most
``max_num_seqs + max_queue`` requests are outstanding; one more raises :class:`QueueFull` at once (the
handler answers 429 with Retry-After), so a client never waits on a queue it cannot join. Uses only the
engine's public API (``submit``, ``step``, ``abort``, ``result``, ``running``, ``waiting``,
``check_integrity``), so a continuous-batching engine with the same API runs here unchanged.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from serve.engine import DONE, ServeEngine
from serve.engine.request import RequestResult, RequestStatus
from serve.engine.sampling import GREEDY, SamplingParams
from serve.errors import check_int
from serve.http.metrics import ServerMetrics
from serve.http.protocol import TokenLogprob
from serve.http.step_trace import StepTrace

log = logging.getLogger("serve.http")

GAUGE_PERIOD_S = 0.05


class Tokens(list):
    """New token ids pushed to a :class:`Stream` (a list of ids), with ``logprobs``: one
    :class:`serve.http.protocol.TokenLogprob` per id when the request asked for them, else None."""

    def __init__(self, ids, logprobs: list | None = None):
        super().__init__(ids)
        self.logprobs = logprobs


def token_logprobs(logits: torch.Tensor, ids, k: int) -> list[TokenLogprob]:
    """The :class:`TokenLogprob` of each emitted id from its logits row ``[T, V]`` (fp32): log-softmax (natural
    log) and the ``k`` most likely ids."""
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)                  # [T, V]
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())  # [T, k]
    return [TokenLogprob(int(t), float(lp[j, t]), tuple(zip(top_i[j].tolist(), top_v[j].tolist())))
            for j, t in enumerate(ids)]


class QueueFull(RuntimeError):
    """Raised by :meth:`EngineLoop.submit` when ``max_num_seqs + max_queue`` requests are outstanding."""


class LoopStopped(RuntimeError):
    """Raised by :meth:`EngineLoop.submit` / :meth:`EngineLoop.call` once the loop is stopped or dead."""


@dataclass
class Stream:
    """One request as the handler sees it. ``events`` yields :class:`Tokens` (lists of new token ids, with their
    logprobs when ``logprobs``, the alternatives per token, is not None), then one :class:`RequestResult` (the end:
    FINISHED, ABORTED or REJECTED). Times are ``perf_counter`` seconds."""

    prompt: list
    max_tokens: int
    events: asyncio.Queue
    aio_loop: asyncio.AbstractEventLoop
    sampling: SamplingParams = GREEDY
    logprobs: int | None = None
    arrival_t: float = field(default_factory=time.perf_counter)
    rid: int | None = None
    feed_t: float | None = None
    sent: int = 0
    first_t: float | None = None
    last_t: float | None = None
    done: bool = False

    def push(self, item) -> None:
        self.aio_loop.call_soon_threadsafe(self.events.put_nowait, item)


class EngineLoop:
    """The engine's thread. ``max_num_seqs``: requests inside the engine at once (state slots);
    ``max_queue``: requests queued in front of it; ``trace``: an optional :class:`StepTrace` that logs every
    step and request (closed when the loop ends); ``on_death``: called once, on the engine thread, with the
    error if the loop dies (an engine failure), after every request has ended. Raises ValueError for bad sizes."""

    def __init__(self, engine: ServeEngine, metrics: ServerMetrics, max_num_seqs: int, max_queue: int,
                 trace: StepTrace | None = None, on_death: Callable[[BaseException], None] | None = None):
        self.engine, self.metrics, self.trace, self.on_death = engine, metrics, trace, on_death
        self.max_num_seqs = check_int("max_num_seqs", max_num_seqs)
        self.max_queue = check_int("max_queue", max_queue, 0)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._outstanding = 0                      # submitted, not yet ended (guarded by _lock)
        self._pending: list[Stream] = []           # engine thread only: queued in front of the engine
        self._active: dict[int, Stream] = {}       # engine thread only: rid -> stream
        self._stop = False
        self._gauges_t = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---- handler side (event loop thread) -----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything outstanding and join the thread."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop and self.error is None

    def submit(self, prompt: list, max_tokens: int, sampling: SamplingParams = GREEDY,
               logprobs: int | None = None) -> Stream:
        """Queue a prompt (byte ids) for ``max_tokens`` tokens drawn with ``sampling`` (default greedy), each with
        its logprob and ``logprobs`` alternatives (None: none); returns its :class:`Stream`. Raises
        QueueFull when the server holds ``max_num_seqs + max_queue`` requests, LoopStopped when stopped."""
        if not self.alive:
            raise LoopStopped("the engine loop is not running")
        with self._lock:
            if self._outstanding >= self.max_num_seqs + self.max_queue:
                raise QueueFull(f"{self._outstanding} requests outstanding (max_num_seqs {self.max_num_seqs} "
                                f"+ max_queue {self.max_queue})")
            self._outstanding += 1
        stream = Stream(prompt, max_tokens, asyncio.Queue(), asyncio.get_running_loop(), sampling, logprobs)
        self._send(("submit", stream))
        return stream

    def abort(self, stream: Stream) -> None:
        """Abort a request (client gone): its pages and slot are freed on the engine thread. Idempotent."""
        self._send(("abort", stream))

    async def call(self, fn):
        """Run ``fn(engine)`` on the engine thread between steps and return its result (or raise its error)."""
        if not self.alive:
            raise LoopStopped("the engine loop is not running")
        fut = asyncio.get_running_loop().create_future()
        self._send(("call", fn, fut))
        return await fut

    def _send(self, cmd) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    # ---- engine thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stop:
                    loop_t = time.perf_counter()
                    self._drain()
                    self._feed()
                    eng = self.engine
                    if eng.running or eng.waiting:
                        prev, cpu0, proc0 = eng.last_batch, time.thread_time(), time.process_time()
                        t0 = time.perf_counter()
                        eng.step()                        # raises only for a failure of no one request: fatal
                        t1, cpu_s = time.perf_counter(), time.thread_time() - cpu0
                        others_cpu_s = time.process_time() - proc0 - cpu_s     # the event loop's threads
                        self.metrics.step_seconds.observe(t1 - t0)
                        self._emit()
                        if self.trace is not None:
                            batch = eng.last_batch if eng.last_batch is not prev else None
                            self.trace.step(loop_t, t0, t1, time.perf_counter(), cpu_s, others_cpu_s, batch,
                                            len(eng.running), len(eng.waiting), len(self._pending))
                        self._gauges()
                    elif not self._pending:
                        self._gauges(force=True)
                        self._wake.wait(0.5)
                        self._wake.clear()
        except BaseException as err:                      # the loop is dead: fail everyone, /health says so
            self.error = err
            log.exception("engine loop died")
        finally:
            self._shutdown()
            if self.trace is not None:
                self.trace.close()
        if self.error is not None and self.on_death is not None:
            self.on_death(self.error)

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "submit":
                self._pending.append(cmd[1])
            elif cmd[0] == "abort":
                self._abort(cmd[1])
            else:
                _, fn, fut = cmd
                try:
                    out = fn(self.engine)
                except BaseException as err:   # noqa: BLE001 - handed to the awaiting handler
                    fut.get_loop().call_soon_threadsafe(_set, fut, None, err)
                else:
                    fut.get_loop().call_soon_threadsafe(_set, fut, out, None)

    def _feed(self) -> None:
        """Hand queued requests to the engine while it holds fewer than ``max_num_seqs``; one the engine refuses
        (its ``submit`` raises) ends REJECTED with the error, and the others go on."""
        eng = self.engine
        while self._pending and len(eng.running) + len(eng.waiting) < self.max_num_seqs:
            s = self._pending.pop(0)
            try:
                s.rid = eng.submit(s.prompt, s.max_tokens, s.logprobs is not None, sampling=s.sampling)
            except Exception as err:                       # noqa: BLE001 - that request ends, others go on
                log.warning("the engine refused a request: %s: %s", type(err).__name__, err)
                self._end(s, _ended(s, RequestStatus.REJECTED, f"the engine refused it: {type(err).__name__}: {err}"))
                continue
            s.feed_t = time.perf_counter()
            self._active[s.rid] = s

    def _abort(self, s: Stream) -> None:
        if s.done:
            return
        if s.rid is None:                                  # still in front of the engine
            if s in self._pending:
                self._pending.remove(s)
            self._end(s, None)
            return
        self.engine.abort(s.rid)
        self._end(s, self.engine.result(s.rid))

    def _emit(self) -> None:
        now = time.perf_counter()
        for s in list(self._active.values()):
            res = self.engine.result(s.rid)
            new = res.output_tokens[s.sent:]
            if new:
                lps = None if s.logprobs is None else token_logprobs(res.logits[s.sent:], new, s.logprobs)
                self.metrics.tokens(s, len(new), now)
                s.sent += len(new)
                s.push(Tokens(new, lps))
            if res.status in DONE:
                self._end(s, res)

    def _end(self, s: Stream, res: RequestResult | None) -> None:
        """The one exit of a request: metrics, its engine record released (the engine keeps an ended request's
        record for ``result()`` until :meth:`ServeEngine.release`), its slot freed, then its end event."""
        s.done = True
        if s.rid is not None:
            self._active.pop(s.rid, None)
            if res is not None and res.status in DONE:     # ended in the engine (an abort that raised leaves it)
                self.engine.release(s.rid)
        self.metrics.finished(s, res)
        if self.trace is not None:
            self.trace.request(s, res, time.perf_counter())
        if res is None:
            res = _ended(s, RequestStatus.ABORTED, "aborted while queued")
        with self._lock:                                   # the slot is free before the client hears the end:
            self._outstanding -= 1                         # it may send its next request at once (no 429)
        s.push(res)

    def _gauges(self, force: bool = False) -> None:
        """Refresh the state gauges: when idle (``force``), else at most every GAUGE_PERIOD_S (the prefix
        cache's stats walk its index)."""
        now = time.perf_counter()
        if force or now - self._gauges_t >= GAUGE_PERIOD_S:
            self._gauges_t = now
            self.metrics.engine_state(self.engine, len(self._pending), self.max_num_seqs)

    def _shutdown(self) -> None:
        for s in list(self._pending) + list(self._active.values()):
            if s.rid is not None and not s.done:
                try:
                    self.engine.abort(s.rid)
                except Exception:                          # noqa: BLE001 - best effort on the way out
                    pass
            if not s.done:
                res = None if s.rid is None else self.engine.result(s.rid)
                if res is not None and self.error is not None:
                    res = res._replace(reason=f"engine loop stopped: {self.error}")
                self._end(s, res)
        self._pending.clear()
        while True:                                        # fail calls queued after the end
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "call":
                cmd[2].get_loop().call_soon_threadsafe(_set, cmd[2], None, LoopStopped("engine loop stopped"))
            elif cmd[0] == "submit" and not cmd[1].done:
                self._end(cmd[1], None)


def _ended(s: Stream, status: RequestStatus, reason: str) -> RequestResult:
    """The result of a request that never ran in the engine."""
    return RequestResult(-1, status, len(s.prompt), (), None, 0, 0, 0, 0, 0, 0, {}, None, reason)


def _set(fut: asyncio.Future, value, err) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(value)
    else:
        fut.set_exception(err)
