"""The shipped weights (weights/kda-demo, the target, and weights/kda-draft, its 2-layer draft model): files as
the export recorded them (sha256), within the size budget, loadable by HybridLM.from_pretrained, and reproducing
the export's held-out losses and logits.

Every expected value is read from ``weights/<name>/manifest.json``, which ``python -m train.export`` writes
with the weights, so these tests hold for whichever export is committed."""
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kda_core.model import HybridLM
from train.export import LOGIT_POSITIONS, SHIPPED_FILES, STORE_DTYPE
from train.model_config import TRAINED_MODELS, model_config

ROOT = Path(__file__).resolve().parents[2] / "weights"
MAX_WEIGHT_BYTES = 20 * 2 ** 20
LOSS_TOL_NATS = 0.05          # the held-out sample's loss may move this much across machines
LOGIT_TOL = 1e-3              # the same fp32 weights and maths; BLAS kernels may differ in the last bits


@pytest.fixture(scope="module", params=TRAINED_MODELS)
def name(request):
    return request.param


@pytest.fixture(scope="module")
def manifest(name):
    return json.loads((ROOT / name / "manifest.json").read_text())


@pytest.fixture(scope="module")
def model(name):
    return HybridLM.from_pretrained(ROOT / name)


@pytest.mark.parametrize("file", SHIPPED_FILES)
def test_shipped_file_matches_manifest_sha256(manifest, name, file):
    data = (ROOT / name / file).read_bytes()
    assert hashlib.sha256(data).hexdigest() == manifest["files"][file]["sha256"], file
    assert len(data) == manifest["files"][file]["num_bytes"]


def test_weights_are_stored_in_the_export_dtype_within_budget(manifest, name):
    path = ROOT / name / "model.safetensors"
    assert path.stat().st_size <= MAX_WEIGHT_BYTES
    with safe_open(str(path), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {STORE_DTYPE}
    assert manifest["weights_dtype"] == str(STORE_DTYPE).removeprefix("torch.")


def test_shipped_model_has_the_trained_shape(model, manifest, name):
    assert model.cfg == model_config(name)
    assert sum(p.numel() for p in model.parameters()) == manifest["num_parameters"]


@pytest.mark.parametrize("kind", ["code", "prose"])
def test_heldout_sample_loss_and_logits_match_the_export(model, manifest, kind):
    rec = manifest["ci_samples"][kind]
    x = torch.tensor(list(rec["text"].encode("utf-8")), dtype=torch.long)[None]   # [1, T]
    logits = model(x[:, :-1]).logits                                               # [1, T - 1, vocab]
    loss = torch.nn.functional.cross_entropy(logits[0], x[0, 1:]).item()
    assert abs(loss - rec["loss_nats"]) <= LOSS_TOL_NATS, (loss, rec["loss_nats"])
    torch.testing.assert_close(logits[0, -LOGIT_POSITIONS:], torch.tensor(rec["logits_last"]),
                               atol=LOGIT_TOL, rtol=0)


def test_loss_curve_ships_with_the_weights(manifest, name):
    lines = (ROOT / name / "loss.csv").read_text().splitlines()
    assert lines[0].startswith("step,tokens,loss")
    evals = (ROOT / name / "eval.csv").read_text().splitlines()
    assert evals[0].startswith("step,tokens,code_nats_per_byte") and len(evals) >= 2
    assert int(lines[-1].split(",")[0]) <= manifest["training"]["step"]


def test_model_config_names_the_trained_shapes():
    draft = model_config("kda-draft")
    assert (draft.num_layers, draft.kda_layers, draft.mla_layers) == (2, (0,), (1,))
    assert (draft.hidden_size, draft.vocab_size) == (model_config().hidden_size, 256)
    with pytest.raises(ValueError, match="name must be one of"):
        model_config("kda-huge")
    from train.__main__ import parse_args
    assert parse_args(["--out", "x", "--model", "kda-draft"]).model == "kda-draft"
    assert parse_args(["--out", "x"]).model == "kda-demo"
