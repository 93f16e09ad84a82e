"""Every error that crosses a module of irdmafs, in one place: what each layer raises and what its
callers catch. Pure: no I/O, no transport, no trio; any module may import it.

The hierarchy callers catch is the transport's: ``TransportError`` is the base of everything a call
or a one-sided operation on a peer can raise, ``RemoteError`` (an errno name answered by the
serving side) among them, and the cluster runtime's own failures are ``TransportError``s too
(``NodeDown``, ``TornRead``, ``Unavailable``), so one ``except TransportError`` covers a call
however it failed. Beside it: the file system's ``FsError(errno)``, the coordination service's
errors, and the ``ValueError``s of the pure parsers (config, policies, ``.npy``, safetensors).
The modules that raise them import them from here and keep them as attributes
(``transport.base.RemoteError``, ``formats.NpyError``): both names are the same class.
"""

from __future__ import annotations

import builtins
import os

# -- transport (transport/): a call or a one-sided operation on a peer -----------------------------


class TransportError(Exception):
    """Base of everything a transport raises."""


class ConnectError(TransportError):
    """The peer could not be reached or the handshake failed."""


class AuthError(ConnectError):
    """The cluster token was refused (by either side)."""


class PeerLost(TransportError):
    """The connection died while operations were in flight."""


class TimeoutError(TransportError, builtins.TimeoutError):  # noqa: A001 - the design's name
    """An operation did not complete within its deadline."""


class AccessError(TransportError):
    """Bad rkey, range outside the region, or an access the region does not grant."""


class StaleKey(AccessError):
    """A key cached from an earlier incarnation of the peer (it restarted since): refresh it.
    Raised before anything is sent, so a recycled key can never reach a region it did not name."""


class ProtocolError(TransportError):
    """A frame that is not valid irdmafs wire protocol."""


class RemoteError(TransportError):
    """A control call failed on the serving side; ``code`` is an errno name such as ENOENT."""

    def __init__(self, code: str, message: str = ""):
        super().__init__(f"{code}: {message}" if message else code)
        self.code = code
        self.message = message


# -- the cluster runtime (runtime/): one process's view of the nodes ------------------------------


class NodeDown(TransportError):
    """A node could not be reached; it has been marked down."""

    def __init__(self, node: str, why: str):
        super().__init__(f"node {node} is down: {why}")
        self.node = node


class TornRead(TransportError):
    """A stripe kept changing under a reader for every retry."""


class Unavailable(TransportError):
    """No live replica could serve a stripe (the file system answers EIO)."""


class Unsent(Exception):
    """The batch carrying this item was cut off by its sender's cancellation: it may or may not
    have reached its destination (runtime/batching.py)."""


# -- the file system (fs/) ------------------------------------------------------------------------


class FsError(Exception):
    """The one error the file system layers raise: an errno for the kernel (fs/errnos.py maps
    everything else that escapes them)."""

    def __init__(self, errno_: int, message: str = ""):
        super().__init__(message or os.strerror(errno_))
        self.errno = errno_


# -- the coordination service (coord/) ------------------------------------------------------------


class CoordError(Exception):
    """The coordination service refused a request (its message says why)."""


class CoordUnavailable(CoordError):
    """The coordination service could not be reached in time (``coord.contract.Unavailable``)."""


class LeaseGone(CoordError):
    """The lease named has ended (expired or revoked)."""


# -- the pure parsers: config, policies, file formats ---------------------------------------------


class ConfigError(Exception):
    """A cluster config (TOML) that is not valid; the message names the field."""


class PolicyError(ValueError):
    """A policy attribute's value that is not one of its accepted forms."""


class OptimError(PolicyError):
    """An optimizer string that is not one of the accepted forms."""


class CompressError(PolicyError):
    """A compression string that is not one of the accepted forms."""


class NpyError(ValueError):
    """Not a valid .npy header."""


class SafetensorsError(ValueError):
    """Not a valid safetensors file."""
