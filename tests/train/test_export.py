"""train.export on a tiny run: the folder it writes loads, its manifest's hashes and CI record hold."""
import dataclasses
import hashlib
import json

import pytest
import torch

from kda_core.config import PRESETS
from kda_core.model import HybridLM
from train.corpus import Split, load_manifest, python_version
from train.export import SHIPPED_FILES, STORE_DTYPE, export
from train.loop import TrainArgs, train

TEXT = b"def f(x):\n    return x + 1\n\n" * 40
DATA = Split(TEXT, TEXT[:700], b"The assert statement checks a condition. " * 20)

pytestmark = pytest.mark.skipif(python_version() != load_manifest()["python_version"],
                                reason="export scores the manifest's corpus, pinned to another Python")


def test_export_round_trip(tmp_path):
    args = TrainArgs(batch_size=2, seq_len=64, max_steps=2, warmup_steps=1, log_every=1, eval_every=2,
                     eval_windows=2)
    # Kimi-Linear's format has one linear_attn_config.head_dim: the K != V test preset cannot be exported
    cfg = dataclasses.replace(PRESETS["demo-tiny"], head_v_dim=PRESETS["demo-tiny"].head_k_dim)
    trained = train(cfg, DATA, args, tmp_path / "run", quiet=True)
    m = export(tmp_path / "run", tmp_path / "out", where="test")
    out = tmp_path / "out"
    for name in SHIPPED_FILES:
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == m["files"][name]["sha256"]
    assert json.loads((out / "manifest.json").read_text()) == m
    assert m["training"]["step"] == 2 and m["training"]["bytes_trained"] == 2 * 2 * 64
    loaded = HybridLM.from_pretrained(out)
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, trained.state_dict()[name].to(STORE_DTYPE).float()), name
    rec = m["ci_samples"]["code"]
    x = torch.tensor(list(rec["text"].encode()), dtype=torch.long)[None]
    assert torch.equal(loaded(x[:, :-1]).logits[0, -4:], torch.tensor(rec["logits_last"]))
    for kind in ("code", "prose"):
        assert m["quality"][kind]["xz_nats_per_byte"] > 0.5 and 0 <= m["quality"][kind]["top1"] <= 1


def test_export_needs_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="checkpoint"):
        export(tmp_path, tmp_path / "out", where="test")
