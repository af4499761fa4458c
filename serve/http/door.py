"""Deadlines and limits at the door: how long a client may take to send a request, how many may be connected.

uvicorn gives a keep-alive timeout (``timeout_keep_alive``: an idle connection between requests is closed), a cap on
concurrency (``limit_concurrency``: a request that arrives while that many connections or tasks are open gets 503)
and h11's cap on a request head (``h11_max_incomplete_event_size``), but no deadline on reading a request: a client
that opens a connection and sends nothing, sends its headers a byte at a time or stops half-way through its body
holds the connection (and its socket) for ever: the slow-loris attack, which nginx bounds with
``client_header_timeout`` and ``client_body_timeout`` and Apache with ``mod_reqtimeout``. :class:`DeadlineProtocol`
is uvicorn's h11 protocol with those two deadlines, both total (a byte now and then does not reset them, as it would
a deadline per read):

- the head (request line and headers) must be complete ``header_timeout_s`` after the connection opens, or, on a
  kept-alive connection, after the first byte of the next request (until that byte uvicorn's keep-alive timeout
  bounds the idle time);
- the body must be complete ``body_timeout_s`` after its head.

Past a deadline the connection is closed, with ``408 Request Timeout`` first if the client had started a request
and no response has begun (a connection that sent nothing is closed silently, as a keep-alive timeout closes it).
Once a request has been read, nothing times out: a streamed response may take as long as it needs.
:meth:`DoorLimits.uvicorn_config` builds the uvicorn config with all of it (``python -m serve.http`` and
:func:`serve.http.background.serve_in_thread` both use it).
"""
from __future__ import annotations

import asyncio
import functools
import math
from dataclasses import dataclass

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from serve.errors import check_int, check_positive

REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                   b"content-length: %d\r\n\r\n%s")


@dataclass(frozen=True)
class DoorLimits:
    """``header_timeout_s`` / ``body_timeout_s``: the read deadlines of :class:`DeadlineProtocol` (s); ``keep_alive_s``:
    an idle connection between requests is closed after this (uvicorn's ``timeout_keep_alive``; s);
    ``max_connections``: a request arriving while this many connections (or request tasks) are open gets 503
    (uvicorn's ``limit_concurrency``; None: no cap); ``max_header_bytes``: the largest request head (h11's
    ``max_incomplete_event_size``; a larger one gets 400). Raises ValueError naming the field for a value that is
    not positive and finite (or not an int where one is needed)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int | None = None
    max_header_bytes: int = 16 * 1024

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not math.isfinite(check_positive(name, getattr(self, name))):
                raise ValueError(f"{name} must be a finite number of seconds, got {getattr(self, name)!r}")
        if self.max_connections is not None:
            check_int("max_connections", self.max_connections)
        check_int("max_header_bytes", self.max_header_bytes)

    def uvicorn_config(self, app, **kwargs) -> uvicorn.Config:
        """A ``uvicorn.Config`` for ``app`` with these limits (``kwargs``: host, port, log_level, ...)."""
        return uvicorn.Config(app, http=functools.partial(DeadlineProtocol, limits=self),
                              timeout_keep_alive=self.keep_alive_s, limit_concurrency=self.max_connections,
                              h11_max_incomplete_event_size=self.max_header_bytes, **kwargs)


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with the header and body read deadlines of ``limits`` (:class:`DoorLimits`). The phase
    comes from h11's view of the client (``their_state``): IDLE (waiting for a head), SEND_BODY (the body), or done."""

    def __init__(self, *args, limits: DoorLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._phase: str | None = None                       # "head", "body" or None (nothing being read)
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm("head")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def _track(self) -> None:
        """Arm the deadline of the phase the client is in (a new deadline only when the phase changes): a body being
        sent; a head being sent (a fresh connection, or bytes of the next request on a kept-alive one); else none."""
        state, buffered = self.conn.their_state, bool(self.conn.trailing_data[0])
        if state is h11.SEND_BODY:
            self._arm("body")
        elif state is h11.IDLE and (self._phase == "head" or buffered):
            self._arm("head")
        else:                                                # read in full, or idle between requests
            self._arm(None)

    def _arm(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
        self._phase, self._deadline = phase, None
        if phase is not None:
            delay = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
            self._deadline = self.loop.call_later(delay, self._expired, phase)

    def _expired(self, phase: str) -> None:
        """Close the connection; with a 408 if the client has started a request and no response has begun."""
        self._deadline = None
        if self.transport.is_closing():
            return
        started = bool(self.conn.trailing_data[0]) if phase == "head" else not (
            self.cycle is not None and self.cycle.response_started)
        if started:
            limit = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
            msg = f"the request's {'headers' if phase == 'head' else 'body'} did not arrive within {limit:g} s".encode()
            self.transport.write(REQUEST_TIMEOUT % (len(msg), msg))
        self.transport.close()
