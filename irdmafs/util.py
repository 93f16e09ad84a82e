"""Small helpers shared across layers."""

from __future__ import annotations

import array
import contextlib
import logging
import os
import socket
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


async def send_with_fd(sock: Any, data: bytes, fd: int | None = None) -> None:
    """All of ``data`` on a trio Unix socket, ``fd`` (if given) passed along with its first
    byte (``SCM_RIGHTS``)."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))] if fd is not None else []
    sent = await sock.sendmsg([data], anc)
    while sent < len(data):
        sent += await sock.send(data[sent:])


async def recv_with_fds(sock: Any, n: int) -> tuple[bytes | None, list[int]]:
    """Exactly ``n`` bytes from a trio Unix socket and the descriptors that came with them;
    (None, []) if the peer closed before the first byte, EOFError if it closed mid-way. On any
    failure the descriptors received so far are closed."""
    data, fds = bytearray(), []
    try:
        while len(data) < n:
            chunk, anc, _flags, _addr = await sock.recvmsg(n - len(data), socket.CMSG_SPACE(4 * 4))
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(payload[: len(payload) - len(payload) % 4])
                    fds.extend(got)
            if not chunk:
                if data:
                    raise EOFError(f"connection closed after {len(data)} of {n} bytes")
                for fd in fds:
                    os.close(fd)
                return None, []
            data += chunk
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return bytes(data), fds


@contextlib.contextmanager
def single_exception(alike: type[BaseException] | None = None) -> Iterator[None]:
    """Re-raise the one exception of an exception group as itself.

    Trio wraps everything leaving a nursery in an ExceptionGroup; at an API edge whose callers
    expect ``except RemoteError`` to work, a group holding exactly one exception is unwrapped.
    Groups of several errors stay groups: those are real concurrent failures, unless every one
    is an ``alike`` (the pieces of one request refused alike): then the first is raised."""
    try:
        yield
    except BaseExceptionGroup as group:
        inner = list(leaves(group))
        if len(inner) == 1 or (alike is not None and all(isinstance(e, alike) for e in inner)):
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


class Shared:
    """One run at a time for each key: a caller that finds a run of its key under way waits for
    that one to end instead of starting another (what it learns is in the shared state it
    updates). Concurrency: one trio thread."""

    def __init__(self) -> None:
        self._running: dict[Any, trio.Event] = {}

    async def run(self, key: Any, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        done = self._running.get(key)
        if done is not None:
            await done.wait()
            return
        done = self._running[key] = trio.Event()
        try:
            await fn(*args)
        finally:
            del self._running[key]
            done.set()
