"""``python -m serve.http``: the OpenAI-compatible server on 127.0.0.1:8000 by default (see serve/http/__init__.py)."""
from __future__ import annotations

import argparse

import uvicorn

from serve.http.app import create_app
from serve.http.model import EngineSpec, build_engine
from serve.http.step_trace import StepTrace


def build_parser() -> argparse.ArgumentParser:
    """The command line; every option's help ends with its default."""
    p = argparse.ArgumentParser(prog="python -m serve.http", description=__doc__)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument("--preset", default="demo", help="runnable model preset: demo (the trained weights of "
                   "weights/kda-demo), demo-k3gate or demo-tiny (seeded init) (default: %(default)s)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: kda-<preset>)")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="prompt + output tokens (bytes) per request (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="requests in the engine at once (state slots) (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests queued in front of the engine before 429 (default: %(default)s)")
    p.add_argument("--num-pages", type=int, default=None,
                   help="pool pages (default: 2 x slots at max-model-len)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--checkpoint-interval", type=int, default=64,
                   help="tokens between KDA state checkpoints of the prefix cache (default: %(default)s)")
    p.add_argument("--no-prefix-cache", action="store_true", help="serve without prefix sharing (default: cache on)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (default: %(default)s)")
    p.add_argument("--step-trace", default=None, metavar="PATH",
                   help="write every engine step and request timeline to PATH (JSON lines, serve/http/step_trace.py) "
                   "(default: off)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    spec = EngineSpec(args.preset, args.max_model_len, args.max_num_seqs, args.num_pages, args.block_size,
                      args.checkpoint_interval, not args.no_prefix_cache)
    app = create_app(build_engine(spec), args.served_model_name or f"kda-{args.preset}", spec.max_model_len,
                     spec.max_num_seqs, args.max_queue, StepTrace(args.step_trace) if args.step_trace else None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
