"""``python -m serve.http``'s command line as a user meets it: the help states what holds only with fp32 states,
``/v1/models`` says whether a prefix-cache hit is exact, and bad values exit 2 with argparse's message."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from serve.http.__main__ import SPARE_CONNECTIONS, build_parser, door_limits, engine_spec, parse_args, startup_line
from serve.http.app import create_app
from serve.http.model import EngineSpec, build_engine, load_model
from tests.serve.http.server_helpers import assert_exits_2


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


@pytest.mark.parametrize(("argv", "message"), [
    (["--port", "99999"], "argument --port: must be an int in [1, 65535], got 99999"),
    (["--port", "-1"], "argument --port: must be an int in [1, 65535], got -1"),
    (["--max-queue", "-1"], "argument --max-queue: must be an int >= 0, got -1"),
    (["--max-model-len", "99999999"], "exceeds this machine's memory"),
    (["--step-trace", "/nonexistent/dir/x.jsonl"], "argument --step-trace: folder '/nonexistent/dir' does not exist"),
    (["--num-pages", "1"], "num_pages=1 cannot hold one request of max_model_len=1024 tokens (13 state pages + 64 KV "
                           "pages = 77 pages); raise num_pages to 77 or lower max_model_len"),
    (["--num-pages", "76"], "raise num_pages to 77 or lower max_model_len to 1008"),
    (["--header-timeout", "0"], "argument --header-timeout: must be a finite number of seconds > 0, got 0"),
    (["--body-timeout", "inf"], "argument --body-timeout: must be a finite number of seconds > 0, got inf"),
    (["--timeout-keep-alive", "soon"], "argument --timeout-keep-alive: must be a number of seconds > 0, got 'soon'"),
    (["--max-connections", "0"], "argument --max-connections: must be an int >= 1, got 0"),
], ids=["port-high", "port-negative", "queue-negative", "model-len-huge", "trace-folder", "pages-1", "pages-76",
        "header-timeout-0", "body-timeout-inf", "keep-alive-word", "connections-0"])
def test_bad_values_exit_2_with_the_argparse_message(argv, message, capsys):
    assert_exits_2(argv, message, capsys)


def test_pool_check_holds_one_max_length_request_and_fits_in_memory():
    """The boundary: a pool of exactly one max-length request serves; the memory bound names the bytes."""
    model = load_model("demo-tiny")
    spec = EngineSpec("demo-tiny", max_model_len=64, max_num_seqs=2)
    need = spec.config.layout(model.cfg).state_pages + 64 // spec.block_size
    engine = build_engine(EngineSpec("demo-tiny", max_model_len=64, max_num_seqs=2, num_pages=need), model)
    assert engine.generate(list(range(1, 40)), 24).output_tokens                   # 63 tokens in the one request
    with pytest.raises(ValueError, match=f"num_pages={need - 1} cannot hold one request"):
        build_engine(EngineSpec("demo-tiny", max_model_len=64, max_num_seqs=2, num_pages=need - 1), model)
    page_bytes = spec.config.page_bytes(model.cfg)
    spec.check_pool(model.cfg, memory_bytes=spec.pool_pages(model.cfg) * page_bytes)   # exactly fits
    with pytest.raises(ValueError, match="exceeds this machine's memory"):
        spec.check_pool(model.cfg, memory_bytes=spec.pool_pages(model.cfg) * page_bytes - 1)


def test_pool_check_counts_the_k_plus_1_state_slots_of_snapshot_speculation():
    """With k = 2 speculative tokens a running request holds 3 state slots: the one-request boundary and the
    default pool grow by 2 states, and a request at the boundary runs (before, a pool sized for one slot let it
    through, and the request was then rejected: it could never fit)."""
    from serve.http.model import SpeculativeConfig
    model = load_model("demo-tiny")
    plain = EngineSpec("demo-tiny", max_model_len=64, max_num_seqs=2)
    spec = EngineSpec("demo-tiny", max_model_len=64, max_num_seqs=2, speculative=SpeculativeConfig(
        num_speculative_tokens=2))
    state = spec.config.layout(model.cfg).state_pages
    assert spec.state_slots_per_request == 3
    assert spec.pool_pages(model.cfg) == plain.pool_pages(model.cfg) + 2 * 2 * 2 * state
    need = 3 * state + 64 // spec.block_size
    with pytest.raises(ValueError, match=f"num_pages={need - 1} cannot hold one request .*{3 * state} state pages"):
        build_engine(EngineSpec("demo-tiny", max_model_len=64, max_num_seqs=2, num_pages=need - 1,
                                speculative=spec.speculative), model)
    engine = build_engine(EngineSpec("demo-tiny", max_model_len=64, max_num_seqs=2, num_pages=need,
                                     speculative=spec.speculative), model)
    assert engine.memory.slots_per_request == 3
    result = engine.generate(list(range(1, 40)), 24)
    assert result.reason == "" and len(result.output_tokens) == 24


@pytest.mark.parametrize(("argv", "warned"), [([], False), (["--state-dtype", "bf16"], True),
                                              (["--state-dtype", "bf16", "--no-prefix-cache"], False)],
                         ids=["fp32", "bf16", "bf16-no-cache"])
def test_startup_line_names_model_address_states_and_pool(argv, warned):
    args = parse_args(["--preset", "demo-tiny", "--max-model-len", "64", "--max-num-seqs", "2", "--port", "8123",
                       *argv])
    engine = build_engine(engine_spec(args), load_model("demo-tiny"))
    line = startup_line(args, engine, "kda-demo-tiny")
    assert line.startswith("python -m serve.http: serving kda-demo-tiny on http://127.0.0.1:8123/v1 | state dtype "
                           f"{args.state_dtype}, state write slot | pool {engine.pool.num_pages:,} pages = ")
    assert f"{engine.pool.num_pages // engine.layout.state_pages:,} state slots" in line
    assert ("a prefix-cache hit may change greedy output" in line) is warned


def test_door_options_reach_the_limits_and_docs_are_off_unless_asked():
    args = parse_args(["--preset", "demo-tiny", "--max-model-len", "64", "--max-num-seqs", "2", "--max-queue", "3"])
    limits = door_limits(args)
    assert (limits.header_timeout_s, limits.body_timeout_s, limits.keep_alive_s) == (10.0, 30.0, 5.0)
    assert limits.max_connections == 2 + 3 + SPARE_CONNECTIONS
    args = parse_args(["--preset", "demo-tiny", "--header-timeout", "2.5", "--max-connections", "9", "--docs"])
    assert (door_limits(args).header_timeout_s, door_limits(args).max_connections, args.docs) == (2.5, 9, True)
    spec = EngineSpec("demo-tiny", max_model_len=64, max_num_seqs=2)
    for docs, status in ((False, 404), (True, 200)):
        with TestClient(create_app(build_engine(spec, load_model("demo-tiny")), "m", 64, 2, 2, docs=docs)) as client:
            assert client.get("/docs").status_code == client.get("/openapi.json").status_code == status
