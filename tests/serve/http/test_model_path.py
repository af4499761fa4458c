"""``python -m serve.http --model-path DIR``: a checkpoint folder in Kimi-Linear's format, its own vocabulary and
tokenizer, served in place of the shipped preset."""
from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient

from kda_core.config import PRESETS
from kda_core.model import HybridLM
from serve.http.__main__ import engine_spec, parse_args
from serve.http.app import create_app
from serve.http.model import EngineSpec, build_engine, model_codec, served_name
from tests.serve.test_text_codec import bpe_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random tiny Kimi-Linear of another vocabulary (300 ids: a BPE tokenizer with merges) written as a checkpoint."""
    path = bpe_folder(tmp_path_factory.mktemp("ckpt") / "tiny-kimi")
    cfg = dataclasses.replace(PRESETS["demo-tiny"], head_v_dim=16, vocab_size=300)
    HybridLM(cfg).save_pretrained(path)
    return path


def test_the_folder_is_served_with_its_vocabulary_and_tokenizer(folder):
    spec = EngineSpec(max_model_len=64, max_num_seqs=2, model_path=str(folder))
    engine, codec = build_engine(spec), model_codec(spec)
    assert engine.model.cfg.vocab_size == 300 and served_name(spec) == "tiny-kimi"
    with TestClient(create_app(engine, "tiny-kimi", 64, 2, 4, codec=codec)) as client:
        text = "def main():\n    return 0\n"
        r = client.post("/v1/completions", json={"model": "tiny-kimi", "prompt": text, "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(codec.encode(text)) < len(text.encode())
        r = client.post("/v1/completions", json={"model": "tiny-kimi", "prompt": [299, 0, 5], "max_tokens": 2})
        assert r.status_code == 200, r.text                    # token ids of the folder's vocabulary
        r = client.post("/v1/completions", json={"model": "tiny-kimi", "prompt": [300], "max_tokens": 2})
        assert r.status_code == 400 and "[0, 299]" in r.json()["error"]["message"]


def test_the_command_line_takes_a_folder(folder, tmp_path):
    args = parse_args(["--model-path", str(folder), "--max-model-len", "64", "--max-num-seqs", "2"])
    assert engine_spec(args).model_path == str(folder)
    with pytest.raises(SystemExit):                              # not a checkpoint folder: argparse's error
        parse_args(["--model-path", str(tmp_path)])
