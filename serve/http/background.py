"""``serve_in_thread``: run an app on 127.0.0.1 (a free port) in a background thread of this process, for
tests and the in-process bench."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from serve.http.door import DoorLimits


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", start_timeout_s: float = 30.0, limits: DoorLimits | None = None):
    """Yield the base URL (``http://127.0.0.1:<port>``) of ``app`` served by uvicorn in a daemon thread, with the
    deadlines and limits of ``limits`` (:class:`serve.http.door.DoorLimits`; None: its defaults); the server (and
    with it the app's engine loop) stops on exit. Raises RuntimeError if it does not start."""
    sock = socket.socket()
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    limits = DoorLimits() if limits is None else limits
    server = uvicorn.Server(limits.uvicorn_config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
