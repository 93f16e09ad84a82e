"""The second door to the step streams: memory a worker shares with the mount.

The FUSE files stay the interface for every tool; a training step can instead go through a
memory region the worker maps, which the mount fills from and drains to the nodes directly (on
shm, a copy between two mappings; on tcp, ``recv_into``/``sendmsg`` on it; on verbs, memory the
NIC would read and write). No ``/dev/fuse`` copy, no page cache, no copy in Python.

How a worker gets in (the file's permissions decide who may):
1. it reads ``.workers/<rank>/<model>.door`` (mode and owner: the model directory's, as for the
   step stream): the content is this mount's socket name and a one-time *ticket*, bound to the
   rank, the model and the reader's uid, valid for ``TICKET_SECONDS``;
2. it connects to that abstract Unix socket and sends the ticket; the mount checks it and the
   peer's uid (``SO_PEERCRED``), lays out the model's stream and answers with the region's
   descriptor (``SCM_RIGHTS``) and where the two areas are;
3. then it sends requests, one at a time: ``push`` (the push area holds a safetensors stream of
   the step's gradients: the mount wrote the model's header there; the worker fills the data),
   ``pull`` (the pull area is filled with every parameter as the policy lets the rank see them),
   ``step`` (both, overlapped: each tensor's pull starts once its own push is taken),
   ``fsync`` (every push applied), ``release`` (see below), ``check`` (ESTALE if the model's
   tensors changed, asked by a worker that met a name its layout lacks). Each is answered ``{"ok": 1}`` or ``{"errno": N, "error":
   NAME, "message": ...}`` with the errno the stream file's ``close``/``read`` would give: the
   same validation, policies, compression and exactly-once pushes, through the same code
   (streams.push_stream, streams.pull_stream).

The region: ``[push area | pull area]``, each the size of the model's stream, page-aligned. The
client keeps pushes of a round still open as views of the push area (to replay them if the
stripe's primary is lost), so the worker writes the push area only once it has been *released*
since its last push: a ``pull`` answer releases it (after ``Client.detach``, which copies out
what is still kept: under bsp the pull saw the round closed, so nothing), and so does a
``release`` request, which a worker that pushes twice without pulling sends first. A model
whose tensors changed since the door opened answers ``ESTALE``: open it
again. Frames on the socket: a 4-byte little-endian length, then a JSON document.

Concurrency: one task per worker connection, in the mount's nursery; requests of one worker are
served in order. A worker that goes away takes its region with it (the mount unmaps it).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import secrets
import socket as _stdsocket
import struct
from dataclasses import dataclass

import numpy as np
import trio

from ..errors import FsError, RemoteError, TransportError
from ..util import accept_forever, recv_with_fds, send_with_fd
from .errnos import errno_for, most_telling
from .streams import pull_stream, push_stream, step_stream

log = logging.getLogger(__name__)

TICKET_SECONDS = 30.0
MAX_FRAME = 1 << 20
MAX_TICKET_FRAME = 4096  # what a worker may send before its ticket is checked
MAX_SESSIONS = 256  # doors open at once on one mount (each maps twice a model)
LENGTH = struct.Struct("<I")
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
F_SEAL_SHRINK, F_SEAL_GROW = 0x0002, 0x0004  # linux/fcntl.h


@dataclass(frozen=True)
class Ticket:
    rank: int
    model: int
    uid: int
    expires: float


async def send_frame(sock, doc: dict, fd: int | None = None) -> None:
    """One JSON frame (and a descriptor with its first byte)."""
    body = json.dumps(doc, separators=(",", ":")).encode()
    await send_with_fd(sock, LENGTH.pack(len(body)) + body, fd)


async def recv_frame(sock, limit: int = MAX_FRAME) -> tuple[dict | None, list[int]]:
    """One JSON frame of at most ``limit`` bytes and the descriptors that came with it (the
    caller closes them); (None, []) at a clean end. ValueError for a malformed frame."""
    head, fds = await recv_with_fds(sock, LENGTH.size)
    if head is None:
        return None, []
    try:
        (n,) = LENGTH.unpack(head)
        if n > limit:
            raise ValueError(f"frame of {n} bytes (at most {limit})")
        body, more = await recv_with_fds(sock, n) if n else (b"", [])
        fds += more
        if body is None:
            raise ValueError("frame cut short")
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError, EOFError) as exc:  # json.loads of "[[[[..." recurses
        for fd in fds:
            os.close(fd)
        raise ValueError(f"malformed frame: {type(exc).__name__}: {str(exc)[:200]}") from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return doc, fds


def _area(nbytes: int) -> int:
    return (max(nbytes, 1) + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


class DoorServer:
    """The mount's side of the door: tickets for the ``.door`` files, and one session per
    worker that came in with one."""

    def __init__(self, streams) -> None:
        self.streams = streams
        self.name = f"irdmafs-door-{secrets.token_hex(12)}"
        self._tickets: dict[str, Ticket] = {}
        self.sessions = 0

    def ticket(self, rank: int, model: int, uid: int) -> bytes:
        """The content of ``.workers/<rank>/<model>.door`` for a reader of ``uid``."""
        now = trio.current_time()
        for key in [k for k, t in self._tickets.items() if t.expires < now]:
            del self._tickets[key]
        key = secrets.token_hex(16)
        self._tickets[key] = Ticket(rank, model, uid, now + TICKET_SECONDS)
        return json.dumps({"socket": self.name, "ticket": key, "rank": rank}).encode() + b"\n"

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listener = trio.socket.socket(_stdsocket.AF_UNIX, _stdsocket.SOCK_STREAM)
        with listener:
            await listener.bind("\0" + self.name)
            listener.listen(64)
            task_status.started()
            await accept_forever(listener, self._session, "door")

    async def _session(self, sock) -> None:
        """One worker's connection, from its ticket to its leaving. Nothing it sends or does
        (junk, a peer gone mid-answer, a model that cannot be laid out) ends anything but this
        connection: the door server runs in the mount's own nursery."""
        with sock:
            try:
                await self._admit_and_serve(sock)
            except (OSError, ValueError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                log.info("door: a worker's connection ended: %s", exc)
            except Exception:  # noqa: BLE001 -- a bug here must not take the mount down
                log.exception("door: a worker's connection failed")

    async def _admit_and_serve(self, sock) -> None:
        with trio.fail_after(TICKET_SECONDS):
            doc, fds = await recv_frame(sock, MAX_TICKET_FRAME)
            for fd in fds:
                os.close(fd)
            if doc is None:
                return
            ticket = self._admit(sock, doc)
            if ticket is None:
                await send_frame(sock, {"errno": errno.EACCES, "error": "EACCES", "message": "no such ticket, expired, or another user's"})
                return
            if self.sessions >= MAX_SESSIONS:
                await send_frame(sock, {"errno": errno.EAGAIN, "error": "EAGAIN", "message": f"{MAX_SESSIONS} doors open on this mount"})
                return
            try:
                session = await _Session.open(self.streams, ticket)
            except (FsError, RemoteError, TransportError) as exc:  # the model cannot be laid out
                code = errno_for(exc, "door open")
                await send_frame(sock, {"errno": code, "error": errno.errorcode.get(code, "EIO"), "message": str(exc)})
                return
        self.sessions += 1
        try:
            await session.run(sock)
        finally:
            self.sessions -= 1
            await session.aclose()

    def _admit(self, sock, doc: dict) -> Ticket | None:
        ticket = self._tickets.pop(str(doc.get("ticket", "")), None)
        if ticket is None or ticket.expires < trio.current_time():
            return None
        _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(_stdsocket.SOL_SOCKET, _stdsocket.SO_PEERCRED, _PEERCRED.size))
        if uid not in (ticket.uid, 0):
            log.warning("door: uid %d came with a ticket of uid %d: refused", uid, ticket.uid)
            return None
        return ticket


class _Session:
    """One worker's door: its region and the model layout it was made for."""

    def __init__(self, streams, ticket: Ticket, layout, fd: int, region: mmap.mmap, pull_at: int):
        self.streams, self.rank, self.model = streams, ticket.rank, ticket.model
        self.layout, self.fd, self.region, self.pull_at = layout, fd, region, pull_at
        view = memoryview(region)
        self.push_area = view[: layout.size]
        self.pull_area = view[pull_at : pull_at + layout.size]
        # what the client may keep views of (open rounds): an array over the push area
        self.owner = np.frombuffer(region, np.uint8, layout.size)

    @classmethod
    async def open(cls, streams, ticket: Ticket) -> "_Session":
        layout = await streams.layouts.get(ticket.model, fresh=True)
        pull_at = _area(layout.size)
        fd = os.memfd_create(f"irdmafs-door-{ticket.rank}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 2 * pull_at)
            # a worker that truncated it would have the mount's next copy fault (SIGBUS)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW)
            region = mmap.mmap(fd, 2 * pull_at)
        except BaseException:
            os.close(fd)
            raise
        head = len(layout.header)
        region[:head] = layout.header
        region[pull_at : pull_at + head] = layout.header
        return cls(streams, ticket, layout, fd, region, pull_at)

    async def run(self, sock) -> None:
        layout = {"size": self.layout.size, "push": 0, "pull": self.pull_at, "header": len(self.layout.header), "region": 2 * self.pull_at}
        await send_frame(sock, {"ok": 1} | layout, self.fd)
        os.close(self.fd)
        self.fd = -1
        while True:
            doc, fds = await recv_frame(sock)
            for fd in fds:
                os.close(fd)
            if doc is None:
                return
            try:
                await self.serve(str(doc.get("op")), doc)
                answer = {"ok": 1}
            except Exception as exc:  # noqa: BLE001 -- the errno table decides what it is
                code = errno_for(exc, f"door {doc.get('op')}")
                answer = {"errno": code, "error": errno.errorcode.get(code, "EIO"), "message": str(most_telling(exc))}
            await send_frame(sock, answer)

    async def serve(self, op: str, doc: dict) -> None:
        if op == "push":
            await self._fresh()
            await push_stream(self.streams, self.rank, self.model, self.push_area, owner=self.owner, only=self._only(doc))
        elif op == "step":  # a push and the pull after it, overlapped (streams.step_stream)
            await self._fresh()
            only = self._only(doc)
            await step_stream(self.streams, self.rank, self.model, self.push_area, self.layout, self.pull_area, owner=self.owner, only=only)
            await self.streams.client.training.detach_off_loop(self.owner)
        elif op == "pull":
            await self._fresh()
            await pull_stream(self.streams, self.rank, self.layout, self.pull_area)
            await self.streams.client.training.detach_off_loop(self.owner)  # released: the worker may write it again
        elif op == "check":  # the worker met a tensor name its layout lacks: still current?
            await self._fresh(reread=True)
        elif op == "release":
            await self.streams.client.training.detach_off_loop(self.owner)
        elif op == "fsync":
            for ino in self.streams.client.training.pushed_tensors(self.rank):
                await self.streams.client.training.wait_applied(ino, self.rank)
        else:
            raise FsError(errno.EINVAL, f"unknown door request {op!r}")

    @staticmethod
    def _only(doc: dict) -> set[str] | None:
        only = doc.get("only")
        if only is not None and not (isinstance(only, list) and all(isinstance(x, str) for x in only)):
            raise FsError(errno.EINVAL, "'only' is a list of tensor names")
        return None if only is None else set(only)

    async def _fresh(self, reread: bool = False) -> None:
        now = await self.streams.layouts.get(self.model, fresh=reread)
        if now.header != self.layout.header:
            raise FsError(errno.ESTALE, "the model's tensors changed since the door opened: open it again")
        self.layout = now  # (the same stream, its tensors perhaps packed or unpacked since)

    async def aclose(self) -> None:
        """The worker left: the pushes still kept as views of its region are copied and the
        region unmapped, both in a worker thread (a GB model's door held the mount's loop 1.7 s
        closing: a second of copies, half a second of munmap; issue 41)."""
        if self.fd >= 0:
            os.close(self.fd)
        training = self.streams.client.training
        with trio.CancelScope(shield=True):  # the kept pushes must not stay views of an unmapped region
            await training.detach_off_loop(self.owner)
            self.owner = None
            region, self.region = self.region, None
            try:
                self.push_area.release()
                self.pull_area.release()
                await training.offload.run(region.close)
            except BufferError:  # a view of it still lives: unmapped once the last one goes
                pass
