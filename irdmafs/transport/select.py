"""Pick a transport from an ordered preference list, saying in one log line which and why."""

from __future__ import annotations

import logging

from .base import Transport

log = logging.getLogger(__name__)


def choose(preference: list[str], token: bytes, *, op_timeout: float = 30.0) -> Transport:
    reasons = []
    for name in preference:
        if name == "verbs":
            from . import verbs

            why = verbs.unusable_reason()
            if why:
                reasons.append(f"verbs: {why}")
                continue
            log.info("transport: verbs (device %s)", verbs.first_active_device())
            return verbs.VerbsTransport(token, op_timeout=op_timeout)
        if name == "shm":
            from .shm import ShmTransport, shm_unusable_reason

            why = shm_unusable_reason()
            if why:
                reasons.append(f"shm: {why}")
                continue
            log.info("transport: shm (shared memory with the nodes on this host, tcp to the others)%s", f" ({'; '.join(reasons)})" if reasons else "")
            return ShmTransport(token, op_timeout=op_timeout)
        if name == "tcp":
            from .tcp import TcpTransport

            log.info("transport: tcp%s", f" ({'; '.join(reasons)})" if reasons else " (first choice)")
            return TcpTransport(token, op_timeout=op_timeout)
        if name == "memory":
            from .memory import MemoryTransport

            log.info("transport: memory (in-process, tests only)")
            return MemoryTransport(token)
        reasons.append(f"{name}: unknown transport")
    raise ValueError("no usable transport: " + "; ".join(reasons))
