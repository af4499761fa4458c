"""Start the OpenAI-compatible server in this process on 127.0.0.1 (a free port), for the server tests."""
from __future__ import annotations

import asyncio
import contextlib
import re

import pytest

from serve.http.__main__ import parse_args
from serve.http.app import create_app
from serve.http.background import serve_in_thread
from serve.http.model import EngineSpec, build_engine, load_model

MODEL = "kda-demo"


@contextlib.contextmanager
def running_server(spec: EngineSpec, max_queue: int = 64, model=None):
    """Yield ``(base_url, app)`` of a server on 127.0.0.1 serving ``spec``; stopped on exit."""
    app = create_app(build_engine(spec, model), MODEL, spec.max_model_len, spec.max_num_seqs, max_queue)
    with serve_in_thread(app) as url:
        yield url, app


def metric(text: str, name: str, **labels) -> float:
    """The value of one series in a Prometheus exposition (labels must match those given)."""
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(?:\{([^}]*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    raise KeyError(f"{name} {labels} not in /metrics")


def assert_exits_2(argv, message: str, capsys) -> None:
    """``python -m serve.http argv`` ends with argparse's usage line and ``message`` on stderr, exit status 2."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("usage: python -m serve.http") and message in err, err


def on_engine(app, fn, timeout: float = 30.0):
    """Run ``fn(engine)`` on the server's engine thread (between steps) and return its result."""
    loop: asyncio.AbstractEventLoop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(asyncio.wait_for(app.state.loop.call(fn), timeout))
    finally:
        loop.close()


def reference_texts(prompts, max_tokens, preset: str = "demo", sampling=None) -> list[bytes]:
    """Each prompt's output bytes from a batch-1 run on a fresh cache-off engine (the reference); ``sampling``:
    one :class:`serve.engine.sampling.SamplingParams` per prompt (None: greedy)."""
    engine = build_engine(EngineSpec(preset, prefix_cache=False, max_num_seqs=1), load_model(preset))
    sampling = sampling or [None] * len(prompts)
    return [bytes(engine.generate(p, n, sampling=sp).output_tokens) for p, n, sp in zip(prompts, max_tokens, sampling)]
