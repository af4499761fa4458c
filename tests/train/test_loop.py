"""train.loop: the schedule, resume (a killed run resumed equals an uninterrupted one, bitwise), the logs,
a checkpoint of another run refused; train.batches: windows and targets."""
import csv
import dataclasses

import pytest
import torch

from kda_core.config import PRESETS
from train.batches import BatchSampler, as_tensor, eval_windows
from train.corpus import Split
from train.evaluate import evaluate
from train.loop import TrainArgs, lr_at, train

TEXT = (b"def f(x):\n    return x + 1\n\n" * 40) + bytes(range(32, 127)) * 4
DATA = Split(TEXT, TEXT[:700], b"The assert statement checks a condition. " * 20)
ARGS = TrainArgs(batch_size=2, seq_len=64, max_steps=6, warmup_steps=2, log_every=1, eval_every=3, eval_windows=2)
CFG = PRESETS["demo-tiny"]


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_resume_equals_an_uninterrupted_run(tmp_path):
    whole = train(CFG, DATA, ARGS, tmp_path / "a", quiet=True)
    train(CFG, DATA, ARGS, tmp_path / "b", quiet=True, stop_at_step=4)     # "killed" after step 4
    resumed = train(CFG, DATA, ARGS, tmp_path / "b", quiet=True)
    for name, t in whole.state_dict().items():
        assert torch.equal(t, resumed.state_dict()[name]), name
    for log, timing in (("loss.csv", ("tokens_per_s", "elapsed_s")), ("eval.csv", ("elapsed_s",))):
        a, b = _rows(tmp_path / "a" / log), _rows(tmp_path / "b" / log)
        strip = [{k: v for k, v in r.items() if k not in timing} for r in a]
        assert strip == [{k: v for k, v in r.items() if k not in timing} for r in b], log
    assert [int(r["step"]) for r in _rows(tmp_path / "a" / "loss.csv")] == list(range(1, 7))
    assert [int(r["step"]) for r in _rows(tmp_path / "a" / "eval.csv")] == [0, 3, 6]


def test_training_lowers_the_loss(tmp_path):
    args = dataclasses.replace(ARGS, max_steps=30, eval_every=30, lr=1e-2)
    rows = _rows((train(CFG, DATA, args, tmp_path, quiet=True), tmp_path / "eval.csv")[1])
    assert float(rows[-1]["code_nats_per_byte"]) < float(rows[0]["code_nats_per_byte"]) - 1.0


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    train(CFG, DATA, ARGS, tmp_path, quiet=True, stop_at_step=1)
    with pytest.raises(ValueError, match="another run"):
        train(CFG, DATA, dataclasses.replace(ARGS, lr=1e-4), tmp_path, quiet=True)
    with pytest.raises(ValueError, match="another run"):
        train(PRESETS["demo"], DATA, ARGS, tmp_path, quiet=True)


def test_lr_schedule():
    args = TrainArgs(max_steps=1000, warmup_steps=100, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, args) == pytest.approx(1e-5) and lr_at(99, args) == pytest.approx(1e-3)
    assert lr_at(550, args) == pytest.approx(0.55e-3)
    assert lr_at(1000, args) == pytest.approx(1e-4) and lr_at(5000, args) == pytest.approx(1e-4)


@pytest.mark.parametrize("bad", [dict(batch_size=0), dict(lr=0.0), dict(min_lr_ratio=2.0), dict(device="tpu"),
                                 dict(checkpoint_every_s=0.0)], ids=lambda d: next(iter(d)))
def test_train_args_reject_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        TrainArgs(**bad)


def test_batches_and_windows():
    data = as_tensor(bytes(range(200)))
    b = BatchSampler(data, 3, 10, seed=0).next()
    assert b.inputs.shape == (3, 10) and torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    assert torch.equal(b.targets - b.inputs, torch.ones(3, 10, dtype=torch.long))   # consecutive bytes
    w = eval_windows(data, 4, 10)
    assert w.inputs[0, 0] == 0 and w.targets[-1, -1] == 199
    with pytest.raises(ValueError, match="seq_len"):
        eval_windows(data, 1, 200)
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(data, 1, 200, seed=0)


def test_evaluate_scores_a_uniform_model_at_ln_256():
    class Uniform(torch.nn.Module):
        def forward(self, x):
            return type("Out", (), {"logits": torch.zeros(*x.shape, 256)})()
    q = evaluate(Uniform(), eval_windows(as_tensor(TEXT), 3, 16))
    assert q.nats_per_byte == pytest.approx(torch.log(torch.tensor(256.0)).item()) and q.num_bytes == 48
