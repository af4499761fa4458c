"""The one place the server builds its model and engine (:func:`load_model`, :func:`build_engine`).

The served model is a runnable preset loaded by :func:`serve.runnable.demo_model`, the model the lab's pages run:
by default ``demo``, the trained weights shipped in ``weights/kda-demo``, served under the model id ``kda-demo``
(``python -m serve.http`` names a preset's model ``kda-<preset>``); or, with ``model_path``, any checkpoint folder
in Kimi-Linear's format (``config.json`` + safetensors in Moonshot's names + ``tokenizer.json``,
:mod:`kda_core.pretrained`), served under the folder's name, its text through the folder's tokenizer
(:mod:`serve.text_codec`). The engine is :class:`serve.engine.ServeEngine`
built through its public constructor only, so a batching engine with the same API is served unchanged.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kda_core.config import ModelConfig
from kda_core.model import HybridLM
from kda_core.pretrained import CONFIG_NAME
from serve.config import STATE_DTYPES, ServeConfig
from serve.engine import STATE_WRITES, EngineArgs, ServeEngine
from serve.engine.build import build_engine as build_from_args
from serve.errors import check_choice, check_int
from serve.runnable import RUNNABLE, demo_model, folder_model
from serve.spec_decode.draft import NgramProposer
from serve.spec_decode.replay_ssm import DEFAULT_RING_SIZE
from serve.spec_decode.verify import Speculation
from serve.text_codec import BYTES, load_codec

SERVABLE = RUNNABLE


def load_model(preset: str = "demo", model_path: str | None = None) -> HybridLM:
    """The served :class:`HybridLM` (fp32, eval mode): the checkpoint folder ``model_path`` when given
    (``HybridLM.from_pretrained``), else the runnable demo preset: ``demo`` runs the shipped trained weights
    (:func:`serve.runnable.demo_model`, loaded once per process and shared, never modified). Raises ValueError
    naming ``preset`` for anything else, or the loader's error for a bad folder."""
    check_choice("preset", preset, SERVABLE)
    if model_path is not None:
        return folder_model(model_path)
    return demo_model(preset)


def model_codec(spec: EngineSpec):
    """The text codec of the served model (:func:`serve.text_codec.load_codec`): the folder's tokenizer with
    ``model_path``, else the shipped byte vocabulary."""
    return BYTES if spec.model_path is None else load_codec(spec.model_path)


def served_name(spec: EngineSpec) -> str:
    """The model id clients send by default: the folder's name with ``model_path``, else ``kda-<preset>``."""
    return Path(spec.model_path).resolve().name if spec.model_path is not None else f"kda-{spec.preset}"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding of the served engine, in vLLM's ``--speculative-config`` terms (``vllm/config/
    speculative.py``): ``method`` "ngram" (prompt lookup, :class:`serve.spec_decode.draft.NgramProposer`),
    ``num_speculative_tokens`` drafts per step, the n-gram lengths ``prompt_lookup_min`` .. ``prompt_lookup_max``
    tried (longest first). Drafts are verified in the decode step and accepted greedily; the KDA state is rolled
    back to the accepted length from per-token snapshots (:class:`serve.spec_decode.snapshot.SnapshotRollback`).
    Raises ValueError naming the first bad field."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1

    def __post_init__(self):
        check_choice("method", self.method, ("ngram",))
        check_int("num_speculative_tokens", self.num_speculative_tokens)
        check_int("prompt_lookup_min", self.prompt_lookup_min)
        check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config of a JSON object (``'{"method": "ngram", "num_speculative_tokens": 3}'``). Raises ValueError
        for text that is not a JSON object, an unknown key or a bad value."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"not JSON: {err.msg} at character {err.pos}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"must be a JSON object, got {text!r}")
        unknown = sorted(set(obj) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**obj)

    def speculation(self) -> Speculation:
        """The engine's :class:`Speculation` (one n-gram proposer and one snapshot rollback per request)."""
        proposer = functools.partial(_ngram_proposer, self.prompt_lookup_max, self.prompt_lookup_min)
        return Speculation.named(proposer, "snapshot", self.num_speculative_tokens)


def _ngram_proposer(max_ngram: int, min_ngram: int, prompt) -> NgramProposer:
    return NgramProposer(max_ngram, min_ngram)


@dataclass(frozen=True)
class EngineSpec:
    """How the server's engine is sized. Frozen; validated in ``__post_init__``.

    preset: the model (:data:`SERVABLE`); model_path: a checkpoint folder to serve instead of the preset (None:
    the preset); max_model_len: prompt + output tokens (bytes) one request may
    reach; max_num_seqs: requests the engine holds at once (each one private KDA state: a "state slot");
    num_pages: pool pages (None: :meth:`pool_pages`' fp32 sizing, the same bytes for every state dtype);
    block_size / checkpoint_interval: the :class:`ServeConfig`; prefix_cache: share prefixes or not;
    state_write: how a plain decode step writes a request's KDA state (:data:`serve.engine.STATE_WRITES`: "slot",
    the whole state every step, or "replay_ssm", a record per step and the state every ``ring_size`` steps;
    vllm#47572); ring_size: decode steps per state write under "replay_ssm" (an int >= 1; None: SGLang's
    default :data:`DEFAULT_RING_SIZE`), None under "slot"; state_dtype: the stored dtype of the KDA recurrent
    states by name, a key of :data:`serve.config.STATE_DTYPES` ("fp32", "bf16", "fp16"; ``ServeConfig.state_dtype``,
    vLLM's ``--mamba-ssm-cache-dtype``); speculative: a :class:`SpeculativeConfig` (None: plain decoding);
    chunked_prefill_size: most prompt tokens one prefill forward computes (the engine's ``max_prefill_chunk``,
    SGLang's ``--chunked-prefill-size``; None: the whole rest of the prompt).
    Raises ValueError naming the first bad field (a ``ring_size`` with ``state_write="slot"`` too: it would be
    ignored; speculation with ``state_write="replay_ssm"``: its decode rows are verify rows).
    """

    preset: str = "demo"
    max_model_len: int = 1024
    max_num_seqs: int = 64
    num_pages: int | None = None
    block_size: int = 16
    checkpoint_interval: int = 64
    prefix_cache: bool = True
    state_write: str = "slot"
    ring_size: int | None = None
    state_dtype: str = "fp32"
    speculative: SpeculativeConfig | None = None
    chunked_prefill_size: int | None = None
    model_path: str | None = None

    def __post_init__(self):
        check_choice("preset", self.preset, SERVABLE)
        if self.model_path is not None and not (Path(self.model_path) / CONFIG_NAME).is_file():
            raise ValueError(f"model_path must be a checkpoint folder holding {CONFIG_NAME}, got {self.model_path!r}")
        check_int("max_model_len", self.max_model_len, 2)
        check_int("max_num_seqs", self.max_num_seqs)
        if self.num_pages is not None:
            check_int("num_pages", self.num_pages)
        ServeConfig(self.block_size, self.checkpoint_interval)          # validates both
        check_choice("state_write", self.state_write, STATE_WRITES)
        check_choice("state_dtype", self.state_dtype, tuple(STATE_DTYPES))
        if self.ring_size is not None:
            if self.state_write != "replay_ssm":
                raise ValueError(f"ring_size is the replay_ssm state write's ring, got ring_size={self.ring_size!r} "
                                 f"with state_write={self.state_write!r}")
            check_int("ring_size", self.ring_size)
        if self.speculative is not None:
            if not isinstance(self.speculative, SpeculativeConfig):
                raise ValueError(f"speculative must be a SpeculativeConfig or None, got {self.speculative!r}")
            if self.state_write != "slot":
                raise ValueError("speculative decoding needs state_write='slot' (its decode rows are verify rows, "
                                 f"rolled back from snapshots), got state_write={self.state_write!r}")
        if self.chunked_prefill_size is not None:
            check_int("chunked_prefill_size", self.chunked_prefill_size)

    @property
    def engine_ring_size(self) -> int:
        """The ring size the engine gets (:data:`DEFAULT_RING_SIZE` when unset; unused under "slot")."""
        return DEFAULT_RING_SIZE if self.ring_size is None else self.ring_size

    @property
    def config(self) -> ServeConfig:
        return ServeConfig(self.block_size, self.checkpoint_interval, state_dtype=STATE_DTYPES[self.state_dtype])

    def check_pool(self, model_cfg: ModelConfig, memory_bytes: int | None = None) -> None:
        """Refuse a pool that cannot serve, before anything is allocated (ValueError naming the option):
        one request of ``max_model_len`` tokens (its state pages in the stored dtype + its KV pages) must fit in
        :meth:`pool_pages`, as vLLM refuses a KV cache that cannot hold one max-length sequence
        (``check_enough_kv_cache_memory`` in ``vllm/v1/core/kv_cache_utils.py``; the message gives the largest
        ``max_model_len`` the pool holds, as vLLM's does); and the pool's bytes must fit in ``memory_bytes``
        (default: this machine's physical memory, ``os.sysconf``), the sane maximum a CPU server can allocate."""
        config = self.config
        layout, page_bytes = config.layout(model_cfg), config.page_bytes(model_cfg)
        num_pages = self.pool_pages(model_cfg)
        state = layout.state_pages * self.state_slots_per_request
        need = state + -(-self.max_model_len // self.block_size)                     # state + KV pages
        if num_pages < need:
            fits = (num_pages - state) * self.block_size
            raise ValueError(f"num_pages={num_pages} cannot hold one request of max_model_len={self.max_model_len} "
                             f"tokens ({state} state pages + {need - state} KV pages = "
                             f"{need} pages); raise num_pages to {need} or lower max_model_len"
                             + (f" to {fits}" if fits >= 2 else ""))
        memory_bytes = _machine_memory_bytes() if memory_bytes is None else memory_bytes
        if num_pages * page_bytes > memory_bytes:
            raise ValueError(f"the pool of {num_pages:,} pages x {page_bytes:,} bytes = "
                             f"{num_pages * page_bytes / 2**30:,.1f} GiB exceeds this machine's memory "
                             f"({memory_bytes / 2**30:,.1f} GiB); lower max_model_len={self.max_model_len} or "
                             f"max_num_seqs={self.max_num_seqs}, or set num_pages")

    @property
    def state_slots_per_request(self) -> int:
        """State slots a running request holds: 1, or k + 1 with snapshot speculation of k drafts (the verify row
        writes the state after each token into its own slot: :class:`serve.engine.request_memory.RequestMemory`)."""
        return 1 if self.speculative is None else self.speculative.num_speculative_tokens + 1

    def pool_pages(self, model_cfg: ModelConfig) -> int:
        """Pool pages for ``model_cfg``: ``num_pages`` or, by default, the fp32 sizing for every state dtype,
        2 * max_num_seqs * (fp32 state pages x :attr:`state_slots_per_request` + KV pages of ``max_model_len``
        tokens), so every slot fits at full length with the same again left for cached prefixes. The pages (one KV block each) have the same bytes
        for every dtype, so a 16-bit state gets the fp32 pool's bytes and holds more state slots in it (1.63x
        for the demo model, by the stored bytes), as vLLM sizes its KV cache by memory, not by slot count."""
        if self.num_pages is not None:
            return self.num_pages
        fp32_state_pages = ServeConfig(self.block_size, self.checkpoint_interval).layout(model_cfg).state_pages
        kv_pages = -(-self.max_model_len // self.block_size)                       # KV blocks of one request
        return 2 * self.max_num_seqs * (fp32_state_pages * self.state_slots_per_request + kv_pages)


def _machine_memory_bytes() -> int:
    """Physical memory of this machine, bytes (page size x physical pages)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def build_engine(spec: EngineSpec, model: HybridLM | None = None) -> ServeEngine:
    """A fresh engine for ``spec`` (:func:`serve.engine.build_engine`) on a fresh pool of :meth:`EngineSpec.pool_pages`
    pages, its scheduler capped at ``max_num_seqs``
    running requests: every step runs their decode rows and the admitted prompts' prefill rows together (prompts
    in chunks of at most ``spec.chunked_prefill_size`` tokens); its decode steps write the KDA state as
    ``spec.state_write`` says, or verify ``spec.speculative``'s drafts. Raises ValueError for a bad spec or a pool
    that cannot serve it (:meth:`EngineSpec.check_pool`)."""
    model = load_model(spec.preset, spec.model_path) if model is None else model
    spec.check_pool(model.cfg)
    speculation = None if spec.speculative is None else spec.speculative.speculation()
    return build_from_args(EngineArgs(
        model, spec.pool_pages(model.cfg), spec.config, prefix_cache=spec.prefix_cache,
        max_prefill_chunk=spec.chunked_prefill_size, speculation=speculation, max_num_seqs=spec.max_num_seqs,
        state_write=spec.state_write, ring_size=spec.engine_ring_size))


class PoolCapacity(NamedTuple):
    """What an engine's pool holds. num_pages: pool pages; pool_bytes: num_pages x page bytes; state_pages:
    pages of one request's KDA state (all layers, in the stored dtype); state_slots: states the pool could hold
    alone (num_pages // state_pages); requests: requests of ``max_model_len`` tokens it holds, state + KV pages
    each (with snapshot speculation of k drafts, k + 1 states each). The engine runs at most ``max_num_seqs``
    requests whatever these say."""

    num_pages: int
    pool_bytes: int
    state_pages: int
    state_slots: int
    requests: int


def pool_capacity(engine: ServeEngine, max_model_len: int) -> PoolCapacity:
    """The :class:`PoolCapacity` of ``engine``'s pool for requests of ``max_model_len`` tokens."""
    pool, layout = engine.pool, engine.layout
    kv_pages = -(-max_model_len // layout.block_size)                               # KV blocks of one request
    state = layout.state_pages * engine.memory.slots_per_request                  # every slot a request holds
    return PoolCapacity(pool.num_pages, pool.num_pages * pool.page_bytes, layout.state_pages,
                        pool.num_pages // layout.state_pages, pool.num_pages // (state + kv_pages))
