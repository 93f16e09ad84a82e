"""Small helpers shared across layers."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Awaitable, Callable, Iterator

import trio

log = logging.getLogger(__name__)


async def accept_forever(listener: Any, serve: Callable[[Any], Awaitable[None]], what: str) -> None:
    """Accept connections on a listening trio socket until cancelled, each served by
    ``serve(sock)`` in a task of its own; a failed accept (EMFILE and friends) backs off and
    listening goes on."""
    async with trio.open_nursery() as nursery:
        while True:
            try:
                sock, _ = await listener.accept()
            except OSError as exc:
                log.warning("%s: accept failed: %s", what, exc)
                await trio.sleep(0.1)
                continue
            nursery.start_soon(serve, sock)


@contextlib.contextmanager
def single_exception() -> Iterator[None]:
    """Re-raise the one exception of an exception group as itself.

    Trio wraps everything leaving a nursery in an ExceptionGroup; at an API edge whose callers
    expect ``except RemoteError`` to work, a group holding exactly one exception is unwrapped.
    Groups of several errors stay groups: those are real concurrent failures."""
    try:
        yield
    except BaseExceptionGroup as group:
        inner = list(leaves(group))
        if len(inner) == 1:
            raise inner[0] from None
        raise


def leaves(exc: BaseException) -> Iterator[BaseException]:
    """Every exception inside ``exc``, groups flattened."""
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from leaves(e)
    else:
        yield exc


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of handing it back to the kernel.

    A node or a mount allocates and frees buffers of 1-4 MiB by the hundred per training step
    (pyfuse3's request bytes, stripe-sized sums and reads). glibc serves such sizes with mmap
    and gives them back at free, or trims them off the heap, so every step faults every page
    in again: measured here at several times the cost of the copy into them. With the mmap
    threshold at its maximum and no trimming, freed blocks are reused as they are; the price
    is that a process's resident size stays at its peak. False where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))
