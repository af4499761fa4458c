"""The one way to build an engine: :func:`build_engine` of an :class:`EngineArgs` (vLLM's ``EngineArgs`` name:
every setting in one frozen value, validated once). The server (``serve.http.model.build_engine`` of its
``EngineSpec``), the labs and the benches build their engines through it; ``ServeEngine(...)`` stays open for tests
that need an odd setup (a pool shared with something else, a cache built by hand)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kda_core.model import HybridLM
from serve.config import ServeConfig
from serve.engine.engine import ServeEngine
from serve.errors import check_int
from serve.memory.pool import PagePool
from serve.prefix.cache import PrefixCache
from serve.spec_decode.replay_ssm import DEFAULT_RING_SIZE
from serve.spec_decode.verify import Speculation


@dataclass(frozen=True)
class EngineArgs:
    """Everything an engine is built from.

    model: the :class:`HybridLM`; num_pages: pages of a fresh :class:`PagePool` (each
    ``config.page_bytes(model.cfg)`` bytes); config: the :class:`ServeConfig` (block size, checkpoint interval,
    groups, page policy, stored state dtype); prefix_cache: share prefixes through a :class:`PrefixCache` on that
    pool (False: the cache-off reference); poison: fill never-written pages with NaN (tests); the rest go to
    :class:`ServeEngine` as they are: max_prefill_chunk, speculation, the scheduler's caps max_num_seqs /
    max_num_batched_tokens / num_state_slots, rows_per_forward (1: the batch-1 baseline), state_write /
    ring_size, pad_decode. Raises ValueError naming the field for a model that is not a HybridLM, a non-positive
    ``num_pages``, a ``config`` that is not a ServeConfig or a non-bool flag (the engine checks the rest).
    """

    model: HybridLM
    num_pages: int
    config: ServeConfig = field(default_factory=ServeConfig)
    prefix_cache: bool = False
    poison: bool = False
    max_prefill_chunk: int | None = None
    speculation: Speculation | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    num_state_slots: int | None = None
    rows_per_forward: int | None = None
    state_write: str = "slot"
    ring_size: int = DEFAULT_RING_SIZE
    pad_decode: bool = True

    def __post_init__(self):
        if not isinstance(self.model, HybridLM):
            raise ValueError(f"model must be a HybridLM, got {type(self.model).__name__}")
        check_int("num_pages", self.num_pages)
        if not isinstance(self.config, ServeConfig):
            raise ValueError(f"config must be a ServeConfig, got {type(self.config).__name__}")
        for name in ("prefix_cache", "poison", "pad_decode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def page_bytes(self) -> int:
        """Bytes of one pool page: ``config.page_bytes(model.cfg)``."""
        return self.config.page_bytes(self.model.cfg)


def build_engine(args: EngineArgs) -> ServeEngine:
    """A fresh :class:`ServeEngine` for ``args`` on a fresh pool of ``args.num_pages`` pages, with a prefix cache
    on it when ``args.prefix_cache``. Raises ValueError for settings the engine refuses (see :class:`ServeEngine`)."""
    pool = PagePool(args.num_pages, args.page_bytes, poison=args.poison)
    cache = PrefixCache(pool, args.config, cfg=args.model.cfg) if args.prefix_cache else None
    return ServeEngine(args.model, pool, cache, args.max_prefill_chunk, config=args.config,
                       speculation=args.speculation, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, num_state_slots=args.num_state_slots,
                       rows_per_forward=args.rows_per_forward, pad_decode=args.pad_decode,
                       state_write=args.state_write, ring_size=args.ring_size)
