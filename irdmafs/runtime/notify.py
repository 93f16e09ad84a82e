"""systemd's readiness protocol (sd_notify) without a dependency: one datagram to $NOTIFY_SOCKET.

A unit with ``Type=notify`` starts the process with NOTIFY_SOCKET set; ``notify("READY=1")``
tells systemd the service is up. Without NOTIFY_SOCKET (not under systemd) it does nothing.
"""

from __future__ import annotations

import os
import socket


def notify(message: str) -> bool:
    """Send ``message`` (e.g. "READY=1\\nSTATUS=serving") to systemd; True if it was sent."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):  # an abstract socket
        path = "\0" + path[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.connect(path)
            s.sendall(message.encode())
        except OSError:
            return False
    return True
