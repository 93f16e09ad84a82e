"""A file's bytes by inode: read, write, extend and truncate, through ``StripeIO`` (stripe.py).

Owns the byte-range side of the inode level API (``client.data``; Client forwards ``read``,
``read_into``, ``write`` and ``truncate``): reads of plain and packed files, writes and the
namespace ops that make their bytes count (``extend``: the stripes written since the last one
are recorded as holding bytes, held.py), the release of what a failed write left past the end,
and truncates that zero the tail of the last stripe. What a write has committed and not yet
extended over is StripeIO's (``io.written``); the namespace ops go through MetaCalls (meta.py).
"""

from __future__ import annotations

import logging
import stat as S
from typing import Any, Awaitable, Callable

import trio

from .. import held
from ..config import ClusterConfig
from ..errors import NodeDown, RemoteError, TransportError, Unavailable
from ..packing import in_force
from ..runtime.cluster import Cluster
from ..transport.base import Gather
from .buckets import split_read
from .stripe import Extent, StripeIO

log = logging.getLogger(__name__)

Call = Callable[..., Awaitable[dict]]


class FileData:
    def __init__(self, cfg: ClusterConfig, cluster: Cluster, owner: str, io: StripeIO, getattr: Call, op: Call) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.owner = owner
        self.io = io
        self.getattr = getattr  # the file's attributes at the metadata primary (Client.getattr)
        self.op = op  # a namespace op (MetaCalls.op)

    async def writing(self, ino: int) -> dict:
        """This client's first change of a file it neither created nor truncated: the file is
        unfinished until this client says it is done (``written``; server/nsops.py, W1)."""
        return await self.op(op="writing", ino=ino, writer=self.owner)

    async def written(self, ino: int) -> dict:
        """This client is done writing the file, every write of it flushed (W2)."""
        return await self.op(op="written", ino=ino, writer=self.owner)

    async def extend(self, ino: int, size: int) -> dict:
        """Content changed up to ``size``: grow the file if needed, move mtime and version,
        and record the stripes written since the last extend (``StripeIO.written``) as holding
        bytes: a stripe a node loses then reads as EIO, not zeros (held.py). A failed extend
        keeps them for the next one."""
        idxs = self.io.written.pop(ino, {})
        try:
            written = {"stripes": held.runs_of(idxs), "made": min(idxs.values())} if idxs else {}
            return await self.op(op="extend", ino=ino, size=size, **written)
        except BaseException:
            if idxs:
                mine = self.io.written.setdefault(ino, {})
                for i, v in idxs.items():
                    mine[i] = max(mine.get(i, 0), v)
            raise

    async def read_into(self, ino: int, offset: int, into: memoryview, attr: dict | None = None, snap: int = 0) -> int:
        """Read from ``offset`` into ``into``; returns the bytes read (short at end of file)."""
        attr = attr or await self.getattr(ino, snap)
        if S.S_ISDIR(attr["mode"]):
            raise RemoteError("EISDIR", "is a directory")
        if not in_force(attr):
            return await self.io.read(Extent(ino, attr["size"], attr["unit"], snap), offset, into)
        # a packed tensor: its header from its own stripes, its data from its bucket's
        parts = split_read(attr, offset, len(into))
        async with trio.open_nursery() as n:
            for extent, off, pos, length in parts:
                n.start_soon(self.io.read, extent._replace(snap=snap), off, into[pos : pos + length])
        return sum(p[3] for p in parts)

    async def read_many(self, reads: list[tuple[int, int, memoryview, dict]]) -> None:
        """Fill each ``into`` of (ino, offset, into, attr) from its live file, all at once (many
        small files in a burst per node: StripeIO.read_small); each ``into`` lies within its
        file."""
        items = []
        for ino, offset, into, attr in reads:
            for extent, off, pos, length in split_read(dict(attr, ino=ino), offset, len(into)):
                items.append((extent.fid, extent.size, extent.unit, off, into[pos : pos + length]))
        await self.io.read_small(items)

    async def read(self, ino: int, offset: int, length: int, attr: dict | None = None, snap: int = 0) -> bytes:
        buf = bytearray(length)
        n = await self.read_into(ino, offset, memoryview(buf), attr, snap)
        # copied out, never resized: a failure a replica raised on the way (its traceback holds
        # frames that held views of ``buf``) may outlive the read until the cycle collector runs
        return bytes(memoryview(buf)[:n])

    async def write(self, ino: int, offset: int, data: Any, attr: dict | None = None, *, extend: bool = True) -> dict | None:
        """Write bytes (a buffer, or a ``Gather`` of them) at ``offset``. When it returns, the
        data is on every live replica; with ``extend`` (the default) the new size is visible to
        every client too and the new attributes are returned. The file system passes
        extend=False and calls ``extend`` once at flush, which is when POSIX close-to-open
        consistency needs it."""
        if offset < 0:
            raise RemoteError("EINVAL", f"negative offset {offset}")
        attr = attr or await self.getattr(ino)
        if S.S_ISDIR(attr["mode"]):
            raise RemoteError("EISDIR", "is a directory")
        view = data if isinstance(data, Gather) else memoryview(data).cast("B")
        try:
            await self.io.write(ino, attr["unit"], offset, view)
        except Exception:
            if extend:  # (the file system frees at the flush that reports it: fs/handles.py)
                await self.free_past_end(ino)
            raise
        return await self.extend(ino, offset + len(view)) if extend else None

    async def free_past_end(self, ino: int) -> dict | None:
        """After a write that failed (ENOSPC, EIO, a node lost): the stripes this client
        committed and never extended the file over hold memory nobody can read. It gives them
        up at each one's primary (``release_tails``, server/tails.py), which trims those no
        other writer committed to since they went past the end (a namespace op in order with
        the extends, by stamp: another mount writing past the end meanwhile keeps what it
        wrote, and a stripe its extend grew the file over is not past the end). Not a truncate
        to the file's size, which would have taken such a writer's committed stripes before
        its extend came. (Bytes written past the end inside the file's last stripe stay, as
        any failed write's bytes inside a stripe do.) Best effort, shielded: the write's own
        error is what the caller reports; a failure here is logged and leaves the space to the
        primaries (once this client's staging lease ends) or the next truncate or unlink.
        Answers the file's attributes (None if it could not)."""
        with trio.CancelScope(shield=True), trio.move_on_after(self.cfg.op_timeout):
            try:
                mine = dict(self.io.written.get(ino, {}))  # (before any await: later writes are not this one's)
                attr = await self.getattr(ino)
                past = sorted(i for i in mine if attr["unit"] and i * attr["unit"] >= held.extent_end(attr))
                by_primary: dict[str, list[int]] = {}
                for i in past:
                    if (primary := self.cluster.roles.stripe_primary(ino, i)) is not None:
                        by_primary.setdefault(primary, []).append(i)
                released = 0
                for node, idxs in by_primary.items():
                    released += (await self.cluster.call(node, "release_tails", {"owner": self.owner, "fid": ino, "idxs": idxs}))["released"]
                for i in past:
                    if self.io.written.get(ino, {}).get(i) == mine[i]:
                        self.io.written[ino].pop(i, None)
                if past:
                    log.info("file %d: %d stripes a failed write left past its end given up", ino, released)
                return attr
            except (RemoteError, TransportError, Unavailable, NodeDown) as exc:
                log.warning("file %d: the stripes a failed write left past its end not freed: %s", ino, exc)
        return None

    async def truncate(self, ino: int, size: int, *, written: int = 0, writer: str | None = None, **attrs: Any) -> dict:
        """Set the size; ``written``: how far this client wrote data the file's size does not
        show yet (write-behind), which must be zeroed as well; ``writer``: cut or grown by that
        writer, which marks the file unfinished until it is done (server/nsops.py, W1)."""
        attr = await self.getattr(ino)
        old, unit = max(attr["size"], written), attr["unit"]
        mark = {"writer": writer} if writer else {}
        result = await self.op(op="setattr", ino=ino, attrs=dict(attrs, size=size), **mark)
        if unit and ino in self.io.written:  # what the truncate dropped holds nothing any more
            self.io.written[ino] = {i: v for i, v in self.io.written[ino].items() if i < -(-size // unit)}
        # Whole stripes past the end were dropped by every node; the tail of the last one must
        # read as zeros if the file grows again, so it is zeroed through the normal write path.
        if unit and size < old and size % unit:
            end = min(old, (size // unit + 1) * unit)
            await self.io.write(ino, unit, size, memoryview(bytes(end - size)))
        self.io.forget(ino)
        return result
