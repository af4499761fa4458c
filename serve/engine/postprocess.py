"""``Postprocessor``: the last stage of a step (schedule -> run -> postprocess), after the forward of a batch.

In this order, each a failure of its row only (the engine's ``fail`` aborts that request, the others go on):

0. non-finite logits abort their row (argmax of all-NaN would emit token 0 as if it were a prediction);
1. checkpoints inside each prefill chunk: the state after exactly b tokens written, then published;
2. commit: the runner writes the states of the rows still running back to their pages (a verify row's state:
   its rollback strategy's commit, vLLM's per-row ``num_accepted_tokens``);
3. per row: publish, append the emitted tokens, finish. A decode or verify step is, in this order, compute (the
   cache consumed the fed-back token plus the accepted drafts), commit (every emitted token appended, so
   ``tokens()[:computed]`` is again exactly what the cache consumed), publish if the cache landed on the final
   boundary, then finish if the request has all its tokens (finishing releases the pages the publish reads).
   Publishing before the commit built the block keys from fewer tokens than the cache had consumed whenever a
   verify accepted drafts onto the boundary (the class of bug in vllm-project/vllm#53505).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kda_core.model import ForwardOutput, HybridCache, HybridLM
from serve.engine.model_runner import ModelRunner, Row, StepBatch
from serve.engine.request import Request, RequestStatus, write_request_cache
from serve.engine.sampling import sample_token
from serve.engine.scheduler import Scheduler
from serve.memory.pages import write_kv, write_state
from serve.spec_decode.verify import greedy_accept

LIVE = (RequestStatus.PREFILL, RequestStatus.DECODE)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def where(row: Row) -> str:
    """What ``row`` computes, for a failure's reason: "decode of output token i" or "prefill of tokens [a, b)"."""
    if row.decode or row.verify:
        return f"decode of output token {len(row.req.output)}"
    return f"prefill of tokens [{row.start}, {row.start + len(row.tokens)})"


def non_finite(logits: torch.Tensor) -> str | None:
    """Why ``logits`` cannot be sampled (NaN / inf values: a non-finite state or cache page met in the
    forward; argmax of all-NaN would emit token 0 as if it were a prediction), or None if they are finite."""
    if bool(torch.isfinite(logits).all()):
        return None
    return (f"the logits hold {int((~torch.isfinite(logits)).sum())} NaN/inf value(s) of {logits.numel()} "
            "(a non-finite state or cache page); no token was emitted")


class Postprocessor:
    """Turns a run :class:`StepBatch` into committed states, published blocks and checkpoints, emitted tokens and
    finished requests. ``fail(req, where, error)`` aborts one request (the engine's fault isolation); the memory
    and the queues are the ``scheduler``'s."""

    def __init__(self, model: HybridLM, runner: ModelRunner, scheduler: Scheduler,
                 fail: Callable[[Request, str, BaseException | str], None]):
        self.model, self.runner, self.scheduler, self.fail = model, runner, scheduler, fail
        self.memory = scheduler.memory

    def __call__(self, batch: StepBatch, bases: dict, fwd_ms: float) -> None:
        """Postprocess ``batch`` (its forward took ``fwd_ms``); ``bases``: rid -> the cache a verify row started
        from. See the module docstring for the order."""
        memory, layout, pool = self.memory, self.memory.layout, self.memory.pool
        finite = torch.isfinite(batch.logits).all(dim=-1).tolist()      # [N]: one check for every row
        greedy = batch.logits.argmax(-1).tolist()                         # [N]: every row's argmax in one op
        for i, row in enumerate(batch.rows):             # 0. non-finite logits abort their row only
            if row.req is not None and (row.verify or not finite[i]):
                bad = non_finite(batch.verify[i].logits if row.verify else batch.logits[i])
                if bad is not None:
                    self.fail(row.req, where(row), bad)
        for i, row in enumerate(batch.rows):             # 1. checkpoints inside each prefill chunk
            if row.req is None or row.decode or row.verify or row.req.status is RequestStatus.ABORTED:
                continue
            req = row.req
            req.timings_ms["prefill"] += fwd_ms
            t1 = time.perf_counter()
            try:
                for t in row.state_at:
                    write_state(layout, pool, req.state_pages, batch.states_at[i][t])
                    req.computed = row.start + t
                    memory.publish(req, row.start + t, True)
            except Exception as err:                     # noqa: BLE001 - that request is aborted
                self.fail(req, where(row), err)
            req.timings_ms["checkpoint"] += _ms(t1)
        publish = {row.req.rid for row in batch.rows if row.decode and row.req is not None
                   and row.req.computed + 1 == memory.final_boundary(row.req)}   # these must materialise
        self.runner.commit(batch, lambda r: r.status in LIVE and r.rid not in bases, publish)   # 2.
        for i, row in enumerate(batch.rows):             # 3. publish, append, finish
            req = row.req
            if req is None or req.status not in LIVE:
                continue
            try:
                if row.verify:
                    self.verify(req, row, batch.verify[i], bases[req.rid])
                elif row.decode:                         # a finite greedy row's token is its argmax
                    self.decode(req, batch.logits[i], greedy[i] if finite[i] and req.sampling.greedy else None)
                else:
                    self.prefill(req, row, batch.logits[i])
            except Exception as err:                     # noqa: BLE001 - that request is aborted
                self.fail(req, where(row), err)

    def prefill(self, req: Request, row: Row, logits: torch.Tensor) -> None:
        """A prefill row's end: ``computed`` advances over its chunk, the blocks below it (and its checkpoint, at
        a boundary) are published, and the prompt's last chunk samples the first token from ``logits [256]``."""
        end, L = row.start + len(row.tokens), len(req.prompt)
        req.computed = end
        req.prefill_tokens += len(row.tokens)
        if self.memory.cache is not None:
            t1 = time.perf_counter()
            self.memory.publish(req, end, end in self.memory.checkpoint_boundaries(L))
            req.timings_ms["checkpoint"] += _ms(t1)
        if end == L:
            self.append(req, sample_token(logits, req.sampling, req.generator), logits)
            self.finish_if_done(req)

    def decode(self, req: Request, logits: torch.Tensor, token: int | None = None) -> None:
        """A decode row's end: one token sampled from ``logits [256]`` (``token``: already sampled, a greedy
        row's argmax), appended; publish at the final boundary; finish."""
        b_end = self.memory.final_boundary(req)
        req.computed += 1
        self.append(req, sample_token(logits, req.sampling, req.generator) if token is None else token, logits)
        if b_end is not None and req.computed == b_end:
            self.memory.publish(req, b_end, True)
        self.finish_if_done(req)

    def verify(self, req: Request, row: Row, out, base: HybridCache | None) -> None:
        """A verify row's end: accept greedily, commit the state after the accepted drafts + 1 through the
        request's strategy (as :func:`serve.spec_decode.verify.verify_and_replay`), write it, then append,
        publish, finish. ``base`` None (snapshot speculation in slots): the states after each verify token go
        into the request's k + 1 slots by index and the commit makes the accepted one current (no copy)."""
        memory = self.memory
        b_end = memory.final_boundary(req)
        drafts = tuple(row.tokens[1:])
        target = tuple(int(t) for t in out.logits[0].argmax(-1))          # [1 + n] greedy tokens
        a = greedy_accept(drafts, target)
        if base is None:
            self.runner.write_verify_states(req, out, len(row.tokens))
            req.state_pages = req.spec_slots[a]                           # the state after token a
            start, cfg = req.computed, self.model.cfg
            write_kv(memory.layout, memory.pool, req.page_table, start,
                     [out.layers[i][:, start: start + a + 1] for i in cfg.mla_layers])   # accepted latents
            req.computed = start + a + 1
        else:
            layers = tuple(out.layers[i] for i in range(self.model.cfg.num_layers))
            verified = ForwardOutput(out.logits, HybridCache(layers, base.num_tokens + len(row.tokens)), out.aux)
            req.strategy.record(self.model, base, verified)
            write_request_cache(memory.layout, memory.pool, req, req.strategy.commit(a), req.computed)
        req.drafted_tokens += len(drafts)
        req.accepted_tokens += a
        for tok, logits in zip(target[: a + 1], out.logits[0, : a + 1]):
            self.append(req, tok, logits)
        if b_end is not None and req.computed == b_end:
            memory.publish(req, b_end, True)
        self.finish_if_done(req)

    @staticmethod
    def append(req: Request, token: int, logits: torch.Tensor | None) -> None:
        """Commit one emitted token (and its ``logits [256]`` fp32 if recorded); the first sets TTFT and
        moves the request to DECODE. Touches no page."""
        req.output.append(token)
        if req.record_logits:
            req.logits.append(logits.clone())
        if req.first_token_t is None:
            req.first_token_t = time.perf_counter()
            req.status = RequestStatus.DECODE

    def finish_if_done(self, req: Request) -> None:
        """FINISHED once ``max_new_tokens`` are out (:meth:`Scheduler.finish`: pages and pins released)."""
        if len(req.output) == req.max_new_tokens:
            self.scheduler.finish(req)
