"""The training loop of ``python -m train``: AdamW on next-byte cross-entropy through ``HybridLM``'s own forward.

The forward is the serving model's chunk-mode forward (``kda_core.model.HybridLM`` in training mode), so
autograd runs through :func:`kda_core.chunk.kda_chunk` itself; there is no training-only path.

Schedule: linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at ``max_steps``.
Logs (``<out>/``): ``loss.csv`` (every ``log_every`` steps: mean training loss of those steps, learning rate,
gradient norm, throughput) and ``eval.csv`` (held-out nats per byte and top-1 on code and prose). On resume
both are cut back to the checkpoint's step, so a killed and resumed run logs each step once.
"""
from __future__ import annotations

import csv
import dataclasses
import math
import signal
import sys
import time
from pathlib import Path

import torch

from kda_core.config import ModelConfig
from kda_core.model import HybridLM
from kda_core.moe import MoE
from train import checkpoint
from train.batches import BatchSampler, as_tensor, eval_windows
from train.corpus import Split
from train.evaluate import evaluate, loss_of
from train.upcycle import upcycle

LOSS_FIELDS = ("step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s")
EVAL_FIELDS = ("step", "tokens", "code_nats_per_byte", "prose_nats_per_byte", "code_top1", "prose_top1",
               "elapsed_s")


@dataclasses.dataclass(frozen=True)
class TrainArgs:
    """Hyper-parameters of a run (all validated in ``__post_init__``; sizes in bytes = tokens)."""

    batch_size: int = 4
    seq_len: int = 512
    max_steps: int = 4800
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_windows: int = 16
    checkpoint_every_s: float = 300.0
    device: str = "cpu"
    bias_update_rate: float = 1e-3
    init_from: str = ""

    def __post_init__(self):
        for name in ("batch_size", "seq_len", "max_steps", "log_every", "eval_every", "eval_windows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError(f"need lr > 0, min_lr_ratio in [0, 1], warmup_steps >= 0; got {self.lr}, "
                             f"{self.min_lr_ratio}, {self.warmup_steps}")
        if not self.checkpoint_every_s > 0:
            raise ValueError(f"checkpoint_every_s must be > 0, got {self.checkpoint_every_s}")
        if not 0 <= self.bias_update_rate < 1:
            raise ValueError(f"bias_update_rate must be in [0, 1), got {self.bias_update_rate}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")


def lr_at(step: int, args: TrainArgs) -> float:
    """Learning rate of optimizer step ``step`` (0-based): warm-up then cosine to ``min_lr_ratio * lr``."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    frac = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def config_from_dict(d: dict) -> ModelConfig:
    """A :class:`ModelConfig` from ``dataclasses.asdict`` output (lists back to tuples)."""
    return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def make_optimizer(model: HybridLM, args: TrainArgs) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, gate biases or per-head rates)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))


def _cut_log(path: Path, fields, step: int) -> None:
    """Keep the header and the rows of ``path`` with step <= ``step`` (create it with a header if absent)."""
    rows = []
    if path.is_file():
        with path.open() as f:
            rows = [r for r in csv.DictReader(f) if int(r["step"]) <= step]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def _append(path: Path, fields, row: dict) -> None:
    with path.open("a", newline="") as f:
        csv.DictWriter(f, fieldnames=fields).writerow(row)


class _Progress:
    """tqdm when installed, else one plain line every ``log_every`` steps."""

    def __init__(self, start: int, total: int):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, mininterval=5)
        except ImportError:
            self.bar = None
        self.total = total

    def update(self, step: int, text: str) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)                # called every log_every steps
            self.bar.set_postfix_str(text, refresh=False)
        else:
            print(f"step {step}/{self.total} {text}", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def train(cfg: ModelConfig, data: Split, args: TrainArgs, out_dir, quiet: bool = False,
          stop_at_step: int | None = None) -> HybridLM:
    """Train (or resume) a run in ``out_dir`` until ``args.max_steps``; returns the trained model (fp32).

    ``stop_at_step``: stop (with a checkpoint) once this many steps are done, as a killed run would; the same
    call again resumes it. ``quiet``: no progress output.

    Resumes from ``out_dir/checkpoint.pt`` when present; raises ValueError if that checkpoint was made for a
    different model config or different hyper-parameters (``checkpoint_every_s`` and ``device`` may differ).
    Saves a checkpoint every ``checkpoint_every_s`` seconds, at the end, and on SIGTERM / SIGINT (then stops).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    model = HybridLM(cfg)
    if args.init_from:
        upcycle(model, args.init_from, seed=args.seed)
    model.requires_grad_(True)
    opt = make_optimizer(model, args)
    sampler = BatchSampler(as_tensor(data.train), args.batch_size, args.seq_len, args.seed)
    evals = {kind: eval_windows(as_tensor(b), args.eval_windows, args.seq_len)
             for kind, b in (("code", data.heldout_code), ("prose", data.heldout_prose))}
    step, tokens, elapsed0 = 0, 0, 0.0
    ckpt = checkpoint.load(out)
    run_args = {k: v for k, v in dataclasses.asdict(args).items() if k not in ("checkpoint_every_s", "device")}
    if ckpt is not None:
        if ckpt["config"] != dataclasses.asdict(cfg) or ckpt["args"] != run_args:
            raise ValueError(f"out_dir {out} holds a checkpoint of another run (config or arguments differ): "
                             f"{ckpt['config']} {ckpt['args']}")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sampler.set_state(ckpt["sampler_state"])
        step, tokens, elapsed0 = ckpt["step"], ckpt["tokens"], ckpt["elapsed_s"]
    model.to(device)
    for state in opt.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and k != "step":
                state[k] = v.to(device)
    _cut_log(out / "loss.csv", LOSS_FIELDS, step)
    _cut_log(out / "eval.csv", EVAL_FIELDS, step)

    stop = {"signal": None}
    def _on_signal(signum, _frame):
        stop["signal"] = signum
    old_handlers = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def save():
        checkpoint.save(out, model=model, optimizer=opt, step=step, tokens=tokens, sampler_state=sampler.state(),
                        config=dataclasses.asdict(cfg), args=run_args, elapsed_s=elapsed0 + time.time() - t_start)

    def run_eval():
        q = {kind: evaluate(model, w.__class__(w.inputs.to(device), w.targets.to(device))) for kind, w in evals.items()}
        _append(out / "eval.csv", EVAL_FIELDS, {
            "step": step, "tokens": tokens, "code_nats_per_byte": f"{q['code'].nats_per_byte:.5f}",
            "prose_nats_per_byte": f"{q['prose'].nats_per_byte:.5f}", "code_top1": f"{q['code'].top1:.5f}",
            "prose_top1": f"{q['prose'].top1:.5f}", "elapsed_s": f"{elapsed0 + time.time() - t_start:.1f}"})
        return q

    # kda_core creates its helper tensors (chunk identity, RoPE positions, masks, empty caches) on the default
    # device; the model and data above were built on the CPU (seeded CPU generators), so switch it only now.
    prev_device = torch.get_default_device()
    torch.set_default_device(device)
    t_start = time.time()
    last_ckpt = time.time()
    progress = None if quiet else _Progress(step, args.max_steps)
    model.train()
    win_loss, win_n, win_t = 0.0, 0, time.time()
    try:
        if step == 0:
            run_eval()
        end = args.max_steps if stop_at_step is None else min(args.max_steps, stop_at_step)
        while step < end and stop["signal"] is None:
            lr = lr_at(step, args)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = sampler.next()
            x, y = batch.inputs.to(device), batch.targets.to(device)
            loss = loss_of(model(x).logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))
            opt.step()
            for ffn in model.ffn:                     # MoE layers: auxiliary-loss-free load balancing
                if isinstance(ffn, MoE):
                    ffn.update_bias(args.bias_update_rate)
            step += 1
            tokens += x.numel()
            win_loss, win_n = win_loss + loss.item(), win_n + 1
            if step % args.log_every == 0 or step == args.max_steps:
                dt = time.time() - win_t
                tps = win_n * x.numel() / dt
                _append(out / "loss.csv", LOSS_FIELDS, {
                    "step": step, "tokens": tokens, "loss": f"{win_loss / win_n:.5f}", "lr": f"{lr:.3e}",
                    "grad_norm": f"{gnorm:.4f}", "tokens_per_s": f"{tps:.1f}",
                    "elapsed_s": f"{elapsed0 + time.time() - t_start:.1f}"})
                if progress is not None:
                    progress.update(step, f"loss {win_loss / win_n:.4f} lr {lr:.2e} {tps:.0f} tok/s")
                win_loss, win_n, win_t = 0.0, 0, time.time()
            if step % args.eval_every == 0 or step == args.max_steps:
                q = run_eval()
                if progress is not None:
                    print(f"eval step {step}: code {q['code'].nats_per_byte:.4f} nats/byte "
                          f"(top-1 {q['code'].top1:.3f}), prose {q['prose'].nats_per_byte:.4f} nats/byte "
                          f"(top-1 {q['prose'].top1:.3f})", flush=True)
            if time.time() - last_ckpt >= args.checkpoint_every_s:
                save()
                last_ckpt = time.time()
        save()
        if stop["signal"] is not None and not quiet:
            print(f"stopped by signal {stop['signal']} at step {step}; checkpoint saved", file=sys.stderr, flush=True)
    finally:
        torch.set_default_device(prev_device)
        for s, h in old_handlers.items():
            signal.signal(s, h)
        if progress is not None:
            progress.close()
    model.eval()
    return model.cpu()
