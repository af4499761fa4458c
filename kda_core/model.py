"""``HybridLM``: the Kimi-Linear architecture (KDA + MLA hybrid, MoE feed-forward), pure torch.

The model of Moonshot's ``modeling_kimi.py`` (``KimiLinearForCausalLM``; transformers'
``models/kimi_linear/``): layers in the Kimi pattern (``linear_attn_config.full_attn_layers``: every 4th layer
MLA plus the last, ``kda_core.config.kimi_pattern``), pre-norm residual blocks
``x + self_attn(input_layernorm(x))`` then ``x + ffn(post_attention_layernorm(x))``, where the feed-forward is a
dense SwiGLU MLP in the first ``first_k_dense_replace`` layers and an MoE (:mod:`kda_core.moe`) after them,
then the final ``norm`` and an untied ``lm_head``. A config with ``num_experts = 0`` keeps a dense MLP
everywhere. Weights are generated deterministically from ``cfg.seed`` (no downloads) or read from a checkpoint
folder in Moonshot's format (:mod:`kda_core.pretrained`). The shipped models use a byte vocabulary (256 ids,
one per UTF-8 byte); any ``vocab_size`` works. The per-request cache is an immutable :class:`HybridCache`;
every call returns a new one.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn

from kda_core import pretrained
from kda_core.config import PRESETS, ModelConfig
from kda_core.invariant import linear
from kda_core.layer import KDAAux, KDACache, KDALayer, MLALayer, _check_mode, _check_state_at, rmsnorm
from kda_core.moe import DenseMLP, MoE, ffn_residual


class HybridCache(NamedTuple):
    """Per-request cache. ``layers[i]`` is a :class:`KDACache` for a KDA layer or the MLA latent
    tensor ``[B, L, r + rope]`` for an MLA layer; ``num_tokens`` = L, tokens consumed so far."""

    layers: tuple
    num_tokens: int


class ForwardOutput(NamedTuple):
    """logits ``[B, T, vocab]`` fp32; cache after the T tokens; aux: per layer index a
    :class:`KDAAux` for KDA layers (only with ``output_aux=True``, else None); states_at: with
    ``state_at``, ``{t: {layer index: KDACache}}``, every KDA layer's cache after exactly t tokens of
    the call (else None; MLA latents need no copy: the latent cache holds every token)."""

    logits: torch.Tensor
    cache: HybridCache
    aux: dict[int, KDAAux] | None
    states_at: dict[int, dict[int, KDACache]] | None = None


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as token ids ``[T]`` int64."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def bytes_to_text(tokens) -> str:
    """Token ids (bytes) back to text; invalid UTF-8 shows as U+FFFD."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def _no_grad_unless_training(fn):
    """Run ``fn`` without autograd unless the module is in training mode (``model.train()``) and grad is
    enabled: serving calls stay graph-free, the training script backpropagates through the same forward."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with torch.set_grad_enabled(self.training and torch.is_grad_enabled()):
            return fn(self, *args, **kwargs)
    return wrapper


class HybridLM(nn.Module):
    """The Kimi-Linear model. ``HybridLM()`` uses ``PRESETS["demo"]`` (8 layers, d = 128, 8 experts).

    Parameters (Moonshot's names in :mod:`kda_core.pretrained`): ``embed`` ``[vocab, D]`` (``embed_tokens``),
    ``mixers[i]`` (``self_attn``), ``norm1[i]`` / ``norm2[i]`` (``input_layernorm`` / ``post_attention_layernorm``),
    ``ffn[i]`` (``mlp``: :class:`DenseMLP`, or ``block_sparse_moe``: :class:`MoE`), ``norm_f`` (``norm``),
    ``lm_head`` ``[vocab, D]``.

    Raises ValueError for bad token ids or shapes.
    """

    def __init__(self, cfg: ModelConfig | None = None):
        super().__init__()
        cfg = PRESETS["demo"] if cfg is None else cfg
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, d, generator=gen), requires_grad=False)
        self.mixers = nn.ModuleList(
            MLALayer(cfg, gen) if i in cfg.mla_layers else KDALayer(cfg, gen) for i in range(cfg.num_layers))
        self.norm1 = nn.Parameter(torch.ones(cfg.num_layers, d), requires_grad=False)
        self.norm2 = nn.Parameter(torch.ones(cfg.num_layers, d), requires_grad=False)
        self.ffn = nn.ModuleList(MoE(cfg, gen) if cfg.is_moe_layer(i) else DenseMLP(d, f, gen)
                                 for i in range(cfg.num_layers))
        self.norm_f = nn.Parameter(torch.ones(d), requires_grad=False)
        self.lm_head = nn.Parameter(torch.randn(cfg.vocab_size, d, generator=gen) * d ** -0.5, requires_grad=False)
        self.eval()

    @classmethod
    def from_pretrained(cls, path) -> HybridLM:
        """Load a checkpoint folder in Kimi-Linear's format (``config.json`` + safetensors, one file or shards;
        see :mod:`kda_core.pretrained`) into fp32. Raises ValueError when the folder, a file or a config field is
        missing or unsupported, or a tensor is missing, unexpected or mis-shaped."""
        cfg = pretrained.read_config(path)
        # built on the CPU, then overwritten: the same peak memory as a meta build + to_empty, without the 2-3 s
        # import of torch._dynamo that a random factory under torch.device("meta") triggers (torch._refs)
        model = cls(cfg)
        state = pretrained.load(path, cfg, model.state_dict())
        model.load_state_dict(state)
        return model.eval()

    def save_pretrained(self, path, dtype: torch.dtype = torch.float32,
                        max_shard_bytes: int = pretrained.MAX_SHARD_BYTES) -> dict:
        """Write the model to folder ``path`` in Kimi-Linear's format (weights cast to ``dtype``, sharded above
        ``max_shard_bytes``); returns the config dict (see :func:`kda_core.pretrained.save`)."""
        return pretrained.save(self, path, dtype, max_shard_bytes)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return self.cfg.kda_layers

    def empty_cache(self, batch: int = 1) -> HybridCache:
        """A cache with no tokens for ``batch`` sequences."""
        return HybridCache(tuple(m.empty_cache(batch) for m in self.mixers), 0)

    def _check_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.dim() == 1:
            tokens = tokens.unsqueeze(0)
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be an integer tensor [B, T] or [T], got {tuple(tokens.shape)} {tokens.dtype}")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
            raise ValueError(f"tokens must be ids in [0, {self.cfg.vocab_size - 1}]")
        return tokens.long()

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Feed-forward of layer i (dense SwiGLU or MoE) on ``x [B, T, D]``."""
        return self.ffn[i](x)

    def input_norm(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """``input_layernorm`` of layer i on ``x [..., D]``."""
        return rmsnorm(x, self.norm1[i], self.cfg.rms_norm_eps)

    def post_attention_norm(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """``post_attention_layernorm`` of layer i on ``x [..., D]``."""
        return rmsnorm(x, self.norm2[i], self.cfg.rms_norm_eps)

    def feed_forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's post-attention sublayer on the residual stream ``x [..., D]``: ``x + mlp(post_attention_norm(x))``,
        written into x's own storage (and x returned) where the C form runs it in one call
        (:func:`kda_core.moe.ffn_residual`, bitwise the separate calls)."""
        return ffn_residual(self.ffn[i], x, self.norm2[i], self.cfg.rms_norm_eps)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final ``norm`` then ``lm_head``: hidden ``[..., D]`` -> logits ``[..., vocab]``."""
        return linear(rmsnorm(x, self.norm_f, self.cfg.rms_norm_eps), self.lm_head)

    @_no_grad_unless_training
    def forward(self, tokens: torch.Tensor, cache: HybridCache | None = None, mode: str = "chunk",
                output_aux: bool = False, num_layers: int | None = None,
                state_at: tuple[int, ...] = ()) -> ForwardOutput:
        """Run tokens ``[B, T]`` (or ``[T]``) from ``cache`` (None = empty). Pure.

        mode "chunk" (prefill) or "recurrent" (exact token-by-token maths; bitwise equal to T calls of
        :meth:`decode_step`). ``num_layers`` stops after that many layers (used to model a verify
        interrupted part-way); the returned logits are then None and the cache holds the later
        layers unchanged. ``state_at`` (chunk mode): offsets t in (0, T) at which every KDA layer's
        cache after exactly t tokens is also returned (``states_at``; see ``KDALayer.forward``).
        """
        _check_mode(mode)
        _check_state_at(state_at)
        tokens = self._check_tokens(tokens)
        B, T = tokens.shape
        if T == 0:
            raise ValueError("tokens must hold at least one token")
        if cache is None:
            cache = self.empty_cache(B)
        if len(cache.layers) != self.cfg.num_layers:
            raise ValueError(f"cache must have {self.cfg.num_layers} layers, got {len(cache.layers)}")
        stop = self.cfg.num_layers if num_layers is None else num_layers
        if not 0 <= stop <= self.cfg.num_layers:
            raise ValueError(f"num_layers must be in [0, {self.cfg.num_layers}], got {num_layers}")
        x = self.embed[tokens]                                            # [B, T, D]
        new_layers, aux = list(cache.layers), ({} if output_aux else None)
        state_at = tuple(sorted(set(state_at)))
        states_at = {t: {} for t in state_at} if state_at else None
        for i in range(stop):
            m, h = self.mixers[i], self.input_norm(i, x)
            if isinstance(m, KDALayer):
                out = m(h, cache.layers[i], mode=mode, output_aux=output_aux, state_at=state_at)
                if output_aux:
                    aux[i] = out.aux
                for t, c in (out.states_at or {}).items():
                    states_at[t][i] = c
                y, new_layers[i] = out.y, out.cache
            else:
                y, new_layers[i] = m(h, cache.layers[i], mode=mode)
            x = x + y
            x = self.feed_forward(i, x)                                   # x is this forward's own
        logits = self.head(x) if stop == self.cfg.num_layers else None
        return ForwardOutput(logits, HybridCache(tuple(new_layers), cache.num_tokens + T), aux, states_at)

    def prefill(self, tokens: torch.Tensor, cache: HybridCache | None = None, mode: str = "chunk"):
        """Prefill tokens ``[B, T]``; returns (logits ``[B, T, vocab]``, new cache)."""
        out = self.forward(tokens, cache, mode=mode)
        return out.logits, out.cache

    def decode_step(self, token: torch.Tensor, cache: HybridCache):
        """One decode token ``[B]`` (or a scalar/int); returns (logits ``[B, vocab]``, new cache)."""
        token = torch.as_tensor(token, dtype=torch.long).reshape(-1, 1)   # [B, 1]
        out = self.forward(token, cache, mode="recurrent")
        return out.logits[:, -1], out.cache

    def generate(self, prompt: torch.Tensor, max_new_tokens: int, cache: HybridCache | None = None):
        """Greedy generation for one or more prompts ``[B, T]``.

        Returns (new tokens ``[B, max_new_tokens]`` int64, cache). The cache has consumed the prompt
        and the first ``max_new_tokens - 1`` generated tokens: the last generated token is not fed
        back, as in a serving engine that stops after sampling it.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        logits, cache = self.prefill(prompt, cache)
        tok = logits[:, -1].argmax(-1)                                    # [B]
        out = [tok]
        for _ in range(max_new_tokens - 1):
            step_logits, cache = self.decode_step(tok, cache)
            tok = step_logits.argmax(-1)
            out.append(tok)
        return torch.stack(out, dim=1), cache


def cache_equal(a: HybridCache, b: HybridCache) -> bool:
    """Bitwise equality of two caches (every KDA recurrent/conv state and MLA latent)."""
    return a.num_tokens == b.num_tokens and len(a.layers) == len(b.layers) and all(
        torch.equal(x.recurrent, y.recurrent) and torch.equal(x.conv, y.conv) if isinstance(x, KDACache)
        else torch.equal(x, y) for x, y in zip(a.layers, b.layers))
