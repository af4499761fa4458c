"""Memory a KCP rank needs, checked against the machine before any rank starts.

A rank holds its whole block of L tokens at once (inputs, the chunk preparation of every piece, the
chunk states and the outputs), so its memory grows linearly with L = ceil(T / W); a prompt too long for
the machine would grow for minutes before failing. :func:`rank_bytes` is an upper estimate
of the tensors one rank allocates; :func:`check_rank_memory` compares it, times the ranks on this
machine, with ``MemAvailable`` from ``/proc/meminfo``.

Per token of the block, with B batch, H heads, K / V head dims, C chunk size, s bytes per element
(4 fp32, 8 fp64):

  | term                                   | bytes per token                  |
  |----------------------------------------|----------------------------------|
  | inputs q, k, g, v, beta (made in fp64) | B H (3K + V + 1) (8 + s)         |
  | chunk preparation kept (qg, w, kd, u, Aqk) | B H (3K + V + C) s           |
  | preparation temporaries (one piece)    | B H (5K + 6C) s                  |
  | chunk states h, v_new, outputs o       | B H (K V / C + 2V) s             |
  | outputs kept per timed repeat          | B H V s (repeats - 1 times)      |
  | layer level: x and projections         | B 5 D 4                          |

plus, with ``check``, the single-rank reference over up to T tokens (inputs, outputs and chunk states
of T tokens; its kernel runs in ``kda_core.chunk.piece_tokens_for`` pieces, 256 tokens at H = 4, K = V = 128). Measured peak RSS of a rank here (fp32, H = 4,
K = V = 128): ~40 KB per token plus ~270 MB for torch itself, about 0.7x this estimate's 58 KB.
"""
from __future__ import annotations

import math
import os

from kda_core.chunk import piece_tokens_for

MEMINFO = "/proc/meminfo"
TORCH_BASE_BYTES = 300 * 2**20   # a rank process with torch imported (~270 MB measured)
FORK_OVERHEAD_BYTES = 32 * 2**20  # what a rank forked from a process with torch loaded copies on write


def rank_bytes(seq_len: int, world_size: int, batch: int, num_heads: int, head_k_dim: int, head_v_dim: int,
               elem_bytes: int, chunk_size: int, piece_tokens: int | None, repeats: int = 1, check: bool = False,
               hidden_size: int | None = None, base_bytes: int = TORCH_BASE_BYTES) -> int:
    """Upper estimate of the bytes the largest rank allocates (table in the module doc).
    ``hidden_size``: D at layer level, None at kernel level. ``base_bytes``: the process itself
    (:data:`TORCH_BASE_BYTES` for a fresh rank, :data:`FORK_OVERHEAD_BYTES` for one forked from the app)."""
    B, H, K, V, s, C = batch, num_heads, head_k_dim, head_v_dim, elem_bytes, chunk_size
    L = math.ceil(seq_len / world_size)                      # tokens of the largest block
    piece = L if piece_tokens is None else min(L, piece_tokens)
    inputs = B * H * (3 * K + V + 1) * (8 + s)               # per token
    kept = B * H * (3 * K + V + C) * s
    states = B * H * (K * V / C + 2 * V) * s
    temps = B * H * (5 * K + 6 * C) * s * piece               # one piece at a time
    extra = B * H * V * s * (repeats - 1)
    layer = 0 if hidden_size is None else B * 5 * hidden_size * 4
    total = L * (inputs + kept + states + extra + layer) + temps
    if check:                                                # reference over [0, end), end <= T
        total += seq_len * (inputs + states + layer) + B * H * (5 * K + 6 * C) * s * min(seq_len, piece_tokens_for(B, H, K, V, C))
    return base_bytes + int(total)


def available_bytes() -> int | None:
    """``MemAvailable`` of this machine in bytes, or None where ``/proc/meminfo`` does not exist."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024       # the file counts kB
    except OSError:
        return None
    return None


def local_ranks(world_size: int) -> int:
    """Ranks on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else all of them (local launch).
    Raises ValueError naming the variable if it is not an int in [1, ``world_size``]."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return world_size
    try:
        n = int(raw.strip())
    except ValueError:
        n = 0
    if not 1 <= n <= world_size:
        raise ValueError(f"environment variable LOCAL_WORLD_SIZE must be an int in [1, {world_size}] "
                         f"(the world size), got {raw!r}")
    return n


def check_rank_memory(need_per_rank: int, world_size: int, seq_len: int, available: int | None = None) -> None:
    """Raise ValueError if the ranks on this machine need more than its available memory.

    ``available`` defaults to :func:`available_bytes`; no check where it is unknown."""
    available = available_bytes() if available is None else available
    if available is None:
        return
    n = local_ranks(world_size)
    if need_per_rank * n > available:
        gib = 2**30
        raise ValueError(
            f"seq_len={seq_len:,} needs about {need_per_rank / gib:.1f} GiB per rank ({n} rank(s) on this machine: "
            f"{need_per_rank * n / gib:.1f} GiB) but only {available / gib:.1f} GiB is available; "
            f"lower seq_len (memory grows linearly with seq_len / world_size) or spread the ranks over machines")
