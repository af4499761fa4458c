"""How the suite reaches the engine in each setting (:class:`conformance.adapters.Variant`): a ``Target`` routes a
setting to a server (the base server with per-request fields, or a server started with the setting's flags) and
starts and stops servers.

- :class:`Attached`: a running engine at a URL; only the deployment itself and per-request settings;
- :class:`Launched`: the suite starts the engine from a command, once per start-up setting, on a free port of
  127.0.0.1 (``--host 127.0.0.1 --port N`` and the setting's flags appended), one server at a time (two GPU
  servers would not fit), and stops it (SIGTERM, then SIGKILL after ``stop_timeout_s``);
- :class:`InProcess`: our server started in this process from the same flags (:func:`conformance.ours.serve_in_process`).
"""
from __future__ import annotations

import abc
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from conformance.adapters import BASE, Adapter, Variant
from conformance.client import served_model


class StartError(RuntimeError):
    """The engine did not start with a setting's flags (its exit status or the timeout, and its log's tail)."""


class Target(abc.ABC):
    """The engine under test. ``adapter``: its :class:`Adapter`; ``description``: the URL or command."""

    adapter: Adapter
    description: str
    launch_args: list[str] | None = None        # the deployment's flags, when known (for the adapter's grid)
    can_launch = False                          # True: it starts servers with a setting's flags

    def route(self, variant: Variant) -> tuple[Variant, Callable[[], dict]] | str:
        """``(server setting, request fields)`` that serve ``variant``, or why it cannot be served. Prefers a
        per-request field on the base server (no extra start) to a server started with flags."""
        fields = self.adapter.variant_fields(variant)
        if fields is not None:
            return BASE, fields
        if self.can_launch and self.adapter.variant_args(variant) is not None:
            return variant, dict
        if self.adapter.variant_args(variant) is None:
            return f"{self.adapter.name} has no setting for {variant.name}"
        flags = " ".join(self.adapter.variant_args(variant))
        return (f"{self.adapter.name}'s {variant.name} is a start-up setting ({flags}): run the suite with --launch "
                "so that it starts the engine with it")

    @abc.abstractmethod
    def server(self, variant: Variant) -> contextlib.AbstractContextManager[tuple[str, str]]:
        """A context manager yielding ``(base_url, model)`` of a server in ``variant``; raises StartError if it does
        not start."""


class Attached(Target):
    """A running engine at ``base_url`` serving ``model``."""

    def __init__(self, adapter: Adapter, base_url: str, model: str):
        self.adapter, self.base_url, self.model = adapter, base_url.rstrip("/"), model
        self.description = self.base_url

    @contextlib.contextmanager
    def server(self, variant: Variant) -> Iterator[tuple[str, str]]:
        if variant != BASE:
            raise StartError(f"cannot start {variant.name}: the engine is attached, not launched")
        yield self.base_url, self.model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, alive: Callable[[], bool], timeout_s: float) -> None:
    """Poll ``url`` until it answers 200; raises StartError when ``alive()`` turns False or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise StartError("the engine exited before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise StartError(f"the engine was not ready within {timeout_s:.0f} s")


class Launched(Target):
    """The engine started by the suite: ``command`` (a shell-style string or a list, without host and port),
    ``model`` (None: the first id of ``/v1/models``), ``start_timeout_s`` to wait for ``/health``, ``log_dir``:
    where each setting's server log is kept as ``<setting>.log`` (None: discarded)."""

    can_launch = True

    def __init__(self, adapter: Adapter, command, model: str | None = None, start_timeout_s: float = 300.0,
                 stop_timeout_s: float = 15.0, log_dir: Path | None = None):
        self.adapter, self.log_dir = adapter, log_dir
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        if not self.command:
            raise ValueError("the launch command is empty")
        self.model, self.start_timeout_s, self.stop_timeout_s = model, start_timeout_s, stop_timeout_s
        self.description = shlex.join(self.command)
        self.launch_args = self.command[1:]

    @contextlib.contextmanager
    def server(self, variant: Variant) -> Iterator[tuple[str, str]]:
        port = free_port()
        argv = [*self.command, *self.adapter.always_args, *self.adapter.port_args(port),
                *self.adapter.variant_args(variant)]
        keep = self.log_dir is not None
        with (open(self.log_dir / f"{variant.name}.log", "w+") if keep else tempfile.TemporaryFile("w+")) as log:
            try:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as err:
                raise StartError(f"cannot run {shlex.join(argv)}: {err}") from None
            try:
                base = f"http://127.0.0.1:{port}"
                try:
                    wait_healthy(base + self.adapter.health_path, lambda: proc.poll() is None, self.start_timeout_s)
                except StartError as err:
                    log.seek(0)
                    tail = log.read()[-1500:]
                    raise StartError(f"{err} (exit status {proc.poll()}): {shlex.join(argv)}\n{tail}") from None
                yield base, self.model or served_model(base)
            finally:
                self._stop(proc)

    def _stop(self, proc: subprocess.Popen) -> None:
        """SIGTERM to the engine's process group (it may have children), SIGKILL after ``stop_timeout_s``."""
        if proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


class InProcess(Target):
    """Our server started in this process from ``args`` (the flags of ``python -m serve.http``), once per setting."""

    can_launch = True

    def __init__(self, adapter: Adapter, args: list[str]):
        self.adapter, self.launch_args = adapter, list(args)
        self.description = "in process: python -m serve.http " + shlex.join(self.launch_args)

    @contextlib.contextmanager
    def server(self, variant: Variant) -> Iterator[tuple[str, str]]:
        from conformance.ours import serve_in_process

        with contextlib.ExitStack() as stack:
            try:
                url, name = stack.enter_context(serve_in_process([*self.launch_args,
                                                                  *self.adapter.variant_args(variant)]))
            except (ValueError, RuntimeError) as err:
                raise StartError(str(err)) from None
            yield url, name
