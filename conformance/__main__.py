"""``python -m conformance``: put a serving engine through the KDA conformance checks.

Against a running engine (its deployment as it is, plus the settings it takes per request)::

    python -m conformance --engine llama.cpp --base-url http://127.0.0.1:8080 --model kda-demo

or letting the suite start the engine itself, once per setting a check needs (prefix cache off, speculative
decoding on, each prefill chunk size), on free ports of 127.0.0.1::

    python -m conformance --engine ours --launch "python -m serve.http --max-model-len 512" --json out.json

Prints the table, writes the JSON report with ``--json``; exit status 1 if a check failed, 2 for bad options.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from conformance.adapters import Grid
from conformance.compare import MATCH_RULES
from conformance.launch import Attached, Launched
from conformance.registry import CHECKS, ENGINES, select_checks
from conformance.suite import RunSettings, run_suite


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be ints >= 1, got {text!r}")
    return values


def _grid(text: str) -> Grid:
    parts = _ints(text.replace(":", ","))
    if len(parts) != 2 or parts[1] % parts[0]:
        raise argparse.ArgumentTypeError(f"must be BLOCK:INTERVAL with INTERVAL a multiple of BLOCK, got {text!r}")
    return Grid(*parts)


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m conformance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running engine's OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", metavar="COMMAND", help="the command that starts the engine (without host and "
                       "port: the suite adds them and each setting's flags)")
    where.add_argument("--list", action="store_true", help="list the checks and their sources, then exit")
    p.add_argument("--engine", choices=list(ENGINES), default="ours", help="which adapter (default: %(default)s)")
    p.add_argument("--model", help="the served model name (default with --launch: the first of /v1/models)")
    p.add_argument("--checks", default="", help=f"comma-separated ids (default: all): {', '.join(CHECKS)}")
    p.add_argument("--chunk-sizes", type=_ints, default=None, help="prefill chunk sizes, tokens (default: the "
                   "adapter's, 16,64,100)")
    p.add_argument("--max-tokens", type=_positive(int), default=12, help="tokens per request (default: %(default)s)")
    p.add_argument("--logprobs", type=int, default=5, help="alternatives per token (default: %(default)s)")
    p.add_argument("--match", choices=MATCH_RULES, default="exact", help="exact: the same tokens and every logprob "
                   "within --atol; close: vLLM's check_logprobs_close (default: %(default)s)")
    p.add_argument("--atol", type=float, default=1e-3, help="max |delta logprob|, nats (default: %(default)s)")
    p.add_argument("--concurrency", type=_positive(int), default=5, help="requests at once in the batch check "
                   "(default: %(default)s)")
    p.add_argument("--grid", type=_grid, default=None, metavar="BLOCK:INTERVAL", help="the engine's KV block and "
                   "state checkpoint interval, tokens, for the metrics check (default: from the adapter and flags)")
    p.add_argument("--seed", type=int, default=None, help="seed of the prompts' nonce (default: random)")
    p.add_argument("--start-timeout", type=_positive(float), default=300.0, help="seconds for a launched engine to "
                   "become healthy (default: %(default)s)")
    p.add_argument("--request-timeout", type=_positive(float), default=120.0, help="seconds per request "
                   "(default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--log-dir", type=Path, default=None, help="with --launch: keep each setting's server log here "
                   "as <setting>.log (default: discarded)")
    p.add_argument("--note", action="append", default=[], metavar="KEY=VALUE",
                   help="recorded in the report's settings (the engine's version, the date); repeatable")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.list:
        for c in CHECKS.values():
            print(f"{c.id}: {c.title}\n  {c.invariant}\n  sources: " + ", ".join(f"{s.label} {s.url}" for s in c.sources))
        return 0
    try:
        checks = select_checks([c for c in args.checks.split(",") if c])
    except ValueError as err:
        p.error(f"--checks: {err}")
    if args.base_url and not args.model:
        p.error("--model is required with --base-url")
    if args.json is not None and not args.json.parent.is_dir():
        p.error(f"--json: folder {str(args.json.parent)!r} does not exist")
    if args.log_dir is not None and not args.log_dir.is_dir():
        p.error(f"--log-dir: {str(args.log_dir)!r} is not a folder")
    notes = dict(n.split("=", 1) for n in args.note if "=" in n)
    if len(notes) != len(args.note):
        p.error("--note must be KEY=VALUE")
    adapter = ENGINES[args.engine]()
    target = (Attached(adapter, args.base_url, args.model) if args.base_url else
              Launched(adapter, args.launch, args.model, args.start_timeout, log_dir=args.log_dir))
    settings = RunSettings(tuple(c.id for c in checks), args.max_tokens, args.logprobs, args.match, args.atol,
                           args.chunk_sizes, args.concurrency, args.seed, args.grid, args.request_timeout, notes)
    report = run_suite(target, checks, settings)
    print(report.table())
    if args.json is not None:
        args.json.write_text(report.dumps() + "\n")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
