"""RawInputRing: roll back a KDA state by caching raw layer inputs in a ring buffer and replaying.

Instead of writing a state per draft token, keep the *raw inputs* of recent tokens — one hidden vector
x ``[d]`` per token per KDA layer, the layer input after its pre-norm — in a fixed ring, and rebuild any
state on demand by re-projecting x and replaying the recurrence from a written-back checkpoint. The
ring trades memory (``d s`` per token, versus ``H K V s`` for a snapshot) for recompute at commit.

This is not ReplaySSM. ReplaySSM (vLLM RFC #46187; :mod:`serve.spec_decode.replay_ssm`) caches
*post-projection* per-step records — for KDA k, u = beta (v - S'^T k) and the per-channel gate g — and
replays only the recurrence; this ring stores the layer input *before* the projections and re-projects
at commit. Both keep a checkpoint plus a ring.

Ring layout (absolute counters; slot = counter mod capacity):

| range | slots hold |
|---|---|
| ``[head, commit_end)`` | committed tokens since the last write-back (the checkpoint is the state before ``head``) |
| ``[commit_end, tail)`` | the pending verify tokens (1 + n), within the rollback window |
| the rest | free |

Overflow, never a silent overwrite of a live slot:
- a verify of ``1 + n > window`` tokens raises ``ValueError`` (the draft is longer than the window);
- a verify that does not fit the free slots first forces a **write-back**: the current committed
  caches become the checkpoint and the committed slots are freed (``forced_commit`` is set).
"""
from __future__ import annotations

import torch

from kda_core.layer import KDAAux, KDACache, KDALayer
from kda_core.model import HybridCache, HybridLM
from serve.spec_decode.rollback import LayerShape, RollbackStrategy, raw_input_bytes_per_token


def replay_inputs(layer: KDALayer, cache: KDACache, x: torch.Tensor) -> KDACache:
    """Cache of ``layer`` after feeding inputs ``x [1, m, d]`` (fp32) from ``cache``: re-project, then replay.

    The layer's own ``forward(mode="recurrent")``, so bitwise equal to the verify that consumed the same x: the
    projections are row-invariant and the same per-token step runs (:mod:`kda_core.decode`)."""
    with torch.no_grad():
        return layer(x, cache, mode="recurrent").cache


class RawInputRing(RollbackStrategy):
    """Ring of ``capacity`` token slots, each ``[num_kda_layers, d]`` (store dtype), one request.

    Args:
        capacity: slots in the ring (tokens). window: the rollback window, the most verify tokens
            (``1 + n``) one step may hold pending; ``1 <= window <= capacity``. store_dtype: slot dtype.

    Raises:
        ValueError: bad capacity/window; (at record) a draft longer than the window, caches that are
        not at the ring's committed position, or a different model than the one the ring serves.
    """

    name = "raw-input ring"

    def __init__(self, capacity: int, window: int, store_dtype: torch.dtype = torch.float32):
        super().__init__(store_dtype)
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1 (slots), got {capacity!r}")
        if not isinstance(window, int) or not 1 <= window <= capacity:
            raise ValueError(f"window must be an int in [1, capacity = {capacity}], got {window!r}")
        self.capacity, self.window = capacity, window
        self.head = self.commit_end = self.tail = 0        # absolute counters
        self.num_write_backs = 0
        self._slots: torch.Tensor | None = None             # [capacity, num_kda_layers, d]
        self._positions = [-1] * capacity                   # token position per slot, -1 = free
        self._ring_model: HybridLM | None = None
        self._checkpoint: dict[int, KDACache] = {}          # KDA caches before token `head`
        self._checkpoint_position = 0
        self._committed: dict[int, KDACache] = {}           # KDA caches after token `commit_end` - 1

    @classmethod
    def bytes_per_token(cls, shape: LayerShape, elem_bytes: int) -> int:
        return raw_input_bytes_per_token(shape, elem_bytes)

    def slot(self, counter: int) -> int:
        return counter % self.capacity

    @property
    def num_free(self) -> int:
        return self.capacity - (self.tail - self.head)

    def _kda_index(self, index: int) -> int:
        return self._ring_model.kda_layers.index(index)

    def _begin(self, model: HybridLM, base: HybridCache, num_tokens: int) -> None:
        self.forced_commit = False
        if num_tokens > self.window:
            raise ValueError(f"a draft of {num_tokens - 1} tokens needs {num_tokens} pending slots, more than "
                             f"the rollback window of {self.window}: draft at most {self.window - 1} tokens")
        if self._ring_model is not None and model is not self._ring_model:
            raise ValueError("this ring serves another model: use one RawInputRing per request and model")
        committed_position = self._checkpoint_position + (self.commit_end - self.head)
        if self.commit_end > self.head and base.num_tokens != committed_position:
            raise ValueError(f"base caches hold {base.num_tokens} tokens but the ring is committed up to "
                             f"{committed_position}: the caches must be the ones the last commit returned")
        if self._slots is None:
            cfg = model.cfg
            self._ring_model = model
            self._slots = torch.full((self.capacity, cfg.num_kda_layers, cfg.hidden_size), float("nan"),
                                     dtype=self.store_dtype)      # never-written slots fail loudly
        if num_tokens > self.num_free or self.commit_end == self.head:
            if self.commit_end > self.head:                # ring full: write the state back, free history
                self.forced_commit = True
                self.num_write_backs += 1
            for c in range(self.head, self.commit_end):
                self._positions[self.slot(c)] = -1
            self.head = self.commit_end
            self._checkpoint = {i: base.layers[i] for i in model.kda_layers}
            self._checkpoint_position = base.num_tokens
        for t in range(num_tokens):                        # reserve the pending slots
            self._positions[self.slot(self.tail + t)] = base.num_tokens + t
        self.tail += num_tokens

    def _pending_slots(self, start: int, stop: int) -> torch.Tensor:
        """Slot indices of pending verify tokens ``[start, stop)`` (relative to the verify)."""
        return torch.tensor([self.slot(self.commit_end + t) for t in range(start, stop)], dtype=torch.long)

    def _record_layer(self, index: int, layer: KDALayer, base: KDACache, aux: KDAAux) -> None:
        self._slots[self._pending_slots(0, self._num_tokens), self._kda_index(index)] = \
            aux.x[0].to(self.store_dtype)                                     # [T, d] into T slots

    def _commit_layer(self, index: int, layer: KDALayer, base: KDACache, num_tokens: int) -> KDACache:
        x = self._slots[self._pending_slots(0, num_tokens), self._kda_index(index)]  # [m, d]
        return replay_inputs(layer, base, x.unsqueeze(0).to(torch.float32))

    def commit(self, num_accepted: int) -> HybridCache:
        cache = super().commit(num_accepted)
        self._committed = {i: cache.layers[i] for i in self._ring_model.kda_layers}
        return cache

    def _finish(self, num_committed: int) -> None:
        self.commit_end += num_committed                   # accepted slots join the committed history
        super()._finish(num_committed)

    def _release(self) -> None:
        for c in range(self.commit_end, self.tail):        # rejected (or discarded) pending slots
            self._positions[self.slot(c)] = -1
        self.tail = self.commit_end

    def _buffers(self) -> list[torch.Tensor]:
        return [] if self._slots is None else [self._slots]

    def expected_nbytes(self) -> int:
        """The whole ring is allocated at first use: ``capacity x num_kda_layers x d s``."""
        if self._slots is None:
            return 0
        shape = LayerShape.from_config(self._ring_model.cfg)
        return self.capacity * self._ring_model.cfg.num_kda_layers * self.bytes_per_token(shape, self.elem_bytes())

    def poison(self, from_token: int) -> None:
        if not self.recording or not 1 <= from_token <= self._num_tokens:
            raise ValueError(f"from_token must be in [1, T = {self._num_tokens}] of a recorded verify, got {from_token}")
        self._slots[self._pending_slots(from_token, self._num_tokens)] = float("nan")
        self._valid_tokens = from_token

    def rebuild(self) -> dict[int, KDACache]:
        """KDA caches at ``commit_end`` rebuilt from the checkpoint by replaying the committed slots
        (re-project, then replay). ``{}`` before the first commit."""
        if self._ring_model is None:
            return {}
        if self.commit_end == self.head:
            return dict(self._checkpoint)
        idx = torch.tensor([self.slot(c) for c in range(self.head, self.commit_end)], dtype=torch.long)
        out = {}
        for i in self._ring_model.kda_layers:
            x = self._slots[idx, self._kda_index(i)].unsqueeze(0).to(torch.float32)   # [1, m, d]
            out[i] = replay_inputs(self._ring_model.mixers[i], self._checkpoint[i], x)
        return out

    def slot_table(self) -> list[dict]:
        """One row per slot: slot, status (free / committed / pending), counter (the ring's absolute token counter
        whose slot it is, slot = counter mod capacity; -1 when free), token position (in the sequence; -1 when free),
        head/tail marks."""
        rows = []
        for s in range(self.capacity):
            c = next((c for c in range(self.head, self.tail) if self.slot(c) == s), None)
            status = "free" if c is None else ("committed" if c < self.commit_end else "pending")
            rows.append({"slot": s, "status": status, "counter": -1 if c is None else c, "position": self._positions[s],
                         "head": s == self.slot(self.head) and self.tail > self.head,
                         "tail": s == self.slot(self.tail)})
        return rows

    def check_integrity(self) -> None:
        """Counters ordered; slot positions consistent; pending within the window; and the committed
        caches equal a bitwise rebuild from the checkpoint and the ring."""
        super().check_integrity()
        assert 0 <= self.head <= self.commit_end <= self.tail, "ring counters out of order"
        assert self.tail - self.head <= self.capacity, "ring holds more tokens than slots"
        assert self.tail - self.commit_end <= self.window, "pending tokens exceed the window"
        assert self.recording or self.tail == self.commit_end, "pending slots without a recorded verify"
        live = {self.slot(c): self._checkpoint_position + (c - self.head) for c in range(self.head, self.tail)}
        for s in range(self.capacity):
            assert self._positions[s] == live.get(s, -1), f"slot {s}: position {self._positions[s]} is stale"
        if self._committed and self.commit_end > self.head:
            rebuilt = self.rebuild()
            for i, c in self._committed.items():
                assert torch.equal(rebuilt[i].recurrent, c.recurrent) and torch.equal(rebuilt[i].conv, c.conv), \
                    f"layer {i}: committed state differs from its rebuild from the checkpoint"
