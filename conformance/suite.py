"""The suite's frame: a :class:`Check` is a plan (which requests to send in which setting) and a judge (what the
answers must satisfy); :func:`run_suite` runs every selected check's requests grouped by server, one server at a
time, then judges each check on what came back.

Ordering: the settings run in the order the checks first name them (``base`` first), and on one server the checks'
requests run in check order, one request at a time (the batch-invariance check sends its concurrent batch itself).
A setting the target cannot serve reaches the judge as :class:`Unavailable` (its parts are not applicable, with the
reason); a server that fails to start or a request script that raises reaches it as :class:`Failed`."""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from conformance.adapters import Adapter, Grid, Variant
from conformance.client import Completion, EngineClient
from conformance.compare import Diff, compare
from conformance.launch import StartError, Target
from conformance.prompts import Prompts
from conformance.report import CheckResult, Part, Report, Status


class Unavailable(NamedTuple):
    """A setting the target cannot serve, and why."""

    reason: str


class Failed(NamedTuple):
    """A setting whose server did not start, or whose requests raised, and the error."""

    error: str


@dataclass
class Ctx:
    """What every check reads. ``prompts``: the run's :class:`Prompts`; ``max_tokens`` generated per request;
    ``logprobs``: alternatives per token; ``rule`` / ``atol``: the match rule of :func:`compare`;
    ``chunk_sizes``: prefill chunk sizes for the chunked-prefill check; ``grid``: the engine's state grid (None:
    unknown); ``concurrency``: requests sent at once by the batch-invariance check; ``adapter``: the engine's;
    ``routable(variant)``: whether the target can serve that setting; ``client``: the endpoint the current script
    runs on (set by the runner)."""

    prompts: Prompts
    max_tokens: int = 12
    logprobs: int = 5
    rule: str = "exact"
    atol: float = 1e-3
    chunk_sizes: tuple = (16, 64, 100)
    grid: Grid | None = None
    concurrency: int = 5
    adapter: Adapter | None = None
    routable: Callable[[Variant], bool] = lambda variant: True
    client: EngineClient | None = None

    def complete(self, client: EngineClient, prompt: list, max_tokens: int | None = None) -> Completion:
        return client.complete(prompt, self.max_tokens if max_tokens is None else max_tokens, self.logprobs)

    def diff(self, ref: Completion, got: Completion) -> Diff:
        return compare(ref, got, self.rule, self.atol)

    def same(self, name: str, ref: Completion, got: Completion, what: str = "", extra: dict | None = None) -> Part:
        """A part that passes when ``got`` matches the reference ``ref``."""
        d = self.diff(ref, got)
        evidence = {**d.evidence(), **(extra or {})}
        return Part(name, Status.PASS if d.match else Status.FAIL, (what + ": " if what else "") + d.summary(),
                    evidence)


Script = Callable[[EngineClient, Ctx], Any]


@dataclass(frozen=True)
class Check:
    """One invariant. ``plan(ctx)``: ``{setting: script}`` (a script sends its requests through the client and
    returns what the judge needs); ``judge(results, ctx)``: the :class:`Part` s from ``{setting name: the script's
    return, or Unavailable / Failed}``."""

    id: str
    title: str
    invariant: str
    bug: str
    sources: tuple
    plan: Callable[[Ctx], dict]
    judge: Callable[[dict, Ctx], list]


def blocked(name: str, data) -> Part | None:
    """The part for a setting that did not run (None if it ran): NA for Unavailable, FAIL for Failed."""
    if isinstance(data, Unavailable):
        return Part(name, Status.NA, f"not applicable: {data.reason}")
    if isinstance(data, Failed):
        return Part(name, Status.FAIL, f"the engine failed: {data.error}")
    return None


def metric_delta(before: dict | None, after: dict | None, name: str | None) -> float | None:
    """``after[name] - before[name]`` (None when either scrape or the series is missing)."""
    if not name or before is None or after is None or name not in after:
        return None
    return after[name] - before.get(name, 0.0)


@dataclass
class RunSettings:
    """Options of a run: the checks (ids), the :class:`Ctx` knobs, the seed of the nonce and needles (None: a
    random one, recorded in the report), ``grid`` (None: the adapter's, from the launch flags) and ``extra``
    entries for the report's settings (the engine's version, the date)."""

    checks: tuple = ()
    max_tokens: int = 12
    logprobs: int = 5
    rule: str = "exact"
    atol: float = 1e-3
    chunk_sizes: tuple | None = None
    concurrency: int = 5
    seed: int | None = None
    grid: Grid | None = None
    request_timeout_s: float = 120.0
    extra: dict = field(default_factory=dict)


def run_suite(target: Target, checks: list[Check], settings: RunSettings) -> Report:
    """Run ``checks`` against ``target`` (see the module docstring); returns the :class:`Report`."""
    adapter = target.adapter
    seed = settings.seed if settings.seed is not None else random.SystemRandom().randrange(2**31)
    ctx = Ctx(Prompts(seed, lambda text: ctx.client.tokenize(text)), settings.max_tokens, settings.logprobs,
              settings.rule, settings.atol, tuple(settings.chunk_sizes or adapter.default_chunk_sizes),
              settings.grid or adapter.grid(target.launch_args), settings.concurrency, adapter,
              lambda variant: not isinstance(target.route(variant), str))
    plans = {c.id: c.plan(ctx) for c in checks}
    results: dict[str, dict] = {c.id: {} for c in checks}
    variants: list[Variant] = list(dict.fromkeys(v for plan in plans.values() for v in plan))
    routes = {v: target.route(v) for v in variants}
    servers: dict[Variant, list[Variant]] = {}
    for v in variants:
        if isinstance(routes[v], str):
            for c in checks:
                if v in plans[c.id]:
                    results[c.id][v.name] = Unavailable(routes[v])
        else:
            servers.setdefault(routes[v][0], []).append(v)
    for server, served in servers.items():
        try:
            with target.server(server) as (url, model):
                for v in served:
                    client = EngineClient(url, model, adapter, routes[v][1], settings.request_timeout_s)
                    ctx.client = client
                    try:
                        for c in checks:
                            if v in plans[c.id]:
                                results[c.id][v.name] = _run_script(plans[c.id][v], client, ctx)
                    finally:
                        client.close()
        except StartError as err:
            for v in served:
                for c in checks:
                    if v in plans[c.id] and v.name not in results[c.id]:
                        results[c.id][v.name] = Failed(f"the engine did not start for {v.name}: {err}")
    out = [CheckResult(c.id, c.title, c.invariant, c.bug, c.sources, _judge(c, results[c.id], ctx)) for c in checks]
    meta = {"adapter_run_here": adapter.run_here, "seed": seed, "nonce": ctx.prompts.nonce, "max_tokens": ctx.max_tokens, "logprobs": ctx.logprobs,
            "rule": ctx.rule, "atol": ctx.atol, "chunk_sizes": list(ctx.chunk_sizes),
            "grid": None if ctx.grid is None else ctx.grid._asdict(), "concurrency": ctx.concurrency,
            "settings": {v.name: (routes[v] if isinstance(routes[v], str) else
                                  f"server {routes[v][0].name}" + ("" if routes[v][0] == v else " + request fields"))
                         for v in variants}, **settings.extra}
    return Report(adapter.name, target.description, meta, out)


def _run_script(script: Script, client: EngineClient, ctx: Ctx):
    try:
        return script(client, ctx)
    except Exception as err:                       # noqa: BLE001 - the engine's failure is the check's evidence
        return Failed(f"{type(err).__name__}: {err}")


def _judge(check: Check, results: dict, ctx: Ctx) -> list:
    try:
        return check.judge(results, ctx)
    except Exception as err:                       # noqa: BLE001 - an answer the judge cannot read is a failure
        return [Part("judge", Status.FAIL, f"unreadable results: {type(err).__name__}: {err}")]
