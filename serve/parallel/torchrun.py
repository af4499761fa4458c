"""Join a ``torchrun`` job: the same rank code as the local launcher (:mod:`serve.parallel.launch`), with ranks
started by torchrun on one machine or several.

:func:`torchrun_env` checks torchrun's standard ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
variables before any socket opens; :func:`init_from_env` then forms the process group from them
(``init_method="env://"``).
"""
from __future__ import annotations

import datetime
import os
from typing import NamedTuple

import torch.distributed as dist

from serve.parallel.launch import check_backend, check_timeout


class TorchrunEnv(NamedTuple):
    """The rendezvous torchrun describes: rank in [0, world_size), master address and port."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int


def torchrun_env(environ=None) -> TorchrunEnv:
    """Read and check torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
    (``environ`` defaults to ``os.environ``) before any socket opens.

    Raises ValueError naming the variable: missing, not an int, ``RANK`` outside [0, ``WORLD_SIZE``),
    a port outside [1, 65535] or an empty address (torch would fail later with a traceback, or wait
    for its timeout)."""
    env = os.environ if environ is None else environ
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in env]
    if missing:
        raise ValueError(f"not under torchrun: environment variables {missing} are not set")

    def as_int(var: str, lo: int, hi: int) -> int:
        raw = env[var]
        try:
            val = int(raw.strip())
        except ValueError:
            val = None
        if val is None or not lo <= val <= hi:
            raise ValueError(f"environment variable {var} must be an int in [{lo}, {hi}], got {raw!r}")
        return val

    world = as_int("WORLD_SIZE", 1, 2 ** 31 - 1)
    rank = as_int("RANK", 0, world - 1)
    port = as_int("MASTER_PORT", 1, 65535)
    if not env["MASTER_ADDR"].strip():
        raise ValueError("environment variable MASTER_ADDR must name the rank-0 host, got ''")
    return TorchrunEnv(rank, world, env["MASTER_ADDR"], port)


def init_from_env(backend: str = "gloo", timeout_s: float = 300.0) -> tuple[int, int]:
    """Join the process group described by torchrun's env vars. Returns (rank, world_size).

    Raises:
        ValueError: if the env vars are missing or malformed (:func:`torchrun_env`), the backend is
        unusable or the timeout is out of range.
        torch.distributed.DistError (a RuntimeError): the group did not form within ``timeout_s``
        (a peer never came, or the master is unreachable).
    """
    torchrun_env()
    check_backend(backend)
    check_timeout("timeout_s", timeout_s)
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
