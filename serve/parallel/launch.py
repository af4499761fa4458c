"""Start real ``torch.distributed`` ranks on this machine (the local launcher).

:func:`run_ranks` starts ``world_size`` processes with ``torch.multiprocessing`` (start method
``spawn`` by default; ``forkserver`` forks each rank from a server that has already imported torch,
which makes a start ~0.1 s instead of ~1-4 s, but that server, ~220 MiB RSS with torch loaded, stays
for the caller's lifetime; ``fork`` forks the ranks from the caller itself, so they share its
already-loaded pages copy-on-write and nothing stays behind: what the app uses. ``fork`` from a
multi-threaded caller such as a Streamlit server is safe here because a rank touches only torch
with one intra-op thread (no OpenMP pool to inherit), gloo over fresh sockets, and the result
queue; a rank that hangs anyway is stopped at the deadline.) Calls in one process run one at a
time (a lock): ranks of concurrent calls would share the same cores and add up in memory. Ranks meet over TCP on
127.0.0.1 at a free port (c10d's store listens there only: :func:`local_store`), with the gloo backend (nccl selectable when CUDA is present) and a timeout
on every collective. Every rank sends back one picklable result (tensors converted to numpy so
nothing depends on shared memory outliving the rank). If any rank raises, exits or the run passes
its deadline, the remaining ranks are terminated (then killed) and joined, and a ``RuntimeError``
(``TimeoutError``) names the rank and its error. No rank process outlives the call.

The ``torchrun`` path (ranks started by torchrun, on one machine or several) is
:mod:`serve.parallel.torchrun`; it shares :data:`BACKENDS` and the checks :func:`check_backend` and
:func:`check_timeout` with this launcher.
"""
from __future__ import annotations

import contextlib
import datetime
import pickle
import queue
import socket
import sys
import threading
import time
import traceback
import types
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from serve.errors import check_choice, check_int, check_positive
from serve.process_memory import release_freed_memory

BACKENDS = ("gloo", "nccl")
START_METHODS = ("spawn", "forkserver", "fork")
POLL_S = 0.02          # how often the parent checks for results / dead ranks
FAILURE_SETTLE_S = 0.5 # after a first failure, how long the other ranks get to report theirs
KILL_GRACE_S = 2.0     # after terminate(), wait this long before kill()
RANK_TIMEOUT_SLACK_S = 10.0  # collectives inside ranks time out later than the parent's deadline,
                             # so the parent (which stops every rank) always decides first
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: longer deadlines (inf included) overflow torch's collective timeout
                                 # (a datetime.timedelta turned into milliseconds in the ranks)
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "serve.parallel.run"]
_LOCAL_RUNS = threading.Lock()   # one local multi-process run at a time in this process


class _RunError(Exception):
    """A failed run's error, with ``pids``: the run's rank processes (all stopped and joined)."""

    def __init__(self, message: str, pids: list[int]):
        super().__init__(message)
        self.pids = pids


class RankFailure(_RunError, RuntimeError):
    """A rank raised or died (a RuntimeError with the run's ``pids``)."""


class RankTimeout(_RunError, TimeoutError):
    """The run passed its deadline (a TimeoutError with the run's ``pids``)."""


class RanksOutput(NamedTuple):
    """results: one value per rank (index = rank); pids: the rank processes (all joined on return)."""

    results: list
    pids: list[int]


def check_timeout(name: str, val) -> float:
    """``val`` if it is a number of seconds in (0, :data:`MAX_TIMEOUT_S`]; else ValueError naming ``name``
    (``inf`` and NaN included: a rank's collective timeout is a ``datetime.timedelta`` and overflows)."""
    check_positive(name, val)
    if not val <= MAX_TIMEOUT_S:
        raise ValueError(f"{name} must be at most {MAX_TIMEOUT_S:g} s (a week), got {val!r}")
    return val


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_backend(backend: str) -> None:
    """Raise ValueError unless ``backend`` is usable here (nccl needs CUDA)."""
    check_choice("backend", backend, BACKENDS)
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which this machine does not have; use 'gloo'")


def _map_leaves(value: Any, leaf_type: type, fn) -> Any:
    """Apply ``fn`` to every ``leaf_type`` inside NamedTuples, tuples, lists and dicts."""
    if isinstance(value, leaf_type):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map_leaves(v, leaf_type, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_leaves(v, leaf_type, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_leaves(v, leaf_type, fn) for k, v in value.items()}
    return value


def to_host(value: Any) -> Any:
    """Tensors -> numpy arrays, recursively (so results pickle by value, not via shared memory)."""
    return _map_leaves(value, torch.Tensor, lambda t: t.detach().cpu().numpy())


def from_host(value: Any) -> Any:
    """Inverse of :func:`to_host`: numpy arrays -> tensors."""
    return _map_leaves(value, np.ndarray, torch.from_numpy)


def local_store(host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The ranks' c10d key-value store at ``host:port``: rank 0 serves it, the others connect. torch's ``TCPStore``
    server listens on every interface whatever ``host`` says (it uses ``host`` only to connect), so rank 0 binds
    the listening socket to ``host`` itself and hands it over (``master_listen_fd``). Raises OSError if rank 0
    cannot bind ``host:port``, torch.distributed.DistError if the store does not form within ``timeout``."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.detach())  # the store owns it


def _rank_main(rank, fn, world_size, port, backend, timeout_s, threads, args, results):
    """Entry point of one rank process (``torch.multiprocessing`` passes ``rank`` first)."""
    torch.set_num_threads(threads)
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=local_store("127.0.0.1", port, rank, world_size, timeout), rank=rank,
                                world_size=world_size, timeout=timeout)
        out = fn(rank, world_size, *args)
        try:  # pickle here, not in the queue's feeder thread, whose errors never reach the parent
            payload = pickle.dumps(to_host(out), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(f"the rank's result ({type(out).__name__}) cannot be pickled to send it back: "
                            f"{type(exc).__name__}: {exc}") from exc
        results.put((rank, True, payload))
    except BaseException as exc:  # report every failure to the parent, then exit non-zero
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from exc
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _failure_message(procs, results: dict, errors: dict) -> str:
    """Ranks that died without a report first (usually the cause), then reported errors in arrival
    order; the first one with its traceback, the others by their first line."""
    n = len(procs)
    parts = [f"rank {i} of {n} exited with code {p.exitcode} without reporting a result"
             for i, p in enumerate(procs) if i not in results and i not in errors and p.exitcode is not None]
    parts += [f"rank {i} of {n} failed: {msg}" for i, msg in errors.items()]
    if not parts:
        return f"ranks {[i for i in range(n) if i not in results]} of {n} stopped without a result"
    return parts[0] + "".join(f"\nalso {p.splitlines()[0]}" for p in parts[1:])


@contextlib.contextmanager
def _main_module_hidden():
    """Start ranks without re-running ``__main__`` in them.

    spawn and forkserver children re-import the parent's ``__main__`` file before unpickling their
    target. Under Streamlit (and its AppTest) ``__main__`` is the page script being run, so every
    rank would run the page again. Rank functions live in importable modules, never in ``__main__``,
    so a bare module stands in while the processes start (Streamlit swaps ``__main__`` the same way).
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _stop(processes) -> None:
    """Terminate, then kill, then join every process still alive."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + KILL_GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def run_ranks(fn, world_size: int, args: tuple = (), *, timeout_s: float = 120.0, backend: str = "gloo",
              start_method: str = "spawn", threads_per_rank: int = 1) -> RanksOutput:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes with a process group.

    Args:
        fn: a module-level function of an importable module (not ``__main__``); its return value
            must be picklable (a rank whose result is not fails the run with the pickling error).
        world_size: number of ranks (>= 1); not capped by the cores here (tests oversubscribe on
            purpose; the command line refuses more ranks than cores unless --oversubscribe, and page 10
            offers at most min(4, cores)).
        timeout_s: deadline for the whole run, in (0, :data:`MAX_TIMEOUT_S`] s (the collective timeout
            inside the ranks is a little longer, so the parent always decides).
        backend: "gloo" (or "nccl" with CUDA).
        start_method: "spawn", "forkserver" or "fork" (needs threads_per_rank = 1).
        threads_per_rank: torch intra-op threads per rank.

    Returns:
        :class:`RanksOutput` with each rank's result (numpy arrays turned back into tensors).

    Raises:
        ValueError: bad arguments (a ``timeout_s`` out of range; ``fn`` or ``args`` that spawn /
            forkserver cannot pickle, e.g. a lambda). RankFailure (a RuntimeError): a rank raised or
            died (the message names the rank and carries its traceback). RankTimeout (a TimeoutError):
            the run did not finish within ``timeout_s``.
    """
    check_int("world_size", world_size)
    check_timeout("timeout_s", timeout_s)
    check_choice("start_method", start_method, START_METHODS)
    check_int("threads_per_rank", threads_per_rank)
    check_backend(backend)
    if start_method == "fork" and threads_per_rank != 1:
        raise ValueError(f"start_method 'fork' needs threads_per_rank = 1 (a forked OpenMP pool can hang), "
                         f"got {threads_per_rank}")
    if start_method != "fork":       # spawn / forkserver pickle fn and args to each rank
        _check_picklable(fn, args, start_method)
    with _LOCAL_RUNS:
        try:
            return _run_ranks(fn, world_size, args, timeout_s, backend, start_method, threads_per_rank)
        finally:
            release_freed_memory()


def _check_picklable(fn, args: tuple, start_method: str) -> None:
    """Raise ValueError naming ``fn`` or ``args`` if it cannot be pickled (a lambda, a local function, a
    lock), which ``start_method`` needs to send it to the ranks; without the check the parent raised
    the pickler's own error from deep inside ``multiprocessing``."""
    if not callable(fn):
        raise ValueError(f"fn must be a function, got {type(fn).__name__}")
    for what, obj in (("fn", fn), ("args", args)):
        try:
            pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            hint = (" (a module-level function of an importable module, not a lambda or a nested function)"
                    if what == "fn" else "")
            raise ValueError(f"{what} must be picklable for start_method {start_method!r}{hint}; "
                             f"{getattr(fn, '__qualname__', fn) if what == 'fn' else 'args'}: "
                             f"{type(exc).__name__}: {exc}") from None


def _run_ranks(fn, world_size, args, timeout_s, backend, start_method, threads_per_rank) -> RanksOutput:
    mpctx = mp.get_context(start_method)
    if start_method == "forkserver":
        mpctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    results_q = mpctx.Queue()
    rank_args = (fn, world_size, free_port(), backend, timeout_s + RANK_TIMEOUT_SLACK_S, threads_per_rank, args,
                 results_q)
    with _main_module_hidden():
        ctx = mp.start_processes(_rank_main, args=rank_args, nprocs=world_size, join=False,
                                 start_method=start_method)
    procs = ctx.processes
    pids = [p.pid for p in procs]
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}                 # rank -> reported error, in arrival order
    deadline = time.monotonic() + timeout_s
    settle = None                               # after a first failure, let the others report briefly
    try:
        while len(results) + len(errors) < world_size and (settle is None or time.monotonic() < settle):
            try:
                rank, ok, payload = results_q.get(timeout=POLL_S)
                (results if ok else errors)[rank] = payload
            except queue.Empty:
                pass
            exited = any(p.exitcode is not None and i not in results for i, p in enumerate(procs))
            if settle is None and (errors or exited):
                settle = time.monotonic() + FAILURE_SETTLE_S
            if settle is None and time.monotonic() > deadline:
                waiting = [i for i in range(world_size) if i not in results]
                raise RankTimeout(f"distributed run did not finish within {timeout_s:g} s; ranks {waiting} "
                                  "had not reported (all ranks were stopped)", pids)
        if len(results) < world_size:
            raise RankFailure(_failure_message(procs, results, errors), pids)
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        _stop(procs)
        results_q.close()
        results_q.join_thread()
    return RanksOutput([from_host(pickle.loads(results[r])) for r in range(world_size)], pids)
