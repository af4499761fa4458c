"""serve.runnable: the ``demo`` preset runs the shipped trained weights (everywhere: lab, HTTP server), the other
demo presets their seeded init; one model per preset per process."""
import json

import pytest
import torch

from kda_core.config import PRESETS
from kda_core.model import HybridLM
from serve.http.model import load_model
from serve.runnable import RUNNABLE, TRAINED_WEIGHTS, demo_model, draft_model, is_trained


def _recorded_logits(model, kind: str):
    """The model's logits at the positions the export recorded for its held-out ``kind`` sample, and those."""
    rec = json.loads((TRAINED_WEIGHTS["demo"] / "manifest.json").read_text())["ci_samples"][kind]
    x = torch.tensor(list(rec["text"].encode("utf-8")), dtype=torch.long)[None]      # [1, T]
    want = torch.tensor(rec["logits_last"])                                          # [P, 256]
    return model(x[:, :-1]).logits[0, -want.shape[0]:], want


@pytest.mark.parametrize("load", [demo_model, load_model], ids=["lab", "http"])
def test_demo_preset_runs_the_shipped_trained_weights(load):
    model = load("demo")
    assert model.cfg.name == "kda-demo" and not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())              # fp16 on disk, fp32 compute
    got, want = _recorded_logits(model, "code")
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)


def test_demo_model_is_loaded_once_per_preset():
    assert demo_model("demo") is demo_model("demo") is load_model("demo")
    assert demo_model.cache_info().maxsize == len(RUNNABLE)


@pytest.mark.parametrize("preset", ["demo-k3gate", "demo-tiny"])
def test_other_presets_keep_their_seeded_init(preset):
    assert not is_trained(preset)
    model, seeded = demo_model(preset), HybridLM(PRESETS[preset])
    assert model.cfg == PRESETS[preset]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), seeded.state_dict().values()))


def test_trained_model_keeps_the_demo_presets_cache_shapes():
    """Byte counts of the ``demo`` preset hold for the trained model: every cache tensor has the same shape."""
    trained, preset = demo_model("demo").empty_cache(2), HybridLM(PRESETS["demo"]).empty_cache(2)
    for a, b in zip(trained.layers, preset.layers):
        shapes = [tuple(t.shape) for t in (a if isinstance(a, tuple) else (a,))]
        assert shapes == [tuple(t.shape) for t in (b if isinstance(b, tuple) else (b,))]


@pytest.mark.parametrize("bad", ["kimi-k3", "Demo", ""])
def test_unknown_preset_is_a_value_error_naming_it(bad):
    with pytest.raises(ValueError, match="preset must be one of"):
        demo_model(bad)
    with pytest.raises(ValueError, match="preset must be one of"):
        is_trained(bad)


def test_draft_model_is_the_shipped_draft_loaded_once():
    """The draft model is loaded here, once per process, like the target (lab.drafters loaded it anew per call)."""
    draft = draft_model()
    assert draft is draft_model() and draft_model.cache_info().maxsize == 1
    assert draft.cfg.num_layers == 2 and not draft.training
    assert draft.cfg.hidden_size == demo_model("demo").cfg.hidden_size      # the target's widths
