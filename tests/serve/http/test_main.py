"""``python -m serve.http``'s command line as a user meets it: the help states what holds only with fp32 states,
``/v1/models`` says whether a prefix-cache hit is exact, and bad values exit 2 with argparse's message."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from serve.http.__main__ import build_parser, engine_spec, parse_args
from serve.http.app import create_app
from serve.http.model import build_engine, load_model


def _help(option: str) -> str:
    action = next(a for a in build_parser()._actions if option in a.option_strings)
    return " ".join(action.help.split())


def test_help_qualifies_what_holds_only_with_fp32_states():
    assert "warm == cold holds only in fp32" in _help("--state-dtype")
    assert "with fp32 states the tokens are the same" in _help("--state-write")


@pytest.mark.parametrize(("argv", "exact"), [
    ([], True), (["--state-dtype", "bf16"], False), (["--state-dtype", "bf16", "--no-prefix-cache"], None),
], ids=["fp32", "bf16", "bf16-no-cache"])
def test_models_reports_whether_a_prefix_hit_is_exact(argv, exact):
    spec = engine_spec(parse_args(["--preset", "demo-tiny", "--max-model-len", "64", "--max-num-seqs", "2", *argv]))
    with TestClient(create_app(build_engine(spec, load_model("demo-tiny")), "kda-demo-tiny", 64, 2, 2)) as client:
        assert client.get("/v1/models").json()["data"][0]["prefix_hit_exact"] is exact
