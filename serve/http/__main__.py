"""``python -m serve.http``: the OpenAI-compatible server on 127.0.0.1:8000 by default (see serve/http/__init__.py).

A bad option (a port outside [1, 65535], a negative queue, a trace file whose folder does not exist), options that
contradict each other (``--ring-size`` without ``--state-write replay_ssm``), values the engine spec refuses, or a
pool that cannot serve one request of ``--max-model-len`` or does not fit in this machine's memory
(:meth:`serve.http.model.EngineSpec.check_pool`) end the command with argparse's usage line and message (exit
status 2) before the model is loaded.

At the door (:mod:`serve.http.door`): a request's headers must arrive within ``--header-timeout`` s and its body
within ``--body-timeout`` s (else 408 and the connection is closed), an idle keep-alive connection is closed after
``--timeout-keep-alive`` s, and a request arriving while ``--max-connections`` connections are open gets 503.

If the engine fails in a way that is no one request's (:class:`serve.engine.EngineFailure`: the model itself), every
request ends, ``/health`` answers 503 with the cause for :data:`DEATH_GRACE_S` s, and the command exits with status 1
(:data:`ENGINE_DIED`) so that a supervisor (systemd ``Restart=on-failure``, a Kubernetes restart policy) starts it
again, rather than leaving a live process that answers 503 for ever."""
from __future__ import annotations

import argparse
import math
import sys
import threading
from pathlib import Path

import uvicorn

from kda_core import cpu_forms
from kda_core.config import PRESETS
from kda_core.pretrained import read_config
from serve.config import STATE_DTYPES
from serve.engine import STATE_WRITES, ServeEngine
from serve.http.app import create_app
from serve.http.door import DoorLimits
from serve.http.model import EngineSpec, SpeculativeConfig, build_engine, model_codec, pool_capacity, served_name
from serve.http.step_trace import StepTrace
from serve.spec_decode.replay_ssm import DEFAULT_RING_SIZE

MAX_PORT = 65535     # TCP ports are 16-bit
ENGINE_DIED = 1      # exit status when the engine loop died
DEATH_GRACE_S = 1.0  # /health says why for this long before the server shuts down
SPARE_CONNECTIONS = 64   # --max-connections default: outstanding requests (max-num-seqs + max-queue) + this many


def _int_in(minimum: int, maximum: int | None = None):
    """An argparse ``type``: an int in [minimum, maximum] (argparse reports the ArgumentTypeError as the
    option's error, exit status 2)."""
    want = f"an int >= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {want}, got {value}")
        return value
    return parse


def _seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def _new_file(text: str) -> str:
    """``--step-trace``: a file path whose folder exists (the file is created or truncated at startup)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {str(path.parent)!r} does not exist")
    return text


def _speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config``: a JSON object of :class:`SpeculativeConfig` fields."""
    try:
        return SpeculativeConfig.from_json(text)
    except (TypeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    """The command line; every option's help ends with its default."""
    p = argparse.ArgumentParser(prog="python -m serve.http", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, this machine only)")
    p.add_argument("--port", type=_int_in(1, MAX_PORT), default=8000, help="TCP port (default: %(default)s)")
    p.add_argument("--preset", default="demo", help="runnable model preset: demo (the trained weights of "
                   "weights/kda-demo), demo-k3gate or demo-tiny (seeded init) (default: %(default)s)")
    p.add_argument("--model-path", default=None, metavar="DIR",
                   help="serve a checkpoint folder in Kimi-Linear's format (config.json, safetensors in Moonshot's "
                        "names, tokenizer.json) instead of --preset, e.g. weights/kda-demo or the real 48B folder")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: kda-<preset>, or the --model-path folder's name)")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="prompt + output tokens (bytes) per request (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="requests in the engine at once (state slots in use; this caps them whatever the pool "
                   "could hold: kda:state_slots_capacity in /metrics) (default: %(default)s)")
    p.add_argument("--max-queue", type=_int_in(0), default=256,
                   help="requests queued in front of the engine before 429 (default: %(default)s)")
    p.add_argument("--num-pages", type=int, default=None,
                   help="pool pages of one KV block each (default: 2 x max-num-seqs x (fp32 state pages + KV pages of "
                   "max-model-len tokens), the same pool bytes for every --state-dtype)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--checkpoint-interval", type=int, default=64,
                   help="tokens between KDA state checkpoints of the prefix cache (default: %(default)s)")
    p.add_argument("--no-prefix-cache", action="store_true", help="serve without prefix sharing (default: cache on)")
    p.add_argument("--state-write", choices=STATE_WRITES, default="slot",
                   help="how a decode step writes a request's KDA state: slot (the whole state every step) or "
                   "replay_ssm (a (k, u, g) record per step, the state every ring-size steps; vllm#47572); with fp32 "
                   "states the tokens are the same, with 16-bit states they may differ (fewer roundings) "
                   "(default: %(default)s)")
    p.add_argument("--ring-size", type=_int_in(1), default=None,
                   help=f"decode steps per state write, for the replay_ssm state write only; SGLang's default "
                   f"(default: {DEFAULT_RING_SIZE})")
    p.add_argument("--state-dtype", default="fp32", choices=list(STATE_DTYPES),
                   help="stored dtype of the KDA recurrent states (slots and checkpoints; compute stays fp32), as "
                   "vLLM's --mamba-ssm-cache-dtype. bf16 / fp16 round the state on every write, so greedy output may "
                   "differ from fp32's, and a prefix-cache hit may differ from the same request run cold (warm == "
                   "cold holds only in fp32; README, page 17) (default: %(default)s)")
    p.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s option: \'{"method": "ngram", "num_speculative_tokens": 3, '
                   '"prompt_lookup_max": 3, "prompt_lookup_min": 1}\' (prompt lookup; drafts verified in the decode step '
                   'and accepted greedily, so temperature 0 only; the KDA state rolled back from per-token snapshots) '
                   '(default: off)')
    p.add_argument("--chunked-prefill-size", type=_int_in(1), default=None, metavar="N",
                   help="most prompt tokens one prefill forward computes (SGLang's option of that name; a longer "
                   "prompt is prefilled in chunks, its KDA state carried from chunk to chunk) (default: the whole "
                   "prompt at once)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default: %(default)s)")
    p.add_argument("--step-trace", type=_new_file, default=None, metavar="PATH",
                   help="write every engine step and request timeline to PATH (JSON lines, serve/http/step_trace.py) "
                   "(default: off)")
    limits = DoorLimits()
    p.add_argument("--header-timeout", type=_seconds, default=limits.header_timeout_s, metavar="S",
                   help="a request's headers must arrive within S seconds of the connection opening or of the previous "
                   "response ending, else 408 and the connection is closed (nginx's client_header_timeout; a slow-loris "
                   "client is dropped) (default: %(default)s)")
    p.add_argument("--body-timeout", type=_seconds, default=limits.body_timeout_s, metavar="S",
                   help="a request's body must arrive within S seconds of its headers, else 408 and the connection is "
                   "closed (default: %(default)s)")
    p.add_argument("--timeout-keep-alive", type=_seconds, default=limits.keep_alive_s, metavar="S",
                   help="close an idle keep-alive connection after S seconds (uvicorn's timeout_keep_alive) "
                   "(default: %(default)s)")
    p.add_argument("--max-connections", type=_int_in(1), default=None,
                   help="a request arriving while this many connections are open gets 503 (uvicorn's "
                   f"limit_concurrency) (default: max-num-seqs + max-queue + {SPARE_CONNECTIONS})")
    p.add_argument("--docs", action="store_true",
                   help="serve FastAPI's /docs and /openapi.json (the docs page loads its scripts from a CDN) "
                   "(default: off)")
    return p


def door_limits(args: argparse.Namespace) -> DoorLimits:
    """The :class:`DoorLimits` the options ask for."""
    cap = args.max_connections or args.max_num_seqs + args.max_queue + SPARE_CONNECTIONS
    return DoorLimits(args.header_timeout, args.body_timeout, args.timeout_keep_alive, cap)


def parse_args(argv=None) -> argparse.Namespace:
    """The options of ``argv`` (None: ``sys.argv[1:]``), checked together: exits with argparse's message
    (status 2) for ``--ring-size`` without ``--state-write replay_ssm``, for values :class:`EngineSpec`
    refuses (``--max-model-len 1``, a block size that does not divide the checkpoint interval), and for a pool
    that cannot serve (:meth:`EngineSpec.check_pool`: ``--num-pages`` below one request of ``--max-model-len``,
    or a pool larger than this machine's memory)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.ring_size is not None and args.state_write != "replay_ssm":
        p.error(f"--ring-size applies to --state-write replay_ssm only (got --state-write {args.state_write})")
    if args.speculative_config is not None and args.state_write != "slot":
        p.error(f"--speculative-config needs --state-write slot (got --state-write {args.state_write}): with "
                "speculation every decode row is a verify row, rolled back from snapshots")
    try:
        spec = engine_spec(args)
        spec.check_pool(read_config(args.model_path) if args.model_path else PRESETS[args.preset])
    except ValueError as exc:
        p.error(str(exc))
    return args


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    """The :class:`EngineSpec` the options ask for (raises its ValueError for a bad value)."""
    return EngineSpec(args.preset, args.max_model_len, args.max_num_seqs, args.num_pages, args.block_size,
                      args.checkpoint_interval, not args.no_prefix_cache, args.state_write, args.ring_size,
                      args.state_dtype, args.speculative_config, args.chunked_prefill_size, args.model_path)


def startup_line(args: argparse.Namespace, engine: ServeEngine, model_name: str) -> str:
    """The one line the server prints as it starts (as uvicorn's "Uvicorn running on ..." and vLLM's startup log):
    model, address, state dtype and write, and the pool (pages, bytes, state slots and max-length requests it
    holds, the cap ``--max-num-seqs``); with 16-bit states, that a prefix-cache hit may change greedy output."""
    cap = pool_capacity(engine, args.max_model_len)
    write = args.state_write + (f" (ring {engine.replay.ring_size})" if engine.replay is not None else "")
    line = (f"python -m serve.http: serving {model_name} on http://{args.host}:{args.port}/v1 | state dtype "
            f"{args.state_dtype}, state write {write} | pool {cap.num_pages:,} pages = {cap.pool_bytes / 2**20:,.1f} "
            f"MiB: {cap.state_slots:,} state slots, {cap.requests:,} requests of {args.max_model_len:,} tokens; at "
            f"most {args.max_num_seqs} running (--max-num-seqs) | prefix cache {'off' if engine.cache is None else 'on'}")
    if args.speculative_config is not None:
        sc = args.speculative_config
        line += (f" | speculative {sc.method}, {sc.num_speculative_tokens} drafts (n-grams {sc.prompt_lookup_min}.."
                 f"{sc.prompt_lookup_max})")
    if args.chunked_prefill_size is not None:
        line += f" | prefill chunks of {args.chunked_prefill_size} tokens"
    if args.state_dtype != "fp32" and engine.cache is not None:
        line += (f" ({args.state_dtype} states: a prefix-cache hit may change greedy output; warm == cold holds "
                 "only in fp32)")
    return line


def main(argv=None) -> None:
    """Serve until stopped (Ctrl-C, SIGTERM); exits with status :data:`ENGINE_DIED` if the engine loop died."""
    args = parse_args(argv)
    spec = engine_spec(args)
    cpu_forms.start_up()          # build / load / self-check every C form before the first request
    engine, model_name = build_engine(spec), args.served_model_name or served_name(spec)
    server: uvicorn.Server | None = None

    def shut_down(err: BaseException) -> None:         # on the engine thread, after every request has ended
        threading.Timer(DEATH_GRACE_S, setattr, (server, "should_exit", True)).start()

    app = create_app(engine, model_name, spec.max_model_len, spec.max_num_seqs, args.max_queue,
                     StepTrace(args.step_trace) if args.step_trace else None, docs=args.docs, on_death=shut_down,
                     codec=model_codec(spec))
    server = uvicorn.Server(door_limits(args).uvicorn_config(app, host=args.host, port=args.port,
                                                             log_level=args.log_level))
    print(startup_line(args, engine, model_name), flush=True)
    server.run()
    err = app.state.loop.error
    if err is not None:
        print(f"python -m serve.http: the engine died ({type(err).__name__}: {err}); exiting with status "
              f"{ENGINE_DIED} so that a supervisor restarts the server", file=sys.stderr, flush=True)
        raise SystemExit(ENGINE_DIED)


if __name__ == "__main__":
    main()
