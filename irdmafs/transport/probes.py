"""Liveness probes answered ahead of queued work (docs/design.md, P1-P4).

A serving process publishes what it would answer a heartbeat on its ``StatusBoard`` ahead of
time; a *probe* (a CALL whose header carries ``imm = protocol.CALL_PROBE``) is answered with that
copy, while it is valid, by whatever reads the frame: the native engine's I/O thread (no Python
runs for it) or the Python responder's reader (no task of its own, and its answer goes out ahead
of every frame queued on that socket). A busy node's hundreds of calls therefore never stand
between a mount and the proof that the node lives.

A copy is valid for ``valid_for`` seconds from its publishing (measured on CLOCK_MONOTONIC, by
the engine too): a process that stopped, was paused or starved for longer finds its copy
invalid when it runs again, and its probes go the ordinary way, as calls whose handler checks the
process first (``Serving.check_stall``). ``withdraw`` invalidates it at once (a fence).

The probe's own document (its sender, its owner's staging lease) reaches the process after the
answer, through ``heard(document)``; the answer never depends on it, so both engines answer
alike whatever it holds.

Concurrency: one trio thread publishes and hears; the engine's I/O thread reads its own copy of
the document (``publish`` hands it over under the engine's lock).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from . import protocol as P
from ..errors import ProtocolError

log = logging.getLogger(__name__)

PROBE_METHOD = "heartbeat"  # the call a probe stands for, answered the ordinary way when no copy is valid


class StatusBoard:
    """The copy of a heartbeat's answer that probes get, and who else must have it."""

    def __init__(self, heard: Callable[[str, dict], None]) -> None:
        """``heard(method, args)``: a probe answered from the board, for what it says of its
        sender (called on the trio thread, after the answer left)."""
        self.heard_cb = heard
        self._doc: bytes | None = None
        self._until = 0.0  # time.monotonic() past which the copy is invalid
        self._engines: list[Callable[[bytes, float], None]] = []
        self.answered = 0  # probes answered from a copy on the Python side (the engine counts its own)

    def attach(self, publish: Callable[[bytes, float], None]) -> None:
        """An engine that answers probes itself: it gets every copy (and every withdrawal, as
        a copy valid for 0 s) from now on, the current one first."""
        self._engines.append(publish)
        if self._doc is not None:
            publish(self._doc, max(0.0, self._until - time.monotonic()))

    def publish(self, status: dict, valid_for: float) -> None:
        """Probes are answered ``status`` for the next ``valid_for`` seconds (0: not at all)."""
        self._doc = P.encode_result(status)
        if len(self._doc) > P.MAX_CONTROL:
            raise ValueError(f"a status of {len(self._doc)} bytes is larger than a control document")
        valid_for = max(0.0, valid_for)
        self._until = time.monotonic() + valid_for
        for publish in self._engines:
            publish(self._doc, valid_for)

    def withdraw(self) -> None:
        """No copy is valid from now on, until the next ``publish``."""
        self._until = 0.0
        for publish in self._engines:
            publish(self._doc or b"{}", 0.0)

    def answer(self) -> bytes | None:
        """The copy a probe gets now, or None: it goes the ordinary way."""
        if self._doc is None or time.monotonic() >= self._until:
            return None
        self.answered += 1
        return self._doc

    def heard(self, document: bytes | memoryview) -> None:
        """A probe's document, after its answer: passed on as (method, args); a malformed one
        is logged and dropped (its answer was the status, which never depended on it)."""
        try:
            method, args = P.decode_call(document)
        except ProtocolError as exc:
            log.warning("a probe's document dropped: %s", exc)
            return
        if method != PROBE_METHOD:
            log.warning("a call %r flagged as a probe was answered as a %s", method, PROBE_METHOD)
        try:
            self.heard_cb(method, args)
        except Exception:  # runs in the engine's pump or a connection's reader: never theirs to end
            log.exception("a probe's document: its handler failed")
