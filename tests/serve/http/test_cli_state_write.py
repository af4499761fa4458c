"""``python -m serve.http --state-write {slot,replay_ssm} --ring-size R``: the options reach the served engine and
``/v1/models``, bad values end with argparse's message (exit 2), and a server whose decode steps write the KDA state
by ReplaySSM (vllm#47572) serves the same greedy bytes as the slot write and as a batch-1 cache-off run."""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from serve.http.__main__ import engine_spec, parse_args
from serve.http.model import EngineSpec, build_engine, load_model
from serve.spec_decode.replay_ssm import DEFAULT_RING_SIZE
from tests.serve.http.server_helpers import MODEL, assert_exits_2, on_engine, reference_texts, running_server


@pytest.mark.parametrize(("argv", "state_write", "ring_size"), [
    ([], "slot", None),
    (["--state-write", "replay_ssm"], "replay_ssm", DEFAULT_RING_SIZE),
    (["--state-write", "replay_ssm", "--ring-size", "5"], "replay_ssm", 5),
], ids=["default", "replay-default-ring", "replay-ring5"])
def test_state_write_options_reach_the_engine(argv, state_write, ring_size):
    engine = build_engine(engine_spec(parse_args(["--preset", "demo-tiny", *argv])), load_model("demo-tiny"))
    assert engine.state_write == state_write
    assert (engine.replay.ring_size if engine.replay is not None else None) == ring_size


@pytest.mark.parametrize(("argv", "message"), [
    (["--state-write", "ssm"], "argument --state-write: invalid choice: 'ssm'"),
    (["--ring-size", "4"], "--ring-size applies to --state-write replay_ssm only (got --state-write slot)"),
    (["--state-write", "slot", "--ring-size", "4"], "--ring-size applies to --state-write replay_ssm only"),
    (["--state-write", "replay_ssm", "--ring-size", "0"], "argument --ring-size: must be an int >= 1, got 0"),
    (["--state-write", "replay_ssm", "--ring-size", "-3"], "argument --ring-size: must be an int >= 1, got -3"),
    (["--state-write", "replay_ssm", "--ring-size", "2.5"], "argument --ring-size: must be an int >= 1, got '2.5'"),
    (["--max-model-len", "1"], "max_model_len must be an int >= 2, got 1"),
], ids=["unknown-write", "ring-on-default", "ring-on-slot", "ring-0", "ring-negative", "ring-float", "spec-value"])
def test_bad_state_write_options_exit_with_the_argparse_message(argv, message, capsys):
    assert_exits_2(argv, f"error: {message}", capsys)


# Three prompts decoded together; 56 + 24 bytes cross the 64-token checkpoint (a publish materialises the state
# mid-ring), and ring 3 materialises every third decode step in between.
PROMPTS = ["def checkpoint(state, ring):\n    # write the state at ", "The KDA recurrence decays each key ",
           "Prefix caching keeps one state per 64 tokens, so a hit "]
MAX_TOKENS = 24


def _serve(spec: EngineSpec) -> tuple[dict, list[str], tuple[int, int] | None]:
    """``/v1/models``' entry, each prompt's greedy completion (the prompts sent at once: one batch) and, under
    ReplaySSM, the engine's state materialisations (all, and those forced by a checkpoint publish)."""
    with running_server(spec, max_queue=8) as (url, app):
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            outs = list(pool.map(lambda p: httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": p, "max_tokens": MAX_TOKENS}).json(), PROMPTS))
        flushes = on_engine(app, lambda e: e.replay and (e.replay.num_materialisations,
                                                         e.replay.num_publish_materialisations))
        return httpx.get(f"{url}/v1/models").json()["data"][0], [o["choices"][0]["text"] for o in outs], flushes


def test_replay_ssm_server_serves_the_slot_servers_bytes():
    slot_card, slot, _ = _serve(EngineSpec(max_model_len=128, max_num_seqs=4))
    replay_card, replay, (flushes, publish_flushes) = _serve(
        EngineSpec(max_model_len=128, max_num_seqs=4, state_write="replay_ssm", ring_size=3))
    assert (slot_card["state_write"], slot_card["ring_size"]) == ("slot", None)
    assert (replay_card["state_write"], replay_card["ring_size"]) == ("replay_ssm", 3)
    assert flushes > publish_flushes > 0, (flushes, publish_flushes)      # the ring was replayed and flushed
    # valid UTF-8 both ways (no U+FFFD), so equal texts are equal bytes, i.e. equal byte tokens
    assert not any("\ufffd" in t for t in slot + replay), (slot, replay)
    want = reference_texts([list(p.encode()) for p in PROMPTS], [MAX_TOKENS] * len(PROMPTS))
    assert [t.encode() for t in replay] == [t.encode() for t in slot] == want
