"""The one errno table: what turns anything escaping the file system layers into an errno
(``errno_for``): fs/ops.py answers the kernel with it, fs/door_server.py the workers of the
shared-memory door. The one error those layers raise, ``FsError(errno)``, is irdmafs/errors.py's
(kept here as an attribute). Its own module so that every fs module can use it without importing
vfs.py or pyfuse3."""

from __future__ import annotations

import collections
import errno
import logging
import time

import trio

from ..names import LAYOUT_CHANGED
from ..util import leaves
from ..errors import AccessError, FsError, NodeDown, RemoteError, TornRead, TransportError, Unavailable

log = logging.getLogger(__name__)


# The one errno table: errno names the cluster answers with, and what else may escape the VFS.
REMOTE_ERRNO = {
    name: getattr(errno, name)
    for name in (
        "ENOENT", "EEXIST", "ENOTDIR", "EISDIR", "ENOTEMPTY", "EINVAL", "ENAMETOOLONG", "EROFS",
        "ENOSPC", "ENODATA", "EPERM", "EACCES", "EBUSY", "E2BIG", "ETIMEDOUT", "EMLINK", "EAGAIN", "EXDEV",
    )
} | {LAYOUT_CHANGED: errno.ESTALE}  # a layout changed under a push or a write (server/buckets.py)


class Episode:
    """One log line per episode of an answer that comes many times in a row (ENOSPC: every
    write of a `dd` into a full cluster gets it): the first of an episode is logged with what
    the node said (what holds its memory); an episode ends after ``quiet`` seconds without it."""

    def __init__(self, quiet: float = 30.0):
        self.quiet = quiet
        self.last = -float("inf")
        self.count = 0

    def say(self, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self.last > self.quiet:
            self.count = 0
            log.warning("%s: ENOSPC: %s (further ENOSPC answers within %.0f s of each other are not logged)", what, exc, self.quiet)
        self.count += 1
        self.last = now


FULL = Episode()  # the mount's ENOSPC answers (the nodes say what holds their memory: server/budget.py)


def _telling(exc: BaseException) -> int:
    """How much an error of a group says of why the request failed (lower: more). A bug first
    (its traceback is logged); then an answer of the cluster's; then a node or transport
    fault; a timeout last (the others are usually why it ran out of time)."""
    if isinstance(exc, (FsError, RemoteError)):
        return 1
    if isinstance(exc, (Unavailable, NodeDown, TornRead, AccessError, TransportError)):
        return 2
    if isinstance(exc, trio.TooSlowError):
        return 3
    return 0


def most_telling(exc: BaseException) -> BaseException:
    """``exc`` itself, or for a group the error of it that says most of why (``_telling``)."""
    return min(leaves(exc), key=_telling) if isinstance(exc, BaseExceptionGroup) else exc


def _errno_for(exc: BaseException, what: str) -> int:
    """The errno for what a file system operation ``what`` raised; logs what is not the caller's
    fault (a node down, an unexpected exception with its traceback)."""
    if isinstance(exc, BaseExceptionGroup):  # the pieces of one request, failed concurrently
        inner = list(leaves(exc))
        if len(inner) > 1:
            log.info("%s: %d concurrent errors; answered by the most telling", what, len(inner))
        return _errno_for(most_telling(exc), what)
    if isinstance(exc, FsError):
        return exc.errno
    if isinstance(exc, RemoteError):
        if exc.code == "ENOSPC":
            FULL.say(what, exc)
        if exc.code in REMOTE_ERRNO:
            return REMOTE_ERRNO[exc.code]
        log.error("%s: cluster error %s", what, exc)
        return errno.EIO
    if isinstance(exc, (Unavailable, NodeDown, TornRead, AccessError, TransportError)):
        log.error("%s: %s", what, exc)  # names the node and stripe
        return errno.EIO
    if isinstance(exc, trio.TooSlowError):
        log.error("%s: timed out", what)
        return errno.ETIMEDOUT
    log.error("%s: unexpected error", what, exc_info=exc)
    return errno.EIO


ANSWERED: collections.Counter[str] = collections.Counter()  # errno name -> answers (irdmafs_mount_errors_total)


def errno_for(exc: BaseException, what: str) -> int:
    """The errno for what a file system operation ``what`` raised (``_errno_for``), counted by
    its name in ANSWERED (the mount's metrics: which errors its users got, and how many)."""
    code = _errno_for(exc, what)
    ANSWERED[errno.errorcode.get(code, str(code))] += 1
    return code
